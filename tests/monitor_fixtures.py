"""Crafted per-rank run files (the schema of diffsynth_mbc.run_files) for the monitor tests and benchmark."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

from diffsynth_mbc import run_files
from diffsynth_mbc.atomic import atomic_write_json

NOW = 1_700_000_000.0  # a fixed "now" for tests that inject the clock


def status(rank: int, *, world_size: int = 2, run_id: str = "run-a", status: str = "training", step: int = 100,
           total_steps: int = 1000, step_time_s: float = 2.0, now: float = NOW, started_at: float | None = None,
           updated_at: float | None = None, **overrides) -> dict:
    """A plausible status object of one rank at ``step`` of ``total_steps``."""
    started = now - step * step_time_s - 60.0 if started_at is None else started_at
    obj = {
        "schema_version": run_files.SCHEMA_VERSION,
        "run_id": run_id,
        "rank": rank,
        "local_rank": rank,
        "world_size": world_size,
        "hostname": "node-a",
        "pid": 4000 + rank,
        "status": status,
        "phase": {"training": "train", "loading": "loading DiT", "starting": "init"}.get(status, status),
        "epoch": 0,
        "num_epochs": 1,
        "step": step,
        "total_steps": total_steps,
        "steps_per_epoch": total_steps,
        "samples_seen": step * world_size,
        "loss": loss_at(step, rank),
        "loss_avg": loss_at(step, rank) + 0.01,
        "lr": lr_at(step),
        "grad_norm": 0.5,
        "step_time_s": step_time_s,
        "samples_per_s": 1.0 / step_time_s,
        "elapsed_s": now - started,
        "eta_s": (total_steps - step) * step_time_s,
        "progress": 100.0 * step / total_steps,
        "started_at": started,
        "updated_at": now if updated_at is None else updated_at,
        "gpu": {"name": "Tesla V100S-PCIE-32GB", "util_pct": 97.0, "mem_used_mb": 22000.0, "mem_total_mb": 32768.0},
        "error": None,
    }
    obj.update(overrides)
    return obj


def loss_at(step: int, rank: int = 0) -> float:
    return round(0.05 + 0.5 * math.exp(-step / 300.0) + 0.003 * ((step * 7 + rank * 3) % 11), 6)


def lr_at(step: int) -> float:
    return 1e-4 * min(1.0, step / 50.0) if step > 0 else 0.0


def write_status(log_dir: str | Path, rank: int, **fields) -> Path:
    path = run_files.status_path(log_dir, rank)
    atomic_write_json(path, status(rank, **fields))
    return path


def history_line(step: int, rank: int = 0, *, t0: float = NOW - 10_000, step_time_s: float = 2.0, **extra) -> str:
    rec = {"step": step, "epoch": 0, "loss": loss_at(step, rank), "lr": lr_at(step), "step_time_s": step_time_s,
           "time": t0 + step * step_time_s}
    rec.update(extra)
    return json.dumps(rec) + "\n"


def write_history(log_dir: str | Path, rank: int, steps, *, append: bool = False, **kw) -> Path:
    path = run_files.history_path(log_dir, rank)
    Path(log_dir).mkdir(parents=True, exist_ok=True)
    with open(path, "a" if append else "w", encoding="utf-8") as handle:
        handle.write("".join(history_line(s, rank, **kw) for s in steps))
        handle.flush()
    return path


def make_run(log_dir: str | Path, *, world_size: int = 2, steps: int = 100, ranks=None, now: float = NOW,
             **status_fields) -> Path:
    """A healthy run: every rank (or those in ``ranks``) at ``steps`` with that many history lines."""
    log_dir = Path(log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)
    for rank in range(world_size) if ranks is None else ranks:
        write_history(log_dir, rank, range(1, steps + 1))
        write_status(log_dir, rank, world_size=world_size, step=steps, now=now, **status_fields)
    return log_dir


def failed_error() -> dict:
    return {
        "type": "RuntimeError",
        "message": "CUDA out of memory. Tried to allocate 2.00 GiB",
        "traceback_tail": "Traceback (most recent call last):\n  File \"train.py\", line 88, in step\n"
                          "    loss.backward()\nRuntimeError: CUDA out of memory. Tried to allocate 2.00 GiB",
    }


def write_raw(path: str | Path, data: bytes | str) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as handle:
        handle.write(data.encode() if isinstance(data, str) else data)
    return path


def touch_age(path: str | Path, age_s: float, now: float = NOW) -> None:
    os.utime(path, (now - age_s, now - age_s))
