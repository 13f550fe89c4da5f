"""Time the converter on a catalogue the size of the MBC training set (170,180 rows), or its --inspect.

    python benchmarks/bench_convert.py [--rows 170180] [--runs 5]
    python benchmarks/bench_convert.py --inspect [--clips 96] [--runs 3] [--workers 2] [--grain]

Default: media files exist but are empty (the existence check is what costs; no --probe). Each run
converts the whole catalogue with ``python -m diffsynth_mbc.convert``'s ``main`` in-process and,
beside it, a naive baseline: ``pandas.read_csv`` and an ``os.path.exists`` loop over the rows.
Prints the median of each and their ratio.

--inspect: ``--clips`` distinct 1280x720 H.264 files (3 s of ffmpeg's testsrc2 at 30 fps, each clip another
part of a 1920x1080 picture, turned and in another hue, so that none is a near-duplicate of another; --grain adds moving film grain, which costs the decoder far more bits per frame). Each run
converts them with ``--probe`` (the baseline: what the converter did before --inspect) and with ``--probe
--inspect`` from an empty measure store (the 17-frame head window, ``--workers``), and prints the inspect
stage's clips per second (its own clock, summary.json) and both runs' wall times; then one more --inspect
run over the unchanged catalogue, which reuses every measure.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import io
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from diffsynth_mbc.data.convert import main as convert_main  # noqa: E402

CAPTIONS = (
    "뉴스 스튜디오에서 앵커가 말한다, 카메라는 천천히 다가간다.",
    'A reporter says "good evening", then turns to the screen.',
    "한강 위로 해가 지고, 구름이 흘러간다.\n밤이 온다.",
)


def write_catalog(root: Path, lines) -> Path:
    """root/catalog.csv in the MBC format as the team's export writes it: a UTF-8 BOM, CRLF line ends."""
    buffer = io.StringIO()
    writer = csv.writer(buffer, lineterminator="\r\n")
    writer.writerow(("file_path", "caption", "media_type"))
    writer.writerows(lines)
    catalog = root / "catalog.csv"
    catalog.write_bytes(b"\xef\xbb\xbf" + buffer.getvalue().encode("utf-8"))
    return catalog


def make_catalog(root: Path, rows: int) -> Path:
    """~47% videos, ~53% images (the MBC ratio), 1,000 files per folder, all files present."""
    lines = []
    for index in range(rows):
        is_video = index % 17 < 8
        folder = f"media/{'videos' if is_video else 'images'}/{index // 1000:04d}"
        name = f"{folder}/{index:06d}.{'mp4' if is_video else 'jpg'}"
        lines.append((name, f"{CAPTIONS[index % len(CAPTIONS)]} {index}", "Video" if is_video else "image"))
    for folder in {os.path.dirname(name) for name, _, _ in lines}:
        (root / folder).mkdir(parents=True, exist_ok=True)
    for name, _, _ in lines:
        (root / name).touch()
    return write_catalog(root, lines)


def naive_baseline(catalog: Path, base: Path) -> int:
    import pandas as pd

    frame = pd.read_csv(catalog)
    present = 0
    for file_path in frame["file_path"]:
        if os.path.exists(os.path.join(base, file_path)):
            present += 1
    return present


def make_clips(root: Path, clips: int, grain: bool) -> Path:
    """``clips`` distinct 1280x720 H.264 clips and their catalogue."""
    import imageio_ffmpeg

    ffmpeg = imageio_ffmpeg.get_ffmpeg_exe()
    (root / "clips").mkdir(parents=True, exist_ok=True)
    lines = []
    for index in range(clips):
        name = f"clips/{index:04d}.mp4"
        # another part of a larger picture, turned another way, in another hue: no clip repeats another
        crop = f"crop=1280:720:{index * 97 % 640}:{index * 53 % 360}"
        turn = ("", ",hflip", ",vflip", ",hflip,vflip")[index % 4]
        filters = f"{crop}{turn},hue=h={index * 37 % 360}" + (",noise=alls=12:allf=t" if grain else "")
        subprocess.run([ffmpeg, "-y", "-loglevel", "error", "-f", "lavfi", "-i",
                        "testsrc2=size=1920x1080:rate=30", "-ss", f"{index * 0.4:.1f}", "-t", "3", "-vf", filters,
                        "-c:v", "libx264", "-pix_fmt", "yuv420p", str(root / name)], check=True)
        lines.append((name, f"clip {index}", "video"))
    return write_catalog(root, lines)


def _convert_seconds(arguments: list[str]) -> float:
    started = time.perf_counter()
    with contextlib.redirect_stderr(io.StringIO()):
        status = convert_main(arguments)
    if status != 0:
        raise SystemExit(f"convert exited {status}: {' '.join(arguments)}")
    return time.perf_counter() - started


def bench_inspect(args) -> int:
    with tempfile.TemporaryDirectory(prefix="bench-inspect-") as tmp:
        root = Path(tmp)
        started = time.perf_counter()
        catalog = make_clips(root, args.clips, args.grain)
        print(f"made {args.clips} 1280x720 H.264 clips{' with grain' if args.grain else ''} in "
              f"{time.perf_counter() - started:.1f} s", flush=True)
        out = root / "out"
        common = [str(catalog), "--base-path", str(root), "--output", str(out), "--probe", "--workers",
                  str(args.workers)]
        probe_times, inspect_times, rates = [], [], []
        for run in range(args.runs):
            probe_times.append(_convert_seconds(common))
            (out / "inspect_measures.jsonl").unlink(missing_ok=True)
            inspect_times.append(_convert_seconds(common + ["--inspect"]))
            summary = json.loads((out / "summary.json").read_text())["inspect"]
            assert summary["measured"] == args.clips, summary
            rates.append(args.clips / summary["seconds"])
            print(f"run {run + 1}: --probe {probe_times[-1]:.2f} s, --probe --inspect {inspect_times[-1]:.2f} s, "
                  f"inspect stage {rates[-1]:.1f} clips/s", flush=True)
        flagged = {reason: count for reason, count in summary["flagged_rows"].items() if count}
        print(f"flagged: {flagged or 'nothing'}")
        again = _convert_seconds(common + ["--inspect"])
        reused = json.loads((out / "summary.json").read_text())["inspect"]["reused"]
        probe, inspect = statistics.median(probe_times), statistics.median(inspect_times)
        print(f"clips: {args.clips} x 1280x720 H.264{' + grain' if args.grain else ''}, workers: {args.workers}, "
              f"runs: {args.runs}, window: 17 frames (head)")
        print(f"--probe median: {probe:.2f} s; --probe --inspect median: {inspect:.2f} s "
              f"({inspect / probe:.2f}x the probe alone)")
        print(f"inspect stage median: {statistics.median(rates):.1f} clips/s "
              f"(min {min(rates):.1f}, max {max(rates):.1f}); "
              f"end to end: {args.clips / inspect:.1f} clips/s")
        print(f"second --inspect over the unchanged catalogue: {again:.2f} s, {reused} of {args.clips} reused")
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=170_180)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--inspect", action="store_true", help="time --probe --inspect on real 1280x720 clips")
    parser.add_argument("--clips", type=int, default=96)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--grain", action="store_true", help="clips with moving film grain (harder to decode)")
    args = parser.parse_args(argv)
    if args.inspect:
        return bench_inspect(args)

    with tempfile.TemporaryDirectory(prefix="bench-convert-") as tmp:
        root = Path(tmp)
        started = time.perf_counter()
        catalog = make_catalog(root, args.rows)
        print(f"made {args.rows} rows and files in {time.perf_counter() - started:.1f} s", flush=True)
        import pandas  # noqa: F401  (import once, outside the timings)

        convert_times, baseline_times = [], []
        for run in range(args.runs):
            started = time.perf_counter()
            with contextlib.redirect_stderr(io.StringIO()):
                status = convert_main([str(catalog), "--base-path", str(root), "--output", str(root / "out")])
            convert_times.append(time.perf_counter() - started)
            if status != 0:
                raise SystemExit(f"convert exited {status}")
            started = time.perf_counter()
            present = naive_baseline(catalog, root)
            baseline_times.append(time.perf_counter() - started)
            assert present == args.rows, present
            print(f"run {run + 1}: convert {convert_times[-1]:.2f} s, naive baseline {baseline_times[-1]:.2f} s",
                  flush=True)

        convert_median = statistics.median(convert_times)
        baseline_median = statistics.median(baseline_times)
        print(f"rows: {args.rows}, runs: {args.runs}")
        print(f"convert median:  {convert_median:.2f} s (min {min(convert_times):.2f}, max {max(convert_times):.2f})")
        print(f"naive pandas read + os.path.exists loop median: {baseline_median:.2f} s")
        print(f"convert / baseline: {convert_median / baseline_median:.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
