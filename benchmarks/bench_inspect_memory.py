"""Peak memory and seconds of ``convert --inspect --frame_sampling random_window`` on one long clip: the streamed
measures (``run_inspection.measure_item``: the frames pass through ``WindowMeter`` as they decode) against the whole
window held at once (``read_window`` then ``measure_window``, what the inspection did before), each in a fresh
process, alternating.

    python benchmarks/bench_inspect_memory.py [--minutes 2] [--size 1280x720] [--runs 3] [--json out.json]

The clip: ffmpeg's testsrc2 at 30 fps, H.264 (ultrafast), written once into a temp folder.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import imageio_ffmpeg

REPO = Path(__file__).resolve().parents[1]
MEASURE = """
import json, resource, sys, time
sys.path.insert(0, {repo!r})
from diffsynth_mbc.data.inspect.measures import measure_window
from diffsynth_mbc.data.inspect.run_inspection import InspectItem, measure_item
from diffsynth_mbc.data.inspect.window import InspectWindow, read_window
window = InspectWindow(17, "random_window")
started = time.perf_counter()
if sys.argv[1] == "streamed":
    result = measure_item(InspectItem(sys.argv[2], "video", int(sys.argv[3]), 30.0), window)
    assert result.error is None, result.error
else:
    measure_window(read_window(sys.argv[2], "video", window, available=int(sys.argv[3]), fps=30.0).frames)
print(json.dumps({{"seconds": time.perf_counter() - started,
                   "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}}))
"""


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=2.0)
    parser.add_argument("--size", default="1280x720")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    frames = round(args.minutes * 60 * 30)
    with tempfile.TemporaryDirectory(prefix="bench-inspect-") as scratch:
        path = str(Path(scratch) / "long.mp4")
        subprocess.run([imageio_ffmpeg.get_ffmpeg_exe(), "-y", "-loglevel", "error", "-f", "lavfi", "-i",
                        f"testsrc2=size={args.size}:rate=30", "-frames:v", str(frames), "-c:v", "libx264",
                        "-preset", "ultrafast", "-pix_fmt", "yuv420p", path], check=True)
        runs: dict[str, list[dict]] = {"whole": [], "streamed": []}
        for _ in range(args.runs):
            for mode in runs:
                output = subprocess.run([sys.executable, "-c", MEASURE.format(repo=str(REPO)), mode, path,
                                         str(frames)], check=True, capture_output=True, text=True).stdout
                runs[mode].append(json.loads(output.strip().splitlines()[-1]))
    result = {"frames": frames, "size": args.size, "runs": args.runs}
    for mode, measured in runs.items():
        result[mode] = {key: statistics.median(run[key] for run in measured) for key in ("seconds", "peak_rss_mb")}
    result["rss_ratio"] = result["streamed"]["peak_rss_mb"] / result["whole"]["peak_rss_mb"]
    result["seconds_ratio"] = result["streamed"]["seconds"] / result["whole"]["seconds"]
    print(f"{frames:,} frames of {args.size}, median of {args.runs}: whole window "
          f"{result['whole']['peak_rss_mb']:.0f} MB, {result['whole']['seconds']:.1f} s; streamed "
          f"{result['streamed']['peak_rss_mb']:.0f} MB, {result['streamed']['seconds']:.1f} s "
          f"(memory {result['rss_ratio']:.2f}x, time {result['seconds_ratio']:.2f}x)")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
