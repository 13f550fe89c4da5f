"""Seconds for the look-ups every launch makes of each metadata row's file, before any header is read: whether it is
there (``missing_files``: the plan, and every rank of a resume) and its fingerprint (``fingerprint_keys``: the size
table's key, in the plan, the doctor and rank 0), against the way they were made before (a thread-pool task per
file; ``realpath`` of every file, each looking up every folder above it again).

    python benchmarks/bench_file_checks.py [--rows 170000] [--runs 5] [--json out.json]

The catalogue: ``--rows`` files in one folder (hard links to a few small files: each its own path). Each figure is the
median of ``--runs``, the two ways alternating in this process.
"""

from __future__ import annotations

import argparse
import json
import os
import stat
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from diffsynth_mbc.data.media.size_table import fingerprint_keys  # noqa: E402
from diffsynth_mbc.data.metadata_csv import missing_files  # noqa: E402


def missing_files_before(rows: list[dict], base_path: str) -> list[int]:
    """The look-up as it was: a thread-pool task per file (``chunksize`` means nothing to a thread pool)."""
    paths = [os.path.join(base_path or "", str(row.get("video") or "")) for row in rows]
    with ThreadPoolExecutor(max_workers=16) as pool:
        found = list(pool.map(os.path.isfile, paths, chunksize=256))
    return [number for number, there in enumerate(found, 1) if not there]


def fingerprint_keys_before(paths: list[str]) -> list[str | None]:
    """The fingerprint as it was: ``realpath`` and ``stat`` of every file."""
    keys = []
    for path in paths:
        try:
            resolved = os.path.realpath(path)
            info = os.stat(resolved)
        except (OSError, ValueError):
            keys.append(None)
            continue
        keys.append(f"{info.st_size}:{info.st_mtime_ns}:{info.st_ctime_ns}:{resolved}" if stat.S_ISREG(info.st_mode)
                    else None)
    return keys


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=170_000)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--json", help="also write the results here")
    return parser


def timed(call) -> tuple[float, object]:
    started = time.perf_counter()
    answer = call()
    return time.perf_counter() - started, answer


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="bench-file-checks-") as scratch:
        folder = Path(scratch)
        (folder / "media").mkdir()
        sources = [folder / f"source-{number}.bin" for number in range(args.rows // 60_000 + 1)]
        for source in sources:   # a file takes some 65,000 links
            source.write_bytes(b"x" * 64)
        rows = []
        for index in range(args.rows):
            os.link(sources[index % len(sources)], folder / "media" / f"{index:06d}.mp4")
            rows.append({"video": f"media/{index:06d}.mp4"})
        rows.append({"video": "media/missing.mp4"})
        paths = [os.path.join(scratch, row["video"]) for row in rows]
        times = {name: [] for name in ("missing_before", "missing_after", "keys_before", "keys_after")}
        for _ in range(args.runs):
            for name, call in (("missing_before", lambda: missing_files_before(rows, scratch)),
                               ("missing_after", lambda: missing_files(rows, scratch)),
                               ("keys_before", lambda: fingerprint_keys_before(paths)),
                               ("keys_after", lambda: fingerprint_keys(paths))):
                seconds, answer = timed(call)
                times[name].append(seconds)
                if name.startswith("missing"):
                    assert answer == [len(rows)], name
                else:
                    assert answer[-1] is None and all(answer[:-1]), name
        assert fingerprint_keys(paths) == fingerprint_keys_before(paths)
    median = {name: statistics.median(values) for name, values in times.items()}
    result = {"rows": args.rows, "runs": args.runs, "cpus": os.cpu_count(), **median,
              "missing_ratio": median["missing_after"] / median["missing_before"],
              "keys_ratio": median["keys_after"] / median["keys_before"]}
    print(f"{args.rows:,} files, {os.cpu_count()} CPUs, median of {args.runs}:")
    print(f"  which files are there: {median['missing_before']:.2f} s before, {median['missing_after']:.2f} s now "
          f"({result['missing_ratio']:.2f}x)")
    print(f"  fingerprints:          {median['keys_before']:.2f} s before, {median['keys_after']:.2f} s now "
          f"({result['keys_ratio']:.2f}x)")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
