"""Clip loading: DiffSynth 1.1.8's VideoDataset.load_video vs our fast reader, and cache rows/s with each.

    python benchmarks/bench_decode.py [--runs 3] [--seconds 2 10 30] [--cache-clips 6] [--modes-only]

Generates 1280x720 30 fps clips with ffmpeg's testsrc2 (H.264, yuv420p; plus one HEVC if the bundled
ffmpeg has libx265), then for each: the median of --runs loads at 1280x704x17 through DiffSynth's reader
and through ours, in one run, with the ratio and the pixel difference. Then the end-to-end rows/s of
`python -m diffsynth_mbc.cache --demo` (tiny model, so decoding dominates) on a catalogue of 10-s
clips with --decoder diffsynth and --decoder fast, encoded at 64x64x17 so that the tiny VAE costs little
next to decoding the 1280x720 source.

Per frame mode (--frame_sampling head / uniform / random_window, and head at --source_fps 15): the same
loads on the 10-s clip through both readers, with the ratio, so each mode's speed-up is on record.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import imageio_ffmpeg
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from diffsynth_mbc.data.dataset import MBCVideoDataset  # noqa: E402
from diffsynth_mbc.data.media.frame_selection import FrameSelection  # noqa: E402

FFMPEG = imageio_ffmpeg.get_ffmpeg_exe()


def make_clip(path: Path, seconds: int, codec: str = "libx264") -> Path:
    subprocess.run([FFMPEG, "-y", "-loglevel", "error", "-f", "lavfi", "-i", "testsrc2=size=1280x720:rate=30",
                    "-t", str(seconds), "-c:v", codec, "-pix_fmt", "yuv420p", str(path)], check=True)
    return path


def has_x265() -> bool:
    result = subprocess.run([FFMPEG, "-hide_banner", "-encoders"], capture_output=True, text=True)
    return "libx265" in result.stdout


def loader(folder: Path, decoder: str, frames: FrameSelection | None = None) -> MBCVideoDataset:
    metadata = folder / "metadata.csv"
    if not metadata.exists():
        metadata.write_text("video,prompt\nx.mp4,x\n")
    return MBCVideoDataset(str(folder), str(metadata), num_frames=17, height=704, width=1280, decoder=decoder,
                           frames=frames)


MODES = {"head": FrameSelection(), "uniform": FrameSelection(sampling="uniform"),
         "random_window": FrameSelection(sampling="random_window", seed=1),
         "head @15fps": FrameSelection(source_fps=15.0)}


def bench_modes(folder: Path, clip: Path, runs: int) -> None:
    """Both readers in each frame mode on one clip (random_window: the window of epoch 0, sample 0)."""
    print(f"frame modes on {clip.name} at 1280x704x17, median of {runs} runs")
    print(f"{'mode':<14} {'DiffSynth (s)':>14} {'fast (s)':>10} {'speed-up':>9} {'max diff':>9}")
    for name, frames in MODES.items():
        time_slow, frames_slow = time_loads(loader(folder, "diffsynth", frames), clip, runs)
        time_fast, frames_fast = time_loads(loader(folder, "fast", frames), clip, runs)
        worst, _ = pixel_difference(frames_fast, frames_slow)
        print(f"{name:<14} {time_slow:>14.3f} {time_fast:>10.3f} {time_slow / time_fast:>8.1f}x {worst:>8.0f}/255")


def time_loads(dataset: MBCVideoDataset, clip: Path, runs: int) -> tuple[float, list]:
    times, frames = [], None
    for _ in range(runs):
        started = time.perf_counter()
        frames = dataset.load_video(str(clip))
        times.append(time.perf_counter() - started)
    return statistics.median(times), frames


def pixel_difference(a: list, b: list) -> tuple[float, float]:
    diffs = [np.abs(np.asarray(x, dtype=np.int16) - np.asarray(y, dtype=np.int16)) for x, y in zip(a, b)]
    return float(max(d.max() for d in diffs)), float(np.mean([d.mean() for d in diffs]))


def cache_rows_per_s(folder: Path, clips: list[Path], decoder: str) -> tuple[float, float]:
    """(rows/s of the whole command, rows/s of the cache job itself: its summary's seconds, which leave out the
    interpreter start and imports)."""
    catalog = folder / "catalog"
    catalog.mkdir(parents=True, exist_ok=True)
    lines = ["video,prompt,media_type"]
    for index, clip in enumerate(clips):
        target = catalog / f"clip{index}.mp4"
        if not target.exists():
            os.link(clip, target)   # its own path: entries are keyed by the resolved path
        lines.append(f"clip{index}.mp4,clip number {index},video")
    (folder / "metadata.csv").write_text("\n".join(lines) + "\n")
    cache_dir = folder / f"cache-{decoder}"
    started = time.perf_counter()
    subprocess.run([sys.executable, "-m", "diffsynth_mbc.cache", "--demo", "--dataset_base_path", str(catalog),
                    "--dataset_metadata_path", str(folder / "metadata.csv"), "--height", "64", "--width", "64",
                    "--num_frames", "17", "--cache_dir", str(cache_dir), "--dataset_num_workers", "0",
                    "--decoder", decoder], check=True, capture_output=True)
    whole = time.perf_counter() - started
    job = json.loads((cache_dir / "summary.json").read_text())["seconds"]
    return len(clips) / whole, len(clips) / job


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--seconds", type=int, nargs="+", default=[2, 10, 30])
    parser.add_argument("--cache-clips", type=int, default=12, help="10-s clips in the cache catalogue (0: skip)")
    parser.add_argument("--modes-only", "--modes_only", action="store_true", help="only the per-frame-mode table (a 10-s clip)")
    args = parser.parse_args()
    folder = Path(tempfile.mkdtemp(prefix="bench-decode-"))
    if args.modes_only:
        bench_modes(folder, make_clip(folder / "h264-10s.mp4", 10), args.runs)
        return 0
    clips = [(f"{s} s H.264", make_clip(folder / f"h264-{s}s.mp4", s)) for s in args.seconds]
    if has_x265():
        clips.append(("10 s HEVC", make_clip(folder / "hevc-10s.mp4", 10, "libx265")))
    slow, fast = loader(folder, "diffsynth"), loader(folder, "fast")
    print(f"clip loading at 1280x704x17, median of {args.runs} runs")
    print(f"{'clip':<14} {'DiffSynth (s)':>14} {'fast (s)':>10} {'speed-up':>9} {'max diff':>9} {'mean diff':>10}")
    for name, clip in clips:
        time_slow, frames_slow = time_loads(slow, clip, args.runs)
        time_fast, frames_fast = time_loads(fast, clip, args.runs)
        worst, mean = pixel_difference(frames_fast, frames_slow)
        print(f"{name:<14} {time_slow:>14.3f} {time_fast:>10.3f} {time_slow / time_fast:>8.1f}x "
              f"{worst:>8.0f}/255 {mean:>9.3f}/255")
    bench_modes(folder, make_clip(folder / "h264-10s.mp4", 10), args.runs)
    if args.cache_clips:
        tens = [make_clip(folder / "cache-10s.mp4", 10)] * args.cache_clips
        rates = {decoder: cache_rows_per_s(folder / "cache-run", tens, decoder) for decoder in ("diffsynth", "fast")}
        (slow_whole, slow_job), (fast_whole, fast_job) = rates["diffsynth"], rates["fast"]
        print(f"cache --demo at 64x64x17, {args.cache_clips} x 10-s 1280x720 clips, rows/s: "
              f"job diffsynth {slow_job:.2f} vs fast {fast_job:.2f} ({fast_job / slow_job:.1f}x); whole command "
              f"(with interpreter start and imports) {slow_whole:.2f} vs {fast_whole:.2f} "
              f"({fast_whole / slow_whole:.1f}x)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
