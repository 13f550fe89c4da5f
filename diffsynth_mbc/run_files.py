"""The per-rank run files: names and fields shared by the writer (training) and the readers (monitor).

Every rank writes two files into the log directory, named by its *global* rank:

- ``training_gpu{rank}.json``: the current state, replaced atomically (temp file + rename);
- ``training_gpu{rank}.jsonl``: one appended, flushed line per optimizer step.

This module imports neither torch nor diffsynth.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

SCHEMA_VERSION = 1

# Lifecycle of one rank. "starting" is written the moment the process starts.
STATUS_STARTING = "starting"
STATUS_LOADING = "loading"
STATUS_TRAINING = "training"
STATUS_FINISHED = "finished"
STATUS_FAILED = "failed"
STATUS_STOPPED = "stopped"
STATUSES = (STATUS_STARTING, STATUS_LOADING, STATUS_TRAINING, STATUS_FINISHED, STATUS_FAILED, STATUS_STOPPED)
ACTIVE_STATUSES = (STATUS_STARTING, STATUS_LOADING, STATUS_TRAINING)
TERMINAL_STATUSES = (STATUS_FINISHED, STATUS_FAILED, STATUS_STOPPED)

# Fields of training_gpu{rank}.json. Readers must tolerate extra fields and missing optional ones.
STATUS_FIELDS = (
    "schema_version", "run_id", "rank", "local_rank", "world_size", "hostname", "pid",
    "status", "phase",
    # epoch counts from 0; step from 1 (the optimizer steps done)
    "epoch", "num_epochs", "step", "total_steps", "steps_per_epoch", "samples_seen",
    "loss", "loss_avg", "lr", "grad_norm", "step_time_s", "samples_per_s",
    "elapsed_s", "eta_s", "progress",
    "started_at", "updated_at",
    # {"name", "util_pct", "mem_used_mb", "mem_total_mb", "peak_allocated_mb", "peak_reserved_mb" (the
    # allocator's peaks since the previous write), "run_peak_allocated_mb", "run_peak_reserved_mb"}; None on CPU
    "gpu",
    "error",  # {"type", "message", "traceback_tail"} when status == "failed", else None
)

# Fields of each training_gpu{rank}.jsonl line (one per optimizer step; epoch from 0). Extra fields may
# appear, and validation lines carry {"kind": "val", "step", "val_loss", "val_samples", "time"}.
HISTORY_FIELDS = ("step", "epoch", "loss", "lr", "step_time_s", "time")

_STATUS_NAME = re.compile(r"^training_gpu(\d+)\.json$")


def status_path(log_dir: str | Path, rank: int) -> Path:
    return Path(log_dir) / f"training_gpu{int(rank)}.json"


def history_path(log_dir: str | Path, rank: int) -> Path:
    return Path(log_dir) / f"training_gpu{int(rank)}.jsonl"


def rank_of_status_file(name: str) -> int | None:
    """Global rank encoded in a status file name, or None for any other file."""
    match = _STATUS_NAME.match(name)
    return int(match.group(1)) if match else None


def rank_from_environment(environ=os.environ) -> tuple[int, int, int]:
    """(global rank, local rank, world size) as set by accelerate launch / torchrun, before torch starts."""
    rank = int(environ.get("RANK", environ.get("PMI_RANK", 0)))
    local_rank = int(environ.get("LOCAL_RANK", rank))
    world_size = int(environ.get("WORLD_SIZE", environ.get("PMI_SIZE", 1)))
    return rank, local_rank, world_size
