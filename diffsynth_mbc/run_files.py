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

# Lifecycle of one rank. "starting" is written the moment the process starts. "caching": the latent cache job
# (python -m diffsynth_mbc.cache) encoding its share of the rows, before the training's own files take over.
# "stopped": a stop someone asked for (Ctrl-C, stop.sh); "preempted": the scheduler ended the job (its warning before
# the time limit, scancel, a preemption), which a requeued job goes on from. Either ends after a checkpoint when it
# came while training.
STATUS_STARTING = "starting"
STATUS_CACHING = "caching"
STATUS_LOADING = "loading"
STATUS_TRAINING = "training"
STATUS_FINISHED = "finished"
STATUS_FAILED = "failed"
STATUS_STOPPED = "stopped"
STATUS_PREEMPTED = "preempted"
STATUSES = (STATUS_STARTING, STATUS_CACHING, STATUS_LOADING, STATUS_TRAINING, STATUS_FINISHED, STATUS_FAILED,
            STATUS_STOPPED, STATUS_PREEMPTED)
ACTIVE_STATUSES = (STATUS_STARTING, STATUS_CACHING, STATUS_LOADING, STATUS_TRAINING)
TERMINAL_STATUSES = (STATUS_FINISHED, STATUS_FAILED, STATUS_STOPPED, STATUS_PREEMPTED)
STOPPED_STATUSES = (STATUS_STOPPED, STATUS_PREEMPTED)   # ended before the run's end, resumable from a checkpoint

# Fields of training_gpu{rank}.json. Readers must tolerate extra fields and missing optional ones.
STATUS_FIELDS = (
    "schema_version", "run_id", "rank", "local_rank", "world_size", "hostname", "pid",
    "status", "phase",
    # epoch counts from 0; step from 1 (the optimizer steps done)
    "epoch", "num_epochs", "step", "total_steps", "steps_per_epoch", "samples_seen",
    # step_time_s: the last step's data wait + forward/backward/optimizer, never a checkpoint or validation;
    # step_time_avg_s: the same over the ETA's window of recent steps (warm-up left out)
    "loss", "loss_avg", "lr", "grad_norm", "step_time_s", "step_time_avg_s", "samples_per_s",
    # eta_s: remaining steps x step_time_avg_s + the overheads still ahead at their mean (eta_overheads_s)
    "elapsed_s", "eta_s", "eta_overheads_s", "progress",
    "started_at", "updated_at",
    # a resumed run: {"checkpoint", "step", "run_id"} it went on from (its run id, history, elapsed time and
    # trackers continue); None for a fresh run
    "resumed_from",
    # the launch (the launcher's run id) that started this process; equals run_id unless the run was resumed
    "launch_id",
    # {kind: {"count", "total_s", "last_s", "mean_s"}} for the kinds in OVERHEAD_KINDS that happened
    "overheads",
    # {"name", "util_pct", "mem_used_mb", "mem_total_mb", "peak_allocated_mb", "peak_reserved_mb" (the
    # allocator's peaks since the previous write), "run_peak_allocated_mb", "run_peak_reserved_mb"}; None on CPU
    "gpu",
    "error",  # {"type", "message", "traceback_tail"} when status == "failed", else None
    # {"for": "ranks in all-reduce (step agreement)", "since": unix time} while the rank has waited in a collective
    # for longer than its write interval (a heartbeat keeps the file fresh meanwhile), else None
    "waiting",
    # the newest LoRA health record's summary (training/evaluation/health_flags.summary): {"step", "max_update_norm",
    # "max_update_block", "max_grad_norm", "max_grad_block", "flags": [{"flag", "step", "what", "do"}], "seconds"};
    # None before the first record or with --health_steps 0
    "health",
    # the lowest validation so far: {"step", "val_loss", "val_loss_base", "gain" ((base - loss) / base), "file" (its
    # LoRA, OUTPUT/lora-best.safetensors), under --resolution_stages "stage": {"stage", "of", "size", "final"} (the
    # stage that trained it)}; new_best: the last validation was it
    "best", "new_best",
    # with --early_stop, where its count stands after the last validation (training/components/best_lora.py): {"step",
    # "count", "patience", "min_delta", "not_counted" (null, or why not: "warm-up", "first", ...), "counts_from_step",
    # "finite", "compared_with_step", "change" (relative to that step's val_loss), "reset", "since_step"}
    "early_stop_count",
    # a run --early_stop ended: {"step", "best_step", "validations_without_improvement", "since_step",
    # "since_val_loss", "patience", "min_delta"}
    "early_stop",
    # --resolution_stages: every stage ({"stage", "size", "from_step", "to_step", "steps", "tokens"}) and the one the
    # next step trains at (the same, with "of" and "final")
    "stages", "stage",
)

# A cache rank's status file has the fields above (step/total_steps: rows done/rows of its share, samples_per_s:
# rows/s, step_time_s: s/row, so that progress, ETA and stall detection read as for training) and these:
# rows_done, rows_total, rows_per_s, failures (rows that could not be read or encoded), last_failure (its reason),
# cache_dir. No history: the cache job appends nothing per row.
CACHE_FIELDS = ("rows_done", "rows_total", "rows_per_s", "failures", "last_failure", "cache_dir")

# Fields of each training_gpu{rank}.jsonl line (one per optimizer step; epoch from 0). Extra fields may
# appear: per sample of the step "rows" (its row of the run's metadata, 0-based), "modes", "timesteps",
# "timestep_losses", "shapes" (one order, but in a batch mixing shapes). Other lines carry a "kind": validation
# {"kind": "val", "step", "val_loss", "val_samples", "time"} (with the base model's "val_loss_base",
# "val_loss_base_by_quantile", "val_loss_base_by_mode", "val_loss_base_step"), sample clips {"kind": "samples", ...},
# and one line per overhead section {"kind": "overhead", "overhead": KIND, "step", "seconds", "time"} (step: the last
# optimizer step done), and the LoRA health at step 0, every --health_steps and at the end: {"kind": "lora_health",
# "step", "update_norm_by_block": [|dW|_F / |W|_F per DiT block], "grad_norm_by_block": [...] or null (not
# measured), "flags": [...], "seconds", "time"} (a norm that is not finite is null).
HISTORY_FIELDS = ("step", "epoch", "loss", "lr", "step_time_s", "time")
OVERHEAD_RECORD = "overhead"
HEALTH_RECORD = "lora_health"

# What the training does between optimizer steps, timed apart from the steps: full checkpoints, LoRA files
# (epoch-N, step-N, the final lora.safetensors), validation, sample clips. Labels as people read them.
OVERHEAD_KINDS = ("checkpoint", "lora", "validation", "samples")
OVERHEAD_LABELS = {"checkpoint": "checkpoints", "lora": "LoRA files", "validation": "validation",
                   "samples": "samples"}


def overheads_text(overheads) -> str:
    """``checkpoints 3 x 4.6 s, validation 2 x 1.2 s`` from a status file's ``overheads`` ('' when none).

    Shared by the training's terminal and the monitor; kinds it does not know are shown by their name."""
    if not isinstance(overheads, dict):
        return ""
    parts = []
    for kind in sorted(overheads, key=lambda k: (OVERHEAD_KINDS.index(k) if k in OVERHEAD_KINDS else 99, str(k))):
        tally = overheads[kind]
        if not isinstance(tally, dict) or not tally.get("count"):
            continue
        mean = tally.get("mean_s")
        mean_text = f"{mean:.1f} s" if isinstance(mean, (int, float)) else "-"
        parts.append(f"{OVERHEAD_LABELS.get(kind, kind)} {tally['count']} x {mean_text}")
    return ", ".join(parts)

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
