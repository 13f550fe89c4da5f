"""The per-rank run files' contents: the statuses, the fields and the records shared by the writer (training, latent
cache) and the readers (monitor, stop, doctor).

Every rank writes two files into the log directory, named by its *global* rank (their names are the run layout's:
``run_layout.status_file_name`` and ``history_file_name``):

- ``training_gpu{rank}.json``: the current state, replaced atomically (temp file + rename);
- ``training_gpu{rank}.jsonl``: one appended, flushed line per optimizer step.

This module imports neither torch nor diffsynth.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

# the files' names, here for the writers and readers of their contents
from diffsynth_mbc.run_layout import history_path, rank_of_status_file, status_path  # noqa: F401

SCHEMA_VERSION = 1

# Lifecycle of one rank. "starting" is written the moment the process starts. "caching": the latent cache job
# (python -m diffsynth_mbc.cache) encoding its share of the rows, before the training's own files take over.
# "stopped": a stop someone asked for (Ctrl-C, stop.sh); "preempted": the scheduler ended the job (its warning before
# the time limit, scancel, a preemption), which a requeued job goes on from. Either ends after a checkpoint when it
# came while training. "retired": a rank the run no longer has, after a resume on fewer processes (its records end at
# that checkpoint).
STATUS_STARTING = "starting"
STATUS_CACHING = "caching"
STATUS_LOADING = "loading"
STATUS_TRAINING = "training"
STATUS_FINISHED = "finished"
STATUS_FAILED = "failed"
STATUS_STOPPED = "stopped"
STATUS_PREEMPTED = "preempted"
STATUS_RETIRED = "retired"
STATUSES = (STATUS_STARTING, STATUS_CACHING, STATUS_LOADING, STATUS_TRAINING, STATUS_FINISHED, STATUS_FAILED,
            STATUS_STOPPED, STATUS_PREEMPTED, STATUS_RETIRED)
ACTIVE_STATUSES = (STATUS_STARTING, STATUS_CACHING, STATUS_LOADING, STATUS_TRAINING)
TERMINAL_STATUSES = (STATUS_FINISHED, STATUS_FAILED, STATUS_STOPPED, STATUS_PREEMPTED, STATUS_RETIRED)
STOPPED_STATUSES = (STATUS_STOPPED, STATUS_PREEMPTED)   # ended before the run's end, resumable from a checkpoint

# -- the status schema ------------------------------------------------------------------------------------------------
# Every field of a status file, declared once: its type, whether every file has it, and which files do (a training
# rank's, a latent cache rank's). The writer (training/reporting/status_writer.py) refuses a field this does not
# declare, or a value of another type (StatusFieldError: a programming error); the monitor (monitor/status.py)
# reads every file through it. A new metric is one line here and what shows it.
TRAINING, CACHE = "training", "cache"     # the kinds of status file: a training rank's, a cache build rank's
BOTH, CACHE_ONLY = (TRAINING, CACHE), (CACHE,)


@dataclasses.dataclass(frozen=True)
class Field:
    """One field. ``type``: int, float, str, bool, dict (any JSON object), list (any JSON list), object (any JSON
    value), or an ``Obj``, ``ListOf`` or ``MapOf`` of declared parts; any field may be None (not known yet).

    - ``files``: the kinds of status file that hold it.
    - ``optional``: written when it happens (absent before); else in every file of its kinds from the first write on.
      Inside an object: a part written only sometimes (the others read as present: None, or [] for a list).
    - ``required`` (inside an object or a list's item): without a readable value the object reads as None, the item
      is left out. ``blank``: False when a blank text is no value.
    - ``limit``: the characters of a text, the items of a list or map, that readers keep.
    - ``as_text``: any value reads as its text (else a text must be a string; a file's top-level texts always do).
    - ``whole``: a whole number written as one (a reader never takes a float's whole part instead).
    - ``at_least``: the smallest value.
    - ``noted``: readers note a value they cannot read (they always do for the numbers every file holds).
    - ``choices``: the texts it may hold (any other reads as None).
    - ``default``: a yes/no's value where it is missing or not one (else None)."""
    name: str
    type: Any
    files: tuple[str, ...] = (TRAINING,)
    optional: bool = False
    required: bool = False
    limit: int | None = None
    as_text: bool = False
    whole: bool = False
    at_least: float | None = None
    noted: bool = False
    blank: bool = True
    choices: tuple = ()
    default: Any = None

    def __post_init__(self):
        if isinstance(self.files, str) or not set(self.files) <= {TRAINING, CACHE}:
            raise TypeError(f"status field {self.name!r}: files is a tuple of TRAINING and CACHE, not {self.files!r}")


@dataclasses.dataclass(frozen=True)
class Obj:
    """A JSON object of declared fields (others are not kept); ``called``: what notes say it is not."""
    fields: tuple[Field, ...]
    called: str = "an object"


@dataclasses.dataclass(frozen=True)
class ListOf:
    """A JSON list of ``item`` (a type or an ``Obj``)."""
    item: Any


@dataclasses.dataclass(frozen=True)
class MapOf:
    """A JSON object of any keys (``key_limit``: characters kept) to ``value`` (a type or an ``Obj``)."""
    value: Any
    key_limit: int | None = None


def every_file(*fields: Field) -> tuple[Field, ...]:
    """Fields every status file of their kinds holds from its first write on (None until known)."""
    return fields


def when_written(*fields: Field) -> tuple[Field, ...]:
    """Fields written when what they say happens (absent before)."""
    return tuple(dataclasses.replace(field, optional=True) for field in fields)


GPU = Obj((Field("name", str, as_text=True), *(Field(name, float) for name in (
    "util_pct", "mem_used_mb", "mem_total_mb",
    "peak_allocated_mb", "peak_reserved_mb",           # the allocator's peaks since the previous write
    "run_peak_allocated_mb", "run_peak_reserved_mb"))))
TALLY = Obj((Field("count", int, required=True, at_least=0), Field("total_s", float), Field("last_s", float),
             Field("mean_s", float)), called="a tally")
HEALTH_FLAG = Obj((Field("flag", str, required=True, limit=40, blank=False), Field("step", int),
                   Field("what", str, limit=2000), Field("do", str, limit=2000)))
HEALTH_FLAGS = Field("flags", ListOf(HEALTH_FLAG), limit=16)
NOT_COUNTED = ("earlier stage", "warm-up", "first", "no finite one yet")   # why a validation counted for nothing
STAGE = (Field("stage", int), Field("size", str, required=True, limit=40, blank=False), Field("height", int),
         Field("width", int), Field("num_frames", int), Field("from_step", int), Field("to_step", int),
         Field("steps", int), Field("tokens", int))
MODE_LOSSES = MapOf(float)          # {mode or quantile: mean validation loss}
STAGE_NOW = Obj((*STAGE, Field("of", int), Field("final", bool, default=False)))   # a stage, of how many; the last?

STATUS_SCHEMA: dict[str, Field] = {field.name: field for field in every_file(
    Field("schema_version", int, BOTH, whole=True),
    Field("run_id", str, BOTH),
    Field("rank", int, BOTH, whole=True),
    Field("local_rank", int, BOTH),
    Field("world_size", int, BOTH, whole=True),
    Field("hostname", str, BOTH),
    Field("pid", int, BOTH),
    Field("status", str, BOTH),                  # one of STATUSES
    Field("phase", str, BOTH),                   # what the rank does now, in words
    Field("epoch", int),                         # counted from 0
    Field("num_epochs", int),
    Field("step", int, BOTH),                    # optimizer steps done (a cache rank: rows done)
    Field("total_steps", int, BOTH),             # (a cache rank: rows of its share)
    Field("steps_per_epoch", int),
    Field("samples_seen", int, BOTH),
    Field("loss", float),
    Field("loss_avg", float),
    Field("lr", float),
    Field("grad_norm", float),
    # the last step's data wait + forward/backward/optimizer, never a checkpoint or validation (a cache rank: s/row)
    Field("step_time_s", float, BOTH),
    Field("step_time_avg_s", float),             # the same over the ETA's window of recent steps (warm-up left out)
    Field("samples_per_s", float, BOTH),         # (a cache rank: rows/s)
    Field("elapsed_s", float, BOTH),
    Field("eta_s", float, BOTH),                 # remaining steps x step_time_avg_s + eta_overheads_s
    Field("eta_overheads_s", float),             # the overheads still ahead at their mean
    Field("progress", float, BOTH),              # percent
    Field("started_at", float, BOTH),
    Field("updated_at", float, BOTH),
    # a resumed run: the checkpoint it went on from (its run id, history, elapsed time and trackers continue)
    Field("resumed_from", Obj((Field("checkpoint", str), Field("step", int), Field("run_id", str)))),
    Field("launch_id", str, BOTH),               # the launch that started this process; run_id unless resumed
    # a resume on another number of processes (training/plan/elastic.py): where, from how many to how many, the run's
    # new end, and what the terminal said
    Field("resumed_elsewhere", Obj((Field("step", int), Field("from_world_size", int), Field("world_size", int),
                                    Field("end_step", int), Field("said", str, limit=1000)))),
    # {kind: tally} for the kinds in OVERHEAD_KINDS that happened
    Field("overheads", MapOf(TALLY, key_limit=40), limit=16, noted=True),
    Field("gpu", GPU, BOTH, noted=True),         # None on CPU
    # when status is failed (monitor/status.py reads it by hand: a text or a list of lines are errors too)
    Field("error", Obj((Field("type", str), Field("message", str), Field("traceback_tail", str))), BOTH),
    # while the rank has waited in a collective for longer than its write interval (a heartbeat keeps the file fresh)
    Field("waiting", Obj((Field("for", str, required=True, limit=200), Field("since", float, required=True)),
                         called="{for, since}"), BOTH, noted=True),
    # the newest LoRA health record's summary (training/evaluation/health_flags.summary); None before the first
    Field("health", Obj((Field("step", int), Field("max_update_norm", float), Field("max_update_block", int),
                         Field("max_grad_norm", float), Field("max_grad_block", int), HEALTH_FLAGS,
                         Field("seconds", float)))),
    # the lowest validation so far; gain: (base - loss) / base; file: its LoRA (OUTPUT/lora-best)
    # under --resolution_stages its stage: the stage that trained it
    Field("best", Obj((Field("step", int, required=True), Field("val_loss", float, required=True),
                       Field("val_loss_base", float), Field("gain", float), Field("file", str, limit=500),
                       Field("stage", STAGE_NOW, optional=True)))),
    Field("new_best", bool),                     # the last validation was the best
    Field("early_stop", Obj((Field("step", int, required=True), Field("best_step", int),
                             Field("validations_without_improvement", int), Field("since_step", int),
                             Field("since_val_loss", float), Field("patience", int), Field("min_delta", float)))),
    # with --early_stop, where its count stands after the last validation (training/components/best_lora.py):
    # not_counted: why it counted for nothing; change: relative to compared_with_step's val_loss
    Field("early_stop_count", Obj((Field("step", int), Field("count", int, required=True),
                                   Field("patience", int, required=True), Field("min_delta", float),
                                   Field("not_counted", str, choices=NOT_COUNTED), Field("counts_from_step", int),
                                   Field("finite", bool, default=True), Field("compared_with_step", int),
                                   Field("change", float), Field("reset", bool, default=False),
                                   Field("since_step", int)))),
    Field("stages", ListOf(Obj(STAGE)), limit=16),   # --resolution_stages: every stage
    # the stage the next step trains at: of: how many there are; final: the final size
    Field("stage", STAGE_NOW),
    # several catalogues: each one's samples this epoch on this rank (per_epoch: its even share)
    Field("catalogue_progress", ListOf(Obj((Field("name", str, required=True, limit=80, as_text=True),
                                            Field("seen", int), Field("per_epoch", int)))), limit=64),
) + when_written(
    Field("write_failures", int, BOTH),          # status and history writes that failed (the run went on)
    # the start: what trains (training/reporting/recipe.py), the step plan, how the run was set up
    Field("recipe", dict),
    Field("plan", dict),
    Field("lr_scheduler", str),
    Field("max_grad_norm", float),
    Field("mixed_precision", str),
    Field("precision_reason", str),
    Field("attention_kernel", str),
    Field("deepspeed_gradient_clipping", object),   # the engine's setting: a number or "auto"
    Field("compile", bool),
    Field("compile_reason", str),
    Field("recompute_blocks", int),
    Field("gradient_checkpointing_reason", str),
    Field("init_lora", dict),                    # --init_lora: what was found in the file
    # every step
    Field("tokens_per_s", float),
    Field("skipped_samples", int),               # media that could not be read, replaced by the next row
    Field("skip_reasons", list),                 # the latest of them, with why
    # rank 0, when the steps end: what every rank replaced as bad media (samples, of seen; rows: [row, file, times])
    Field("replaced_media", Obj((Field("samples", int), Field("seen", int), Field("row_count", int),
                                 Field("rows", list)))),
    Field("nonfinite_steps", int),               # steps skipped as inf/NaN
    Field("nonfinite_in_a_row", int),
    Field("captions_dropped", int),              # --caption_dropout
    Field("ema_updates", int),
    Field("ema_note", str),
    # validation: the headline loss (the EMA's under --validate_with ema), per timestep quantile and per mode
    Field("val_loss", float),
    Field("val_loss_by_quantile", MODE_LOSSES),
    Field("val_loss_by_mode", MODE_LOSSES),
    Field("val_step", int),
    Field("val_weights", str),                   # "ema" when the headline is the EMA's
    Field("val_loss_ema", float),                # --validate_with both: the EMA's beside the raw weights'
    Field("val_loss_ema_by_quantile", MODE_LOSSES),
    Field("val_loss_ema_by_mode", MODE_LOSSES),
    Field("val_loss_base", float),               # the base model (the LoRA off) on the same samples
    Field("val_loss_base_by_quantile", MODE_LOSSES),
    Field("val_loss_base_by_mode", MODE_LOSSES),
    Field("val_loss_base_step", int),            # when the base was measured
    Field("val_substituted", int),               # validation samples whose own row did not decode
    Field("val_substituted_rows", list),
    # sample clips: the samples folder and the last set
    Field("samples_dir", str),
    Field("last_samples", Obj((Field("step", int), Field("dir", str), Field("files", ListOf(str)),
                               Field("base_dir", str, optional=True),         # with strength 0: the base's clips
                               Field("base_files", ListOf(str), optional=True)))),
    # checkpoints and resumes
    Field("last_checkpoint", str),
    Field("last_checkpoint_step", int),
    Field("resumed_with_changes", ListOf(str)),
    # --fp32_residual: the DiT's residual stream in fp32, and why (training/plan/residual_policy.py)
    Field("fp32_residual", bool),
    Field("fp32_residual_reason", str),
    # the largest residual magnitude the DiT's blocks wrote (a number, or "inf"/"nan" once the stream overflowed)
    Field("largest_residual", object),  # --force_resume: what differed from the checkpoint
    # a cache rank: rows done and of its share, rows/s, rows that could not be read or encoded and the last reason
    Field("cache_dir", str, CACHE_ONLY),
    Field("rows_done", int, CACHE_ONLY),
    Field("rows_total", int, CACHE_ONLY),
    Field("rows_per_s", float, CACHE_ONLY),
    Field("failures", int, CACHE_ONLY),
    Field("last_failure", str, CACHE_ONLY),
)}


class StatusFieldError(ValueError):
    """A status field the schema does not declare (or not for this kind of file), or a value of another type: a
    programming error, named with the field."""


def fields_in_every_file(kind: str = TRAINING) -> tuple[str, ...]:
    """The fields every status file of ``kind`` holds from its first write on (None until known)."""
    return tuple(name for name, field in STATUS_SCHEMA.items() if not field.optional and kind in field.files)


def check_status_fields(fields: dict, kind: str = TRAINING) -> None:
    """StatusFieldError for the first field of ``fields`` that a ``kind`` status file may not hold as it is."""
    for name, value in fields.items():
        field = STATUS_SCHEMA.get(name)
        if field is None:
            raise StatusFieldError(f"status field {name!r} is not declared: declare it in run_files.STATUS_SCHEMA "
                                   "(its type and which files hold it), then show it")
        if kind not in field.files:
            raise StatusFieldError(f"status field {name!r} is not one of a {kind} rank's (STATUS_SCHEMA: "
                                   f"{', '.join(field.files)})")
        if value is not None and not is_of_type(value, field.type):
            raise StatusFieldError(f"status field {name!r} is {type_name(field.type)}, not "
                                   f"{type(value).__name__} ({value!r:.60})")


def is_of_type(value: Any, kind: Any) -> bool:
    """Whether ``value`` has the declared type at its top (the parts of an object or list are the readers' to
    check)."""
    if isinstance(value, bool):
        return kind in (bool, object)
    if kind is float:
        return isinstance(value, (int, float))
    if isinstance(kind, (Obj, MapOf)):
        return isinstance(value, dict)
    if isinstance(kind, ListOf) or kind is list:
        return isinstance(value, (list, tuple))
    return kind is object or isinstance(value, kind)


def type_name(kind: Any) -> str:
    if isinstance(kind, (Obj, MapOf)) or kind is dict:
        return "an object"
    if isinstance(kind, ListOf) or kind is list:
        return "a list"
    return {int: "a whole number", float: "a number", str: "a text", bool: "true or false"}.get(kind, "any value")


# The training status file's fields (every one from the first write on) and a cache rank's own.
STATUS_FIELDS = fields_in_every_file(TRAINING)
CACHE_FIELDS = tuple(name for name, field in STATUS_SCHEMA.items() if field.files == (CACHE,))

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


def rank_from_environment(environ=os.environ) -> tuple[int, int, int]:
    """(global rank, local rank, world size) as set by accelerate launch / torchrun, before torch starts."""
    rank = int(environ.get("RANK", environ.get("PMI_RANK", 0)))
    local_rank = int(environ.get("LOCAL_RANK", rank))
    world_size = int(environ.get("WORLD_SIZE", environ.get("PMI_SIZE", 1)))
    return rank, local_rank, world_size
