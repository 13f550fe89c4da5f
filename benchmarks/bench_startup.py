"""CPU seconds of a training rank's start-up, with the garbage collector paused (as ``python -m diffsynth_mbc.train``
starts) and with it on, in fresh processes taken in turns, and the time the collector itself took in each.

    python benchmarks/bench_startup.py [--runs 5]

Each process imports what a rank imports before its first step (torch, accelerate, peft, DiffSynth, the training
loop) and builds the demo's pipeline on the CPU, then reports its CPU time (user + system) and the seconds spent
in collections (``gc.callbacks``). Printed: the median of each, and their ratio.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

CHILD = """
import gc, json, sys, time
spent = [0.0, 0.0]
def timed(phase, info):
    if phase == "start":
        spent[1] = time.process_time()
    else:
        spent[0] += time.process_time() - spent[1]
gc.callbacks.append(timed)
if sys.argv[1] == "paused":
    from diffsynth_mbc.lifecycle.startup import pause_collector
    pause_collector()
import torch, accelerate, peft, diffsynth
import diffsynth_mbc.training.recipe
from diffsynth_mbc.models.pipeline import build_demo_pipeline
import tempfile
with tempfile.TemporaryDirectory() as folder:
    build_demo_pipeline(device="cpu", torch_dtype=torch.float32, seed=42, tokenizer_dir=folder)
print(json.dumps({"cpu_s": time.process_time(), "gc_s": spent[0]}))
"""


def measure(mode: str) -> dict:
    done = subprocess.run([sys.executable, "-W", "ignore", "-c", CHILD, mode], capture_output=True, text=True,
                          cwd=REPO, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=5, help="processes per mode, taken in turns (default 5)")
    args = parser.parse_args(argv)
    results: dict[str, list[dict]] = {"on": [], "paused": []}
    for _ in range(args.runs):
        for mode in results:
            results[mode].append(measure(mode))
    medians = {mode: {key: statistics.median(run[key] for run in runs) for key in ("cpu_s", "gc_s")}
               for mode, runs in results.items()}
    for mode, runs in results.items():
        each = " ".join(f"{run['cpu_s']:.2f}" for run in runs)
        print(f"collector {mode:6}: CPU {medians[mode]['cpu_s']:.2f} s (runs: {each}), "
              f"in the collector {medians[mode]['gc_s']:.2f} s")
    print(f"paused / on: {medians['paused']['cpu_s'] / medians['on']['cpu_s']:.3f}x CPU")
    return 0


if __name__ == "__main__":
    sys.exit(main())
