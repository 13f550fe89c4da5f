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

from diffsynth_mbc import run_files, run_layout
from diffsynth_mbc.run_files import HEALTH_FLAGS, STATUS_SCHEMA, Field, ListOf, MapOf, Obj
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
    """Typed copy of one status file's object, read through ``run_files.STATUS_SCHEMA``, and the notes about what had
    to be fixed.

    Every declared field gets its declared type (numbers from numeric strings; None where unreadable); the fields
    every file has are always there, the others when the file has them. Fields the schema does not declare (a newer
    writer's) are kept as they are (made JSON-safe).
    """
    notes: list[str] = []
    name = run_layout.status_file_name(file_rank)
    out: dict[str, Any] = {printable(str(key)): json_safe(value) for key, value in raw.items()
                           if key not in STATUS_SCHEMA and key not in _COMPUTED}
    for key, field in STATUS_SCHEMA.items():
        if not field.optional or key in raw:
            out[key] = read_field(field, raw.get(key), name, notes)
    for key in ("world_size", "rank", "local_rank"):
        if out.get(key) is not None and not 0 <= out[key] <= MAX_RANKS:
            notes.append(f"{name}: {key} {out[key]} is outside 0..{MAX_RANKS}; ignored")
            out[key] = None
    status = out.get("status")
    if status is not None:
        status = status.strip().lower()
    if status not in run_files.STATUSES:
        notes.append(f"{name}: unknown status {_describe(raw.get('status'))}")
        status = "unknown"
    out["status"] = status
    out["error"] = _normalize_error(raw.get("error"))
    if out["rank"] is not None and out["rank"] != file_rank:
        notes.append(f"{name} says it is rank {out['rank']}; shown as rank {file_rank} (from the file name)")
    out["rank"] = file_rank
    ordered = {key: out[key] for key in STATUS_SCHEMA if key in out}
    ordered.update((key, value) for key, value in out.items() if key not in ordered)
    return ordered, notes


# ----------------------------------------------------------------------------------------------
# Reading a field as the schema declares it


def read_field(field: Field, value: Any, name: str | None = None, notes: list[str] | None = None) -> Any:
    """``value`` as ``field`` declares it, None where it cannot be read. ``notes`` (a file's own fields, named by
    the file ``name``) gets what could not be read of the numbers every file has and of the fields declared
    ``noted``."""
    kind = field.type
    if kind is int:
        return _read_int(field, value, name, notes)
    if kind is float:
        return _read_float(field, value, name, notes)
    if kind is str:
        text = _read_text(field, value, as_text=field.as_text or notes is not None)
        return text if not field.choices or text in field.choices else None
    if kind is bool:
        return value if isinstance(value, bool) else field.default
    if isinstance(kind, Obj):
        return _read_object(field, kind, value, name, notes)
    if isinstance(kind, ListOf):
        return _read_list(field, kind, value, inside=notes is None)
    if isinstance(kind, MapOf):
        return _read_map(field, kind, value, name, notes)
    if kind in (dict, list):   # a JSON object or list of any content
        return json_safe(value) if isinstance(value, kind) else None
    return json_safe(value)


def _noted(field: Field, notes: list[str] | None) -> bool:
    return notes is not None and (field.noted or not field.optional)


def _read_int(field: Field, value: Any, name: str | None, notes: list[str] | None) -> int | None:
    result = to_int(value)
    if result is None and value is not None and notes is not None:
        as_float = to_float(value)
        if as_float is not None and not field.whole:
            result = int(as_float)   # a count written as a float: its whole part
        elif _noted(field, notes):
            notes.append(f"{name}: {field.name} is not a whole number ({_describe(value)})")
    if result is not None and field.at_least is not None and result < field.at_least:
        return None
    return result


def _read_float(field: Field, value: Any, name: str | None, notes: list[str] | None) -> float | None:
    result = to_float(value)
    if result is None and value is not None and _noted(field, notes):
        if isinstance(value, float) and math.isnan(value):
            notes.append(f"{name}: {field.name} is NaN")
        else:
            notes.append(f"{name}: {field.name} is not a finite number ({_describe(value)})")
    return result


def _read_text(field: Field, value: Any, as_text: bool) -> str | None:
    if isinstance(value, str):
        text = printable(value)
    elif value is not None and as_text:
        text = printable(str(value))
    else:
        return None
    if not field.blank and not text.strip():
        return None
    return text[:field.limit] if field.limit is not None else text


def _read_object(field: Field, kind: Obj, value: Any, name: str | None, notes: list[str] | None) -> dict | None:
    """The declared parts of an object (a part written only sometimes, when it is there); None when it is no object
    or lacks a required part."""
    if value is None:
        return None
    out = {}
    if isinstance(value, dict):
        for part in kind.fields:
            if part.optional and part.name not in value:
                continue
            out[part.name] = read_field(part, value.get(part.name))
            if part.required and out[part.name] is None:
                break
        else:
            return out
    if field.noted and notes is not None:
        notes.append(f"{name}: {field.name} is not {kind.called} ({_describe(value)})")
    return None


def _read_list(field: Field, kind: ListOf, value: Any, inside: bool) -> list | None:
    """The items that read as declared, of the first ``limit``; a list inside an object reads as [] when missing."""
    if not isinstance(value, list):
        return [] if inside else None
    item = Field(field.name, kind.item)
    read = (read_field(item, each) for each in (value if field.limit is None else value[:field.limit]))
    return [each for each in read if each is not None]


def _read_map(field: Field, kind: MapOf, value: Any, name: str | None, notes: list[str] | None) -> dict | None:
    """Each key (as text) to its value as declared; a key whose object cannot be read is left out (and noted)."""
    if value is None:
        return None
    if not isinstance(value, dict):
        if field.noted and notes is not None:
            notes.append(f"{name}: {field.name} is not an object ({_describe(value)})")
        return None
    out = {}
    entry = Field(field.name, kind.value)
    for key, each in itertools.islice(value.items(), field.limit):
        read = read_field(entry, each)
        if read is None and isinstance(kind.value, Obj):
            if field.noted and notes is not None:
                notes.append(f"{name}: {field.name}[{_describe(key)}] is not {kind.value.called} ({_describe(each)})")
            continue
        text = printable(str(key))
        out[text[:kind.key_limit] if kind.key_limit is not None else text] = read
    return out


def health_flags_of(value: Any) -> list[dict]:
    """A LoRA health record's or summary's ``flags``: ``[{"flag", "step", "what", "do"}]``, typed and bounded; an item
    without a flag name is left out."""
    return read_field(HEALTH_FLAGS, value)


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
