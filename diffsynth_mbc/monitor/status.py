"""Reading one rank's status file: field types, bounds and notes, and the run statuses and exit codes.

Pure logic; imports neither rich, torch nor diffsynth.
"""

from __future__ import annotations

import itertools
import json
import math
import os
import stat
import time
from pathlib import Path
from typing import Any, Callable

from diffsynth_mbc import run_files
from diffsynth_mbc.values import printable

STALL_MIN_S = 120.0
# Ranks and world sizes above this are bad data (a typo or a hostile file), never a set of that size.
MAX_RANKS = 65_536
STALL_STEP_FACTOR = 10.0

RUN_STATUSES = ("starting", "caching", "loading", "training", "stalled", "finished", "failed", "stopped", "preempted",
                "no_data")
EXIT_CODES = {
    "starting": 0, "caching": 0, "loading": 0, "training": 0, "finished": 0, "stopped": 0, "preempted": 0,
    "failed": 1, "stalled": 3, "no_data": 4,
}

_INT_FIELDS = ("schema_version", "rank", "local_rank", "world_size", "pid", "epoch", "num_epochs", "step",
               "total_steps", "steps_per_epoch", "samples_seen")
_FLOAT_FIELDS = ("loss", "loss_avg", "lr", "grad_norm", "step_time_s", "step_time_avg_s", "samples_per_s", "elapsed_s",
                 "eta_s", "eta_overheads_s", "progress", "started_at", "updated_at")
_GPU_NUMBERS = ("util_pct", "mem_used_mb", "mem_total_mb", "peak_allocated_mb", "peak_reserved_mb",
                "run_peak_allocated_mb", "run_peak_reserved_mb")
MAX_OVERHEAD_KINDS = 16   # kinds of overhead kept from one status file (the training writes 4)
_STR_FIELDS = ("run_id", "hostname", "status", "phase")
_TYPED_OBJECTS = ("gpu", "error", "overheads", "waiting", "health", "catalogue_progress")
MAX_FLAGS = 16          # LoRA health flags kept from one status file or history record (the training has four)
MAX_FLAG_TEXT = 2000    # characters of a flag's "what" and "do" kept
MAX_CATALOGUES = 64     # catalogues of catalogue_progress kept
_COMPUTED = ("stalled", "age_s", "stall_after_s", "stalled_since", "median_step_time_s", "loss_trend",
             "loss_by_mode", "history_lines", "history_complete", "file", "waiting_text")


def exit_code(status: str) -> int:
    return EXIT_CODES.get(status, 0)


# ----------------------------------------------------------------------------------------------
# Value cleaning


def to_float(value: Any) -> float | None:
    """A finite float from a number or a numeric string; None for anything else (NaN and inf included)."""
    if isinstance(value, bool) or value is None:
        return None
    if isinstance(value, (int, float)):
        try:
            result = float(value)
        except OverflowError:
            return None
    elif isinstance(value, str):
        try:
            result = float(value.strip())
        except ValueError:
            return None
    else:
        return None
    return result if math.isfinite(result) else None


def to_int(value: Any) -> int | None:
    result = to_float(value)
    if result is None or result != int(result):
        return None
    return int(result)


def json_safe(value: Any, depth: int = 0) -> Any:
    """A copy that ``json.dumps(allow_nan=False)`` accepts: NaN/inf become None, odd types become strings."""
    if depth > 20:
        return None
    if isinstance(value, str):
        return printable(value)
    if value is None or isinstance(value, (bool, int)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {str(k): json_safe(v, depth + 1) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v, depth + 1) for v in value]
    return str(value)


def _describe(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def normalize_status(raw: dict, file_rank: int) -> tuple[dict, list[str]]:
    """Typed copy of one status file's object, and the notes about what had to be fixed.

    Known fields get their types (numbers from numeric strings; None where not a number);
    unknown fields are kept as they are (made JSON-safe).
    """
    notes: list[str] = []
    name = f"training_gpu{file_rank}.json"
    out: dict[str, Any] = {}
    for key, value in raw.items():
        if key in _INT_FIELDS or key in _FLOAT_FIELDS or key in _STR_FIELDS or key in _TYPED_OBJECTS:
            continue
        if key in _COMPUTED:
            continue
        out[printable(str(key))] = json_safe(value)
    for key in _INT_FIELDS:
        value = raw.get(key)
        out[key] = to_int(value)
        if value is not None and out[key] is None:
            as_float = to_float(value)
            if as_float is not None and key not in ("rank", "world_size", "schema_version"):
                out[key] = int(as_float)
            else:
                notes.append(f"{name}: {key} is not a whole number ({_describe(value)})")
    for key in ("world_size", "rank", "local_rank"):
        if out.get(key) is not None and not 0 <= out[key] <= MAX_RANKS:
            notes.append(f"{name}: {key} {out[key]} is outside 0..{MAX_RANKS}; ignored")
            out[key] = None
    for key in _FLOAT_FIELDS:
        value = raw.get(key)
        out[key] = to_float(value)
        if value is not None and out[key] is None:
            if isinstance(value, float) and math.isnan(value):
                notes.append(f"{name}: {key} is NaN")
            else:
                notes.append(f"{name}: {key} is not a finite number ({_describe(value)})")
    for key in _STR_FIELDS:
        value = raw.get(key)
        out[key] = None if value is None else printable(str(value))
    status = out.get("status")
    if status is not None:
        status = status.strip().lower()
    if status not in run_files.STATUSES:
        notes.append(f"{name}: unknown status {_describe(raw.get('status'))}")
        status = "unknown"
    out["status"] = status
    out["gpu"] = _normalize_gpu(raw.get("gpu"), name, notes)
    out["overheads"] = _normalize_overheads(raw.get("overheads"), name, notes)
    out["error"] = _normalize_error(raw.get("error"))
    out["waiting"] = _normalize_waiting(raw.get("waiting"), name, notes)
    out["health"] = normalize_health(raw.get("health"))
    out["best"] = normalize_best(raw.get("best"))
    out["early_stop"] = normalize_early_stop(raw.get("early_stop"))
    out["early_stop_count"] = normalize_early_stop_count(raw.get("early_stop_count"))
    out["stages"] = normalize_stages(raw.get("stages"))
    out["stage"] = normalize_stage(raw.get("stage"))
    out["catalogue_progress"] = _normalize_catalogues(raw.get("catalogue_progress"))
    if out["rank"] is not None and out["rank"] != file_rank:
        notes.append(f"{name} says it is rank {out['rank']}; shown as rank {file_rank} (from the file name)")
    out["rank"] = file_rank
    ordered = {key: out[key] for key in run_files.STATUS_FIELDS if key in out}
    ordered.update((key, value) for key, value in out.items() if key not in ordered)
    return ordered, notes


def _normalize_gpu(value: Any, name: str, notes: list[str]) -> dict | None:
    if value is None:
        return None
    if not isinstance(value, dict):
        notes.append(f"{name}: gpu is not an object ({_describe(value)})")
        return None
    return {"name": None if value.get("name") is None else printable(str(value.get("name"))),
            **{key: to_float(value.get(key)) for key in _GPU_NUMBERS}}


def _normalize_overheads(value: Any, name: str, notes: list[str]) -> dict | None:
    """``{kind: {count, total_s, last_s, mean_s}}`` (checkpoints, LoRA files, validation, samples), typed; a kind
    whose count is not a whole number is left out."""
    if value is None:
        return None
    if not isinstance(value, dict):
        notes.append(f"{name}: overheads is not an object ({_describe(value)})")
        return None
    out = {}
    for kind, tally in itertools.islice(value.items(), MAX_OVERHEAD_KINDS):
        count = to_int(tally.get("count")) if isinstance(tally, dict) else None
        if count is None or count < 0:
            notes.append(f"{name}: overheads[{_describe(kind)}] is not a tally ({_describe(tally)})")
            continue
        out[printable(str(kind))[:40]] = {"count": count, **{key: to_float(tally.get(key))
                                                             for key in ("total_s", "last_s", "mean_s")}}
    return out


def _normalize_waiting(value: Any, name: str, notes: list[str]) -> dict | None:
    """``{"for": what the rank waits for, "since": unix time}`` (a rank blocked in a collective), or None."""
    if value is None:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("for"), str) or to_float(value.get("since")) is None:
        notes.append(f"{name}: waiting is not {{for, since}} ({_describe(value)})")
        return None
    return {"for": printable(value["for"])[:200], "since": to_float(value["since"])}


def health_flags_of(value: Any) -> list[dict]:
    """A LoRA health record's or summary's ``flags``: ``[{"flag", "step", "what", "do"}]``, typed and bounded; an item
    without a flag name is left out."""
    out = []
    for item in value[:MAX_FLAGS] if isinstance(value, list) else []:
        if isinstance(item, dict) and isinstance(item.get("flag"), str) and item["flag"].strip():
            out.append({"flag": printable(item["flag"])[:40], "step": to_int(item.get("step")),
                        **{key: printable(item[key])[:MAX_FLAG_TEXT] if isinstance(item.get(key), str) else None
                           for key in ("what", "do")}})
    return out


def normalize_health(value: Any) -> dict | None:
    """The status file's ``health`` (the newest LoRA health record's summary): ``{"step", "max_update_norm",
    "max_update_block", "max_grad_norm", "max_grad_block", "flags", "seconds"}``, typed; None when absent or not
    an object."""
    if not isinstance(value, dict):
        return None
    return {"step": to_int(value.get("step")), "max_update_norm": to_float(value.get("max_update_norm")),
            "max_update_block": to_int(value.get("max_update_block")),
            "max_grad_norm": to_float(value.get("max_grad_norm")),
            "max_grad_block": to_int(value.get("max_grad_block")),
            "flags": health_flags_of(value.get("flags")), "seconds": to_float(value.get("seconds"))}


MAX_FILE_TEXT = 500   # characters of a path kept


def normalize_best(value: Any) -> dict | None:
    """The status file's ``best`` (the lowest validation so far and its LoRA file): ``{"step", "val_loss",
    "val_loss_base", "gain", "file", "stage"}``, typed; None when absent, not an object or without a step and loss."""
    if not isinstance(value, dict) or to_int(value.get("step")) is None or to_float(value.get("val_loss")) is None:
        return None
    return {"step": to_int(value["step"]), "val_loss": to_float(value["val_loss"]),
            "val_loss_base": to_float(value.get("val_loss_base")), "gain": to_float(value.get("gain")),
            "file": printable(value["file"])[:MAX_FILE_TEXT] if isinstance(value.get("file"), str) else None,
            "stage": normalize_stage(value.get("stage"))}   # --resolution_stages: the stage that trained it


def normalize_early_stop(value: Any) -> dict | None:
    """``early_stop`` (the run ended before its total, ``--early_stop``): its steps and counts, typed."""
    if not isinstance(value, dict) or to_int(value.get("step")) is None:
        return None
    return {**{key: to_int(value.get(key)) for key in ("step", "best_step", "validations_without_improvement",
                                                         "since_step", "patience")},
            "since_val_loss": to_float(value.get("since_val_loss")), "min_delta": to_float(value.get("min_delta"))}


NOT_COUNTED = ("earlier stage", "warm-up", "first", "no finite one yet")   # why a validation counted for nothing


def normalize_early_stop_count(value: Any) -> dict | None:
    """``early_stop_count`` (``--early_stop``: where its count stands after the last validation), typed; None when
    absent, not an object or without a count and patience."""
    if not isinstance(value, dict) or to_int(value.get("count")) is None or to_int(value.get("patience")) is None:
        return None
    reason = value.get("not_counted")
    return {**{key: to_int(value.get(key)) for key in ("step", "count", "patience", "counts_from_step",
                                                         "compared_with_step", "since_step")},
            "min_delta": to_float(value.get("min_delta")), "change": to_float(value.get("change")),
            "not_counted": reason if reason in NOT_COUNTED else None,
            "finite": value.get("finite") is not False, "reset": value.get("reset") is True}


MAX_STAGES = 16


def _stage_row(item: dict) -> dict:
    return {"stage": to_int(item.get("stage")), "size": printable(str(item.get("size")))[:40],
            **{key: to_int(item.get(key)) for key in ("from_step", "to_step", "steps", "tokens")}}


def normalize_stages(value: Any) -> list[dict] | None:
    """``stages`` (--resolution_stages): each stage's number, size and steps, typed and bounded."""
    if not isinstance(value, list):
        return None
    return [_stage_row(item) for item in value[:MAX_STAGES] if isinstance(item, dict) and item.get("size")]


def normalize_stage(value: Any) -> dict | None:
    """``stage``: the stage the next step trains at (``of``: how many there are; ``final``: the final size)."""
    if not isinstance(value, dict) or not value.get("size"):
        return None
    return {**_stage_row(value), "of": to_int(value.get("of")), "final": value.get("final") is True}


def _normalize_catalogues(value: Any) -> list[dict] | None:
    """``catalogue_progress`` (several catalogues): ``[{"name", "seen", "per_epoch"}]`` this epoch on the rank,
    typed and bounded; None when absent or not a list."""
    if not isinstance(value, list):
        return None
    return [{"name": printable(str(item.get("name")))[:80], "seen": to_int(item.get("seen")),
             "per_epoch": to_int(item.get("per_epoch"))}
            for item in value[:MAX_CATALOGUES] if isinstance(item, dict) and item.get("name") is not None]


def waiting_text(waiting: dict | None, now: float) -> str | None:
    """'waiting for ranks in all-reduce (step agreement) since 14:02:11 (95 s)' for a rank's ``waiting``."""
    if not waiting:
        return None
    since = waiting["since"]
    return (f"waiting for {waiting['for']} since {time.strftime('%H:%M:%S', time.localtime(since))} "
            f"({max(0.0, now - since):.0f} s)")


def _normalize_error(value: Any) -> dict | None:
    if value is None:
        return None
    if not isinstance(value, dict):
        return {"type": None, "message": printable(str(value)), "traceback_tail": None}
    tail = value.get("traceback_tail")
    if isinstance(tail, (list, tuple)):
        tail = "\n".join(str(line).rstrip("\n") for line in tail)
    elif tail is not None:
        tail = str(tail)
    tail = None if tail is None else printable(tail)
    return {
        "type": None if value.get("type") is None else printable(str(value.get("type"))),
        "message": None if value.get("message") is None else printable(str(value.get("message"))),
        "traceback_tail": tail,
    }


class StatusFile:
    __slots__ = ("rank", "path", "data", "notes", "mtime", "error", "size", "mtime_ns", "remote")

    def __init__(self, rank: int, path: Path):
        self.rank = rank
        self.path = path
        self.data: dict | None = None
        self.notes: list[str] = []
        self.mtime: float | None = None
        self.mtime_ns: tuple[int, int] | None = None  # (inode, mtime_ns) of the last read
        self.size: int | None = None
        self.error: str | None = None
        self.remote = False  # read from another monitor's URL, not from a file


def open_regular(path):
    """Open a file for reading only if it is a regular file, without ever blocking (a FIFO named like a run
    file would hang a plain open until someone writes to it)."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(f"{path} is not a regular file")
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def read_status_file(sf: "StatusFile", warn: Callable[[str], None]) -> None:
    """(Re-)read a status file unless unchanged since the last read; a bad read keeps the last good one."""
    try:
        with open_regular(sf.path) as handle:
            st = os.fstat(handle.fileno())
            if sf.data is not None and sf.error is None and sf.mtime_ns == (st.st_ino, st.st_mtime_ns) \
                    and st.st_size == sf.size:
                return  # unchanged since the last read
            raw = handle.read(4 << 20)
    except FileNotFoundError:
        return  # replaced or removed between listing and opening; the next refresh sees it
    except OSError as exc:
        sf.error = f"{sf.path.name}: cannot read ({exc})"
        return
    name = sf.path.name
    problem = None
    obj = None
    if not raw.strip():
        problem = f"{name} is empty"
    else:
        try:
            obj = json.loads(raw)
        except (ValueError, UnicodeDecodeError) as exc:
            problem = f"{name} is not valid JSON ({str(exc)[:80]})"
        except RecursionError:
            problem = f"{name} is nested too deeply to be a status file"
        else:
            if not isinstance(obj, dict):
                problem = f"{name} does not hold a JSON object"
    sf.mtime_ns = (st.st_ino, st.st_mtime_ns)
    sf.size = st.st_size
    sf.mtime = st.st_mtime
    if problem is not None:
        sf.error = problem + ("; showing its last good read" if sf.data is not None else "")
        return
    sf.error = None
    sf.data, sf.notes = normalize_status(obj, sf.rank)
    version = sf.data.get("schema_version")
    if version is not None and version > run_files.SCHEMA_VERSION:
        warn(f"schema_version {version} is newer than this monitor's {run_files.SCHEMA_VERSION}; "
                   "unknown fields are passed through, changed ones may show wrongly")
    elif version is None and "schema_version" not in obj:
        warn(f"{name} has no schema_version")
