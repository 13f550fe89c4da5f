"""Time the converter on a catalogue the size of the MBC training set (170,180 rows).

    python benchmarks/bench_convert.py [--rows 170180] [--runs 5]

Media files exist but are empty (the existence check is what costs; no --probe). Each run
converts the whole catalogue with ``python -m diffsynth_mbc.convert``'s ``main`` in-process and,
beside it, a naive baseline: ``pandas.read_csv`` and an ``os.path.exists`` loop over the rows.
Prints the median of each and their ratio.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import io
import os
import statistics
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
    buffer = io.StringIO()
    writer = csv.writer(buffer, lineterminator="\r\n")
    writer.writerow(("file_path", "caption", "media_type"))
    writer.writerows(lines)
    catalog = root / "catalog.csv"
    catalog.write_bytes(b"\xef\xbb\xbf" + buffer.getvalue().encode("utf-8"))
    return catalog


def naive_baseline(catalog: Path, base: Path) -> int:
    import pandas as pd

    frame = pd.read_csv(catalog)
    present = 0
    for file_path in frame["file_path"]:
        if os.path.exists(os.path.join(base, file_path)):
            present += 1
    return present


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=170_180)
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args(argv)

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
