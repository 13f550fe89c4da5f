"""Monitor refresh cost on a big run: incremental reader vs re-reading every file on each refresh.

    python benchmarks/bench_monitor.py [--ranks 8] [--steps 100000] [--runs 7] [--append 5] [--first-only]

Writes RANKS x STEPS JSONL lines (plus status files) into a temp dir, then measures, for the
monitor (diffsynth_mbc.monitor.state.MonitorState) and for a naive reader that parses every
file again on each refresh (what a hand-written dashboard backend does):

- first load: time of the first refresh that reads every history whole (``tail_first_above=None``: what
  the background read does; the first answer itself comes from the tails, below);
- refresh: median time of a refresh after APPEND new lines per rank (RUNS runs);
- memory: tracemalloc peak during the first load and memory still held after it (a separate
  pass, as tracemalloc slows Python down);
- the metrics API: a 1,000-record window at a random step, and the down-sampled series;
- the first answer of a monitor that starts on the finished files: ``GET /api/training/status`` of a
  fresh server (and ``/api/training/samples`` asked 0.1 s after it), the first down-sampled metrics,
  and ``python -m diffsynth_mbc.monitor LOG_DIR --once --json`` as a new process.

``--first-only`` measures only the first answers (the rest re-reads everything several times).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import threading
import tempfile
import time
import tracemalloc
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from diffsynth_mbc import run_files  # noqa: E402
from diffsynth_mbc.atomic import atomic_write_json  # noqa: E402
from diffsynth_mbc.monitor.server import MonitorServer  # noqa: E402
from diffsynth_mbc.monitor.state import MonitorState  # noqa: E402


def line(step: int, rank: int, t0: float) -> str:
    loss = 0.05 + 0.5 / (1 + step / 3000) + 0.001 * ((step * 7 + rank) % 13)
    return (f'{{"step": {step}, "epoch": {step // 20000}, "loss": {loss:.6f}, "lr": {1e-4 * min(1, step / 500):.6e}, '
            f'"step_time_s": 2.{step % 97:02d}, "time": {t0 + step * 2.0:.3f}, "grad_norm": 0.5}}\n')


def write_status(log_dir: Path, rank: int, ranks: int, step: int, total: int, now: float) -> None:
    atomic_write_json(run_files.status_path(log_dir, rank), {
        "schema_version": 1, "run_id": "bench", "rank": rank, "local_rank": rank % 8, "world_size": ranks,
        "hostname": "node", "pid": 1000 + rank, "status": "training", "phase": "train", "epoch": 0,
        "num_epochs": 5, "step": step, "total_steps": total, "steps_per_epoch": total // 5,
        "samples_seen": step * ranks, "loss": 0.1, "loss_avg": 0.1, "lr": 1e-4, "grad_norm": 0.5,
        "step_time_s": 2.0, "samples_per_s": 0.5, "elapsed_s": step * 2.0, "eta_s": (total - step) * 2.0,
        "progress": 100.0 * step / total, "started_at": now - step * 2.0, "updated_at": now,
        "gpu": {"name": "V100S", "util_pct": 99.0, "mem_used_mb": 22000.0, "mem_total_mb": 32768.0}, "error": None,
    })


def generate(log_dir: Path, ranks: int, steps: int) -> None:
    t0 = time.time() - steps * 2.0
    for rank in range(ranks):
        with open(run_files.history_path(log_dir, rank), "w") as handle:
            for start in range(1, steps + 1, 10_000):
                handle.write("".join(line(s, rank, t0) for s in range(start, min(steps, start + 9_999) + 1)))
        write_status(log_dir, rank, ranks, steps, steps * 5, time.time())


def append(log_dir: Path, ranks: int, first: int, count: int) -> None:
    t0 = time.time() - first * 2.0
    for rank in range(ranks):
        with open(run_files.history_path(log_dir, rank), "a") as handle:
            handle.write("".join(line(s, rank, t0) for s in range(first, first + count)))
            handle.flush()
        write_status(log_dir, rank, ranks, first + count - 1, 500_000, time.time())


class NaiveReader:
    """Parse every status and history file again on each refresh, keeping every record."""

    def __init__(self, log_dir: Path):
        self.log_dir = log_dir
        self.data: dict = {}  # kept to answer requests, as a backend would

    def refresh(self) -> dict:
        out = {}
        for name in sorted(os.listdir(self.log_dir)):
            rank = run_files.rank_of_status_file(name)
            if rank is None:
                continue
            with open(self.log_dir / name) as handle:
                status = json.load(handle)
            history = []
            with open(run_files.history_path(self.log_dir, rank)) as handle:
                for raw in handle:
                    try:
                        history.append(json.loads(raw))
                    except ValueError:
                        pass
            out[rank] = {"status": status, "loss": [(r["step"], r["loss"]) for r in history],
                         "lr": [(r["step"], r["lr"]) for r in history]}
        self.data = out
        return out


def timed(fn):
    t0 = time.perf_counter()
    result = fn()
    return time.perf_counter() - t0, result


def measure(make, log_dir: Path, ranks: int, steps: int, runs: int, count: int) -> dict:
    reader = make()
    first, _ = timed(reader.refresh)
    step = steps + 1
    refreshes = []
    for _ in range(runs):
        append(log_dir, ranks, step, count)
        step += count
        refreshes.append(timed(reader.refresh)[0])
    return {"first_s": first, "refresh_s": statistics.median(refreshes), "reader": reader, "next_step": step}


def memory(make) -> dict:
    tracemalloc.start()
    reader = make()
    reader.refresh()
    current, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    del reader
    return {"peak_mb": peak / 2**20, "held_mb": current / 2**20}


def _get(url: str) -> float:
    t0 = time.perf_counter()
    with urllib.request.urlopen(url, timeout=600) as response:
        response.read()
    return time.perf_counter() - t0


def first_answers(log_dir: Path) -> dict:
    """Time to the first answers of a monitor started on the files as they are."""
    server = MonitorServer(MonitorState(log_dir)).start()
    try:
        beside: dict = {}
        other = threading.Thread(target=lambda: (time.sleep(0.1), beside.update(s=_get(server.url + "api/training/samples"))))
        other.start()
        status_s = _get(server.url + "api/training/status")
        other.join()
        during: dict = {}   # a status asked 1 s into the first down-sampled metrics (which need whole histories)
        asker = threading.Thread(target=lambda: (time.sleep(1.0), during.update(
            s=_get(server.url + "api/training/status?fresh=1"))))
        asker.start()
        time.sleep(0.6)   # past the status' 0.5 s cache, so that one is a refresh
        metrics_s = _get(server.url + "api/training/metrics?points=1000")
        asker.join()
    finally:
        server.stop()
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-m", "diffsynth_mbc.monitor", str(log_dir), "--once", "--json"],
                   stdout=subprocess.DEVNULL, cwd=Path(__file__).resolve().parents[1], check=False)
    once_s = time.perf_counter() - t0
    return {"status_s": status_s, "beside_s": beside.get("s", float("nan")), "metrics_s": metrics_s,
            "during_s": during.get("s", float("nan")), "once_s": once_s}


def print_first_answers(log_dir: Path) -> bool:
    first = first_answers(log_dir)
    print(f"first GET /api/training/status of a new server: {first['status_s'] * 1000:,.0f} ms "
          f"(/api/training/samples asked 0.1 s later: {first['beside_s'] * 1000:,.0f} ms)")
    print(f"first down-sampled metrics (every rank, <=1,000 points): {first['metrics_s'] * 1000:,.0f} ms "
          f"(a status asked 1 s into it: {first['during_s'] * 1000:,.0f} ms)")
    print(f"--once --json, a new process: {first['once_s'] * 1000:,.0f} ms")
    ok = first["status_s"] < 1.0 and first["once_s"] < 1.0
    print(f"first answers under 1 s: {'yes' if ok else 'NO'}")
    return ok


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, default=8)
    parser.add_argument("--steps", type=int, default=100_000)
    parser.add_argument("--runs", type=int, default=7)
    parser.add_argument("--append", type=int, default=5, help="lines appended per rank before each timed refresh")
    parser.add_argument("--first-only", action="store_true", help="measure only the first answers of a new monitor")
    args = parser.parse_args(argv)
    if args.ranks < 1 or args.steps < 1 or args.runs < 1 or args.append < 1:
        parser.error("--ranks, --steps, --runs and --append must be at least 1")

    with tempfile.TemporaryDirectory(prefix="mbc-bench-") as tmp:
        log_dir = Path(tmp)
        t0 = time.perf_counter()
        generate(log_dir, args.ranks, args.steps)
        size = sum(f.stat().st_size for f in log_dir.iterdir()) / 2**20
        print(f"{args.ranks} ranks x {args.steps:,} steps: {size:.0f} MiB of JSONL, written in "
              f"{time.perf_counter() - t0:.1f} s; {args.runs} refreshes after appending {args.append} lines/rank")
        first_ok = print_first_answers(log_dir)
        if args.first_only:
            return 0 if first_ok else 1

        whole = dict(tail_first_above=None)   # the reader itself, every history read whole
        mon = measure(lambda: MonitorState(log_dir, **whole), log_dir, args.ranks, args.steps, args.runs, args.append)
        steps_now = mon["next_step"]
        naive = measure(lambda: NaiveReader(log_dir), log_dir, args.ranks, steps_now - 1, args.runs, args.append)
        mon_mem = memory(lambda: MonitorState(log_dir, **whole))
        naive_mem = memory(lambda: NaiveReader(log_dir))

        state = mon["reader"]
        rng = random.Random(0)
        windows = [timed(lambda: state.metrics(rank=rng.randrange(args.ranks), since=rng.randrange(args.steps),
                                               limit=1000))[0] for _ in range(20)]
        down = [timed(lambda: state.metrics(points=1000))[0] for _ in range(5)]
        points = max(len(state._history_for(r).loss) for r in range(args.ranks))

        rows = [
            ("first load", f"{mon['first_s'] * 1000:,.0f} ms", f"{naive['first_s'] * 1000:,.0f} ms",
             naive["first_s"] / mon["first_s"]),
            ("refresh (median)", f"{mon['refresh_s'] * 1000:,.1f} ms", f"{naive['refresh_s'] * 1000:,.0f} ms",
             naive["refresh_s"] / mon["refresh_s"]),
            ("peak memory, first load", f"{mon_mem['peak_mb']:,.1f} MiB", f"{naive_mem['peak_mb']:,.0f} MiB",
             naive_mem["peak_mb"] / mon_mem["peak_mb"]),
            ("memory held after load", f"{mon_mem['held_mb']:,.1f} MiB", f"{naive_mem['held_mb']:,.0f} MiB",
             naive_mem["held_mb"] / mon_mem["held_mb"]),
        ]
        print(f"\n{'':26}{'monitor':>14}{'naive':>14}{'naive/monitor':>16}")
        for name, a, b, ratio in rows:
            print(f"{name:26}{a:>14}{b:>14}{ratio:>15.1f}x")
        print(f"\nmetrics window (1,000 records, random rank and step): median "
              f"{statistics.median(windows) * 1000:.1f} ms, max {max(windows) * 1000:.1f} ms")
        print(f"metrics down-sampled (all ranks, <=1,000 points each): median {statistics.median(down) * 1000:.1f} ms")
        print(f"points kept per rank and series: {points} (bucket of {state._history_for(0).loss.bucket} steps)")
        ok = mon["refresh_s"] < 0.1
        print(f"\nrefresh under 100 ms: {'yes' if ok else 'NO'}")
    return 0 if ok and first_ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
