"""Seconds to size a catalogue without width/height columns under ``--buckets aspect``: one read of every file's
header (what the plan, the doctor and every rank each did before the size table) against the size table (read once
per run, then a ``stat`` per file and the table's JSON).

    python benchmarks/bench_size_table.py [--rows 170000] [--videos 0.47] [--runs 3] [--ranks 2] [--json out.json]

The catalogue: ``--rows`` metadata rows, ``--videos`` of them clips, each a hard link (its own path, so its own
fingerprint) to one of a few real files written here (H.264 clips of 9 frames and PNG/JPEG images, landscape,
portrait and square). Timed, each the median of ``--runs`` in this process (the in-process memory of sizes read
cleared before each):

- ``one_read``: ``row_sizes`` without a table: every header read (in parallel, the reader's default workers);
- ``table_build``: ``row_sizes`` with the run's table in a fresh folder: every header read, the table written;
- ``table_lookup``: ``row_sizes`` with that table: a ``stat`` per file, no header read.

Then a launch's start-up, before and after: the plan, the doctor and each of ``--ranks`` ranks each read every
header (``(2 + ranks) x one_read``), against one table build and a lookup for the doctor and rank 0 (the other
ranks take rank 0's sizes).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from diffsynth_mbc.data.demo_data import write_image, write_video  # noqa: E402
from diffsynth_mbc.data.media import size_table  # noqa: E402
from diffsynth_mbc.data.media.row_buckets import row_sizes  # noqa: E402

SOURCES = [("land.mp4", "video", 128, 72), ("port.mp4", "video", 72, 128), ("square.mp4", "video", 96, 96),
           ("land.jpg", "image", 160, 90), ("port.png", "image", 90, 160), ("square.png", "image", 64, 64)]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=170_000)
    parser.add_argument("--videos", type=float, default=0.47, help="the share of rows that are clips")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--ranks", type=int, default=2, help="ranks of the launch the start-up figures are for")
    parser.add_argument("--json", help="also write the results here")
    return parser


def catalogue(folder: Path, rows: int, video_share: float) -> list[dict]:
    """``rows`` metadata rows (no width/height columns), each file a hard link to one of SOURCES."""
    sources = folder / "sources"
    sources.mkdir()
    for name, kind, width, height in SOURCES:
        if kind == "video":
            write_video(sources / name, 9, width, height)
        else:
            write_image(sources / name, width, height)
    videos = [name for name, kind, *_ in SOURCES if kind == "video"]
    images = [name for name, kind, *_ in SOURCES if kind == "image"]
    media = folder / "media"
    media.mkdir()
    listed = []
    clips = round(rows * video_share)
    for index in range(rows):
        is_clip = index < clips
        pool = videos if is_clip else images
        source = pool[index % len(pool)]
        name = f"{index:06d}{Path(source).suffix}"
        os.link(sources / source, media / name)
        listed.append({"video": f"media/{name}", "media_type": "video" if is_clip else "image"})
    return listed


def timed(call) -> float:
    size_table._READ_HERE.clear()   # each run reads as a fresh process would
    started = time.perf_counter()
    call()
    return time.perf_counter() - started


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="bench-size-table-") as scratch:
        folder = Path(scratch)
        started = time.perf_counter()
        rows = catalogue(folder, args.rows, args.videos)
        print(f"catalogue: {len(rows):,} rows written in {time.perf_counter() - started:.1f} s", file=sys.stderr)
        base = str(folder)
        one_read, builds, lookups = [], [], []
        for run in range(args.runs):
            one_read.append(timed(lambda: row_sizes(rows, base)))
            out = folder / f"out-{run}"
            out.mkdir()
            table = size_table.table_path_in(out)
            builds.append(timed(lambda: row_sizes(rows, base, table_path=table)))
            lookups.append(timed(lambda: row_sizes(rows, base, table_path=table)))
            print(f"run {run + 1}: one read {one_read[-1]:.1f} s, table build {builds[-1]:.1f} s, "
                  f"lookup {lookups[-1]:.2f} s", file=sys.stderr)
        table_bytes = os.path.getsize(table)
    median = {"one_read_s": statistics.median(one_read), "table_build_s": statistics.median(builds),
              "table_lookup_s": statistics.median(lookups)}
    before = (2 + args.ranks) * median["one_read_s"]
    after = median["table_build_s"] + 2 * median["table_lookup_s"]
    result = {"rows": args.rows, "video_share": args.videos, "runs": args.runs, "ranks": args.ranks,
              "cpus": os.cpu_count(), **median, "table_bytes": table_bytes,
              "launch_start_before_s": before, "launch_start_after_s": after, "ratio": after / before}
    print(f"{args.rows:,} rows, {os.cpu_count()} CPUs, median of {args.runs}: one read of every header "
          f"{median['one_read_s']:.1f} s; table build {median['table_build_s']:.1f} s, lookup "
          f"{median['table_lookup_s']:.2f} s ({table_bytes / 1e6:.1f} MB)")
    print(f"launch start-up on {args.ranks} ranks (plan, doctor, ranks): {before:.1f} s before, {after:.1f} s "
          f"with the table ({after / before:.2f}x)")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
