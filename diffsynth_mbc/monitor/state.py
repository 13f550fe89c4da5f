"""What the monitor knows about a run, built from the per-rank files in a log directory.

Pure logic, no rendering and no HTTP: parsing the status files, reading the JSONL history
incrementally, down-sampling it for drawing, stall detection, the ETA pick and the derivation
of one run status from the rank statuses. Imports neither rich, torch nor diffsynth.

The rules (also in ``python -m diffsynth_mbc.monitor --help``):

Which run is shown
    Status files are grouped by ``run_id``; the group with the newest ``started_at`` (then
    newest ``updated_at``, then newest file) is the run. Files of other runs are left out and
    listed in ``ignored_runs`` and the notes. Ranks at or above the run's ``world_size`` are
    left out with a note.

Stalled rank
    A rank whose status is ``starting``, ``loading`` or ``training`` and whose ``updated_at``
    is older than the stall threshold. The threshold is ``--stall-after`` when given, else the
    larger of 120 s and 10x the rank's median step time (last 101 steps of its history, else
    its ``step_time_s``). ``stalled_since`` is its last ``updated_at``.

Missing rank
    A rank below ``world_size`` with no readable status file. It is listed in
    ``missing_ranks`` but does not change the run status: with a log directory that is not
    shared between nodes, the other nodes' ranks are always missing here.

Run status, first rule that matches
    ``no_data`` (no status file of any run) > ``failed`` (any rank failed) > ``stalled`` (any
    rank stalled) > ``finished`` (every present rank finished) > ``stopped`` (no rank active
    and at least one stopped) > ``training`` / ``loading`` / ``starting`` (the most advanced
    status among the active ranks).

Exit codes of ``--once``
    0 starting, loading, training, finished and stopped (a stop is asked for by someone, it is
    not an error); 1 failed; 3 stalled; 4 no data.

Aggregates
    ``step``: the slowest rank's step; ``total_steps``: the largest; ``progress``: the slowest
    rank's; ``eta_s``: the largest among active ranks (their own ``eta_s``, else remaining
    steps x median step time); ``samples_per_s``: the sum over training ranks; ``loss``: the
    mean of the ranks' last losses; ``elapsed_s``: now - earliest ``started_at`` while active,
    else the largest ``elapsed_s``.
"""

from __future__ import annotations

import bisect
import json
import math
import os
import statistics
import threading
import time
from collections import deque
from pathlib import Path
from typing import Any, Callable, Iterable

from diffsynth_mbc import run_files

STALL_MIN_S = 120.0
STALL_STEP_FACTOR = 10.0
MAX_POINTS = 2000  # per rank and series kept for drawing
INDEX_EVERY = 512  # JSONL lines between two entries of the byte-offset index
READ_CHUNK = 4 << 20
MAX_LINE_BYTES = 1 << 20  # a "line" longer than this without a newline is garbage, skipped
TREND_POINTS = 24
RECENT_STEP_TIMES = 101

RUN_STATUSES = ("starting", "loading", "training", "stalled", "finished", "failed", "stopped", "no_data")
EXIT_CODES = {
    "starting": 0, "loading": 0, "training": 0, "finished": 0, "stopped": 0,
    "failed": 1, "stalled": 3, "no_data": 4,
}

_INT_FIELDS = ("schema_version", "rank", "local_rank", "world_size", "pid", "epoch", "num_epochs", "step",
               "total_steps", "steps_per_epoch", "samples_seen")
_FLOAT_FIELDS = ("loss", "loss_avg", "lr", "grad_norm", "step_time_s", "samples_per_s", "elapsed_s", "eta_s",
                 "progress", "started_at", "updated_at")
_STR_FIELDS = ("run_id", "hostname", "status", "phase")
_COMPUTED = ("stalled", "age_s", "stall_after_s", "stalled_since", "median_step_time_s", "loss_trend",
             "history_lines", "file")


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
    if value is None or isinstance(value, (bool, int, str)):
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
        if key in _INT_FIELDS or key in _FLOAT_FIELDS or key in _STR_FIELDS or key in ("gpu", "error"):
            continue
        if key in _COMPUTED:
            continue
        out[str(key)] = json_safe(value)
    for key in _INT_FIELDS:
        value = raw.get(key)
        out[key] = to_int(value)
        if value is not None and out[key] is None:
            as_float = to_float(value)
            if as_float is not None and key not in ("rank", "world_size", "schema_version"):
                out[key] = int(as_float)
            else:
                notes.append(f"{name}: {key} is not a whole number ({_describe(value)})")
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
        out[key] = None if value is None else str(value)
    status = out.get("status")
    if status is not None:
        status = status.strip().lower()
    if status not in run_files.STATUSES:
        notes.append(f"{name}: unknown status {_describe(raw.get('status'))}")
        status = "unknown"
    out["status"] = status
    out["gpu"] = _normalize_gpu(raw.get("gpu"), name, notes)
    out["error"] = _normalize_error(raw.get("error"))
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
    return {
        "name": None if value.get("name") is None else str(value.get("name")),
        "util_pct": to_float(value.get("util_pct")),
        "mem_used_mb": to_float(value.get("mem_used_mb")),
        "mem_total_mb": to_float(value.get("mem_total_mb")),
    }


def _normalize_error(value: Any) -> dict | None:
    if value is None:
        return None
    if not isinstance(value, dict):
        return {"type": None, "message": str(value), "traceback_tail": None}
    tail = value.get("traceback_tail")
    if isinstance(tail, (list, tuple)):
        tail = "\n".join(str(line).rstrip("\n") for line in tail)
    elif tail is not None:
        tail = str(tail)
    return {
        "type": None if value.get("type") is None else str(value.get("type")),
        "message": None if value.get("message") is None else str(value.get("message")),
        "traceback_tail": tail,
    }


# ----------------------------------------------------------------------------------------------
# Down-sampling


class Series:
    """At most ``max_points`` buckets of (last x, mean, min, max, count) over an unbounded stream.

    Every bucket but the last holds ``bucket`` samples; when a new bucket would exceed
    ``max_points``, neighbouring buckets are merged in pairs and ``bucket`` doubles, so memory
    stays bounded and adding is amortised O(1).
    """

    __slots__ = ("max_points", "bucket", "x", "mean", "lo", "hi", "n", "count")

    def __init__(self, max_points: int = MAX_POINTS):
        self.max_points = max(2, int(max_points) // 2 * 2)
        self.bucket = 1
        self.x: list[float] = []
        self.mean: list[float] = []
        self.lo: list[float] = []
        self.hi: list[float] = []
        self.n: list[int] = []
        self.count = 0

    def __len__(self) -> int:
        return len(self.x)

    def add(self, x: float, y: float) -> None:
        self.count += 1
        if self.n and self.n[-1] < self.bucket:
            k = self.n[-1]
            self.mean[-1] += (y - self.mean[-1]) / (k + 1)
            self.lo[-1] = min(self.lo[-1], y)
            self.hi[-1] = max(self.hi[-1], y)
            self.n[-1] = k + 1
            self.x[-1] = x
            return
        self.x.append(x)
        self.mean.append(y)
        self.lo.append(y)
        self.hi.append(y)
        self.n.append(1)
        if len(self.x) > self.max_points:
            self._halve()

    def extend(self, xs: list, ys: list) -> None:
        """Same result as ``add`` for each pair, a bucket at a time (sum/min/max run in C)."""
        i, total = 0, len(xs)
        self.count += total
        while i < total:
            if self.n and self.n[-1] < self.bucket:
                k = self.n[-1]
                take = min(self.bucket - k, total - i)
                seg = ys[i:i + take]
                self.mean[-1] = (self.mean[-1] * k + sum(seg)) / (k + take)
                self.lo[-1] = min(self.lo[-1], min(seg))
                self.hi[-1] = max(self.hi[-1], max(seg))
                self.n[-1] = k + take
                self.x[-1] = xs[i + take - 1]
            else:
                take = min(self.bucket, total - i)
                seg = ys[i:i + take]
                self.x.append(xs[i + take - 1])
                self.mean.append(sum(seg) / take)
                self.lo.append(min(seg))
                self.hi.append(max(seg))
                self.n.append(take)
                if len(self.x) > self.max_points:
                    self._halve()
            i += take

    def _halve(self) -> None:
        x, mean, lo, hi, n = [], [], [], [], []
        size = len(self.x)
        for i in range(0, size - 1, 2):
            n1, n2 = self.n[i], self.n[i + 1]
            x.append(self.x[i + 1])
            mean.append((self.mean[i] * n1 + self.mean[i + 1] * n2) / (n1 + n2))
            lo.append(min(self.lo[i], self.lo[i + 1]))
            hi.append(max(self.hi[i], self.hi[i + 1]))
            n.append(n1 + n2)
        if size % 2:
            x.append(self.x[-1])
            mean.append(self.mean[-1])
            lo.append(self.lo[-1])
            hi.append(self.hi[-1])
            n.append(self.n[-1])
        self.x, self.mean, self.lo, self.hi, self.n = x, mean, lo, hi, n
        self.bucket *= 2

    def points(self, since: float | None = None, max_points: int | None = None) -> list[dict]:
        """Buckets with x > since, merged further so that at most ``max_points`` come back."""
        start = 0
        if since is not None:
            start = len(self.x)
            for i, xv in enumerate(self.x):  # x is usually increasing, but not after a restart
                if xv > since:
                    start = i
                    break
        size = len(self.x) - start
        group = 1
        if max_points is not None and max_points > 0 and size > max_points:
            group = math.ceil(size / max_points)
        if group == 1:
            return [{"step": x, "value": m, "min": lo, "max": hi, "n": n}
                    for x, m, lo, hi, n in zip(self.x[start:], self.mean[start:], self.lo[start:], self.hi[start:],
                                               self.n[start:])]
        out = []
        for g in range(start, len(self.x), group):
            end = min(g + group, len(self.x))
            ns = self.n[g:end]
            total = sum(ns)
            out.append({
                "step": self.x[end - 1],
                "value": sum(m * k for m, k in zip(self.mean[g:end], ns)) / total,
                "min": min(self.lo[g:end]),
                "max": max(self.hi[g:end]),
                "n": total,
            })
        return out

    def trend(self, width: int = TREND_POINTS) -> list[float]:
        return [float(f"{p['value']:.6g}") for p in self.points(max_points=width)][-width:]


# ----------------------------------------------------------------------------------------------
# Incremental JSONL reader


_DECODER = json.JSONDecoder()


def _fast_float(value: Any) -> float | None:
    """to_float with a fast path for the JSON numbers that nearly every line holds."""
    kind = type(value)
    if kind is float:
        return value if value - value == 0.0 else None  # NaN and inf give NaN
    return to_float(value)


def _record_step(record: dict) -> float | None:
    step = to_float(record.get("step"))
    return int(step) if step is not None and step.is_integer() else step


class _Batch:
    """Values parsed from one read, fed to the series in bulk."""

    __slots__ = ("loss_x", "loss_y", "lr_x", "lr_y", "step_times")

    def __init__(self):
        self.loss_x: list = []
        self.loss_y: list = []
        self.lr_x: list = []
        self.lr_y: list = []
        self.step_times: list = []


class HistoryFile:
    """One rank's ``training_gpu{rank}.jsonl``, read incrementally.

    Remembers the file's identity (device, inode) and how many bytes were consumed; each
    ``poll`` reads only what was appended. A file that shrank or whose inode changed is read
    again from the start. A last line without its newline is left for the next poll (torn
    line). Keeps bounded down-sampled series, the recent step times and a sparse index of
    byte offsets (one per ``INDEX_EVERY`` lines, with the largest step seen before it) so that
    a window of raw records can be read without scanning the whole file.
    """

    def __init__(self, path: str | Path, max_points: int = MAX_POINTS, index_every: int = INDEX_EVERY):
        self.path = Path(path)
        self.max_points = max_points
        self.index_every = max(1, int(index_every))
        self.rereads = 0
        self._reset()

    def _reset(self) -> None:
        self.ident: tuple[int, int] | None = None
        self.offset = 0  # bytes consumed, always at a line boundary
        self.lines = 0
        self.records = 0
        self.bad_lines = 0
        self.last_bad_line: int | None = None
        self.torn = False
        self.skipped_bytes = 0
        self.index_keys: list[float] = []  # largest step before the entry (non-decreasing)
        self.index_offsets: list[int] = []
        self._prefix_max = -math.inf
        self.loss = Series(self.max_points)
        self.lr = Series(self.max_points)
        self.val_loss = Series(self.max_points)
        self.step_times: deque[float] = deque(maxlen=RECENT_STEP_TIMES)
        self.last_step: float | None = None
        self.last_time: float | None = None

    def median_step_time(self) -> float | None:
        return statistics.median(self.step_times) if self.step_times else None

    def poll(self) -> bool:
        """Read what was appended since the last poll. True when something new was read."""
        try:
            handle = open(self.path, "rb")
        except FileNotFoundError:
            if self.ident is not None:
                self.rereads += 1
                self._reset()
                return True
            return False
        except OSError:
            return False
        with handle:
            st = os.fstat(handle.fileno())
            ident = (st.st_dev, st.st_ino)
            if self.ident is not None and (ident != self.ident or st.st_size < self.offset):
                self.rereads += 1
                self._reset()
            self.ident = ident
            if st.st_size == self.offset:
                return False
            handle.seek(self.offset)
            carry = b""
            changed = False
            while True:
                chunk = handle.read(READ_CHUNK)
                if not chunk:
                    break
                buf = carry + chunk if carry else chunk
                cut = buf.rfind(b"\n")
                if cut >= 0:
                    self._consume(buf, cut + 1)
                    changed = True
                carry = buf[cut + 1:]
                if len(carry) > MAX_LINE_BYTES:  # garbage without line breaks: skip it
                    self.offset += len(carry)
                    self.skipped_bytes += len(carry)
                    carry = b""
                    changed = True
            self.torn = bool(carry.strip())
        return changed

    def _consume(self, buf: bytes, end: int) -> None:
        offset = self.offset
        pos = 0
        decode = _DECODER.decode
        every = self.index_every
        find = buf.index
        batch = _Batch()
        while pos < end:
            nl = find(b"\n", pos, end)
            if self.lines % every == 0:
                self.index_keys.append(self._prefix_max)
                self.index_offsets.append(offset + pos)
            self.lines += 1
            line = buf[pos:nl]
            pos = nl + 1
            try:
                record = decode(line.decode("utf-8"))
            except (ValueError, UnicodeDecodeError):
                if line.strip():
                    self._bad()
                continue
            if type(record) is not dict:
                self._bad()
                continue
            self._add(record, batch)
        self.offset = offset + end
        self.loss.extend(batch.loss_x, batch.loss_y)
        self.lr.extend(batch.lr_x, batch.lr_y)
        self.step_times.extend(batch.step_times[-RECENT_STEP_TIMES:])

    def _bad(self) -> None:
        self.bad_lines += 1
        self.last_bad_line = self.lines

    def _add(self, record: dict, batch: "_Batch") -> None:
        get = record.get
        step = _fast_float(get("step"))
        if step is None:
            self._bad()
            return
        if step.is_integer():
            step = int(step)
        self.records += 1
        if step > self._prefix_max:
            self._prefix_max = step
        when = _fast_float(get("time"))
        if when is not None:
            self.last_time = when
        kind = get("kind")
        val = get("val_loss")
        if val is not None:
            val = _fast_float(val)
        if kind is not None and str(kind).lower() in ("val", "validation", "eval"):
            if val is None:
                val = _fast_float(get("loss"))
            if val is not None:
                self.val_loss.add(step, val)
            return
        if val is not None:
            self.val_loss.add(step, val)
        self.last_step = step
        loss = _fast_float(get("loss"))
        if loss is not None:
            batch.loss_x.append(step)
            batch.loss_y.append(loss)
        lr = _fast_float(get("lr"))
        if lr is not None:
            batch.lr_x.append(step)
            batch.lr_y.append(lr)
        step_time = _fast_float(get("step_time_s"))
        if step_time is not None and step_time >= 0:
            batch.step_times.append(step_time)

    def seek_point(self, since: float | None) -> tuple[tuple[int, int] | None, int, int]:
        """(file identity, byte offset to start reading from, bytes known to be complete)."""
        if since is None or not self.index_keys:
            return self.ident, 0, self.offset
        i = bisect.bisect_right(self.index_keys, since) - 1
        return self.ident, (self.index_offsets[i] if i >= 0 else 0), self.offset

    def notes(self) -> list[str]:
        name = self.path.name
        out = []
        if self.bad_lines:
            out.append(f"{name}: skipped {self.bad_lines} unreadable line(s) (last at line {self.last_bad_line})")
        if self.torn:
            out.append(f"{name}: last line incomplete, waiting for the rest")
        if self.skipped_bytes:
            out.append(f"{name}: skipped {self.skipped_bytes} bytes without line breaks")
        if self.rereads:
            out.append(f"{name}: file was replaced or truncated {self.rereads} time(s); read again from the start")
        return out


def read_history_window(path: Path, ident: tuple[int, int] | None, start: int, since: float | None,
                        limit: int) -> tuple[list[dict], bool]:
    """Raw JSONL records with step > since, in file order, from byte ``start``; at most ``limit``.

    Returns (records, truncated). Falls back to the start of the file when the file is no
    longer the one the offset was taken from.
    """
    records: list[dict] = []
    try:
        handle = open(path, "rb")
    except OSError:
        return records, False
    with handle:
        st = os.fstat(handle.fileno())
        if ident is None or (st.st_dev, st.st_ino) != ident or start > st.st_size:
            start = 0
        if start > 0:
            handle.seek(start - 1)
            if handle.read(1) != b"\n":
                start = 0
        handle.seek(start)
        for line in handle:
            if not line.endswith(b"\n"):
                break  # torn last line
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except ValueError:
                continue
            if not isinstance(record, dict):
                continue
            step = _record_step(record)
            if step is None or (since is not None and step <= since):
                continue
            if len(records) >= limit:
                return records, True
            records.append(json_safe(record))
    return records, False


# ----------------------------------------------------------------------------------------------
# The state of a run


class _StatusFile:
    __slots__ = ("rank", "path", "data", "notes", "mtime", "error", "size", "mtime_ns")

    def __init__(self, rank: int, path: Path):
        self.rank = rank
        self.path = path
        self.data: dict | None = None
        self.notes: list[str] = []
        self.mtime: float | None = None
        self.mtime_ns: tuple[int, int] | None = None  # (inode, mtime_ns) of the last read
        self.size: int | None = None
        self.error: str | None = None


class MonitorState:
    """Reads a log directory on every ``refresh`` and builds the aggregate (a JSON-safe dict).

    ``clock`` gives the wall time in unix seconds (compared with ``updated_at``); inject a fake
    one in tests. Thread-safe: ``refresh``/``snapshot``/``metrics`` may be called from the
    live view and from HTTP handler threads.
    """

    def __init__(self, log_dir: str | Path, *, stall_after: float | None = None,
                 clock: Callable[[], float] = time.time, max_points: int = MAX_POINTS,
                 index_every: int = INDEX_EVERY):
        self.log_dir = Path(log_dir)
        self.stall_after = stall_after
        self.clock = clock
        self.max_points = max_points
        self.index_every = index_every
        self._lock = threading.RLock()
        self._status: dict[int, _StatusFile] = {}
        self._history: dict[int, HistoryFile] = {}
        self._warned: dict[str, None] = {}  # warn-once notes, in order
        self._snapshot: dict | None = None
        self._refreshed_mono: float | None = None
        self.last_refresh_s: float | None = None

    # -- reading -------------------------------------------------------------------------------

    def _scan(self) -> str | None:
        """Re-read the status files that changed; returns a problem with the directory, if any."""
        try:
            entries = list(os.scandir(self.log_dir))
        except FileNotFoundError:
            self._status.clear()
            return f"log directory {self.log_dir} does not exist (yet)"
        except NotADirectoryError:
            self._status.clear()
            return f"{self.log_dir} is not a directory"
        except OSError as exc:
            return f"cannot list {self.log_dir}: {exc}"
        seen: set[int] = set()
        for entry in entries:
            rank = run_files.rank_of_status_file(entry.name)
            if rank is None:
                continue
            seen.add(rank)
            sf = self._status.get(rank)
            if sf is None:
                sf = self._status[rank] = _StatusFile(rank, Path(entry.path))
            self._read_status(sf)
        for rank in list(self._status):
            if rank not in seen:
                del self._status[rank]
        return None

    def _read_status(self, sf: _StatusFile) -> None:
        try:
            with open(sf.path, "rb") as handle:
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
            self._warn(f"schema_version {version} is newer than this monitor's {run_files.SCHEMA_VERSION}; "
                       "unknown fields are passed through, changed ones may show wrongly")
        elif version is None and "schema_version" not in obj:
            self._warn(f"{name} has no schema_version")

    def _warn(self, message: str) -> None:
        self._warned.setdefault(message, None)

    def _history_for(self, rank: int) -> HistoryFile:
        hf = self._history.get(rank)
        if hf is None:
            hf = self._history[rank] = HistoryFile(run_files.history_path(self.log_dir, rank),
                                                   max_points=self.max_points, index_every=self.index_every)
        return hf

    # -- public --------------------------------------------------------------------------------

    def refresh(self) -> dict:
        """Read what changed and rebuild the aggregate; returns it."""
        with self._lock:
            t0 = time.perf_counter()
            dir_problem = self._scan()
            snapshot = self._build(dir_problem)
            self.last_refresh_s = time.perf_counter() - t0
            snapshot["refresh_ms"] = round(self.last_refresh_s * 1000, 2)
            self._snapshot = snapshot
            self._refreshed_mono = time.monotonic()
            return snapshot

    def snapshot(self, max_age_s: float = 0.0) -> dict:
        """The aggregate, refreshed first unless the last refresh is younger than ``max_age_s``."""
        with self._lock:
            if self._snapshot is None or self._refreshed_mono is None \
                    or time.monotonic() - self._refreshed_mono >= max_age_s:
                return self.refresh()
            return self._snapshot

    def run_ranks(self) -> list[int]:
        with self._lock:
            snap = self._snapshot if self._snapshot is not None else self.refresh()
            present = [r["rank"] for r in snap["ranks"]]
            return sorted(set(present) | set(snap["missing_ranks"]))

    def metrics(self, rank: int | None = None, since: float | None = None, limit: int = 1000,
                points: int | None = None) -> dict:
        """Per-step history of one rank or of every rank of the run with a status file, keyed by rank.

        Raw JSONL records with step > since (at most ``limit`` per rank; ``truncated`` says
        more exist and ``next_since`` is where to continue), or with ``points`` the bounded
        down-sampled series (loss, lr, val_loss: bucket mean, min, max) with at most that many
        points per series.
        """
        with self._lock:
            snap = self.snapshot(max_age_s=0.5)
            ranks = sorted(r["rank"] for r in snap["ranks"]) if rank is None else [rank]
            plan = {}
            for r in ranks:
                hf = self._history_for(r)
                hf.poll()
                if points is not None:
                    plan[r] = {
                        "downsampled": True,
                        "bucket": hf.loss.bucket,
                        "lines": hf.lines,
                        "loss": hf.loss.points(since, points),
                        "lr": hf.lr.points(since, points),
                        "val_loss": hf.val_loss.points(since, points),
                        "last_step": hf.last_step,
                    }
                else:
                    plan[r] = hf.seek_point(since)
        out: dict[str, Any] = {"run_id": snap.get("run_id"), "since": since, "limit": limit,
                               "points": points, "ranks": {}}
        for r in ranks:
            if points is not None:
                out["ranks"][str(r)] = plan[r]
                continue
            ident, start, _ = plan[r]
            records, truncated = read_history_window(run_files.history_path(self.log_dir, r), ident, start,
                                                     since, limit)
            last = records[-1].get("step") if records else since
            out["ranks"][str(r)] = {"records": records, "truncated": truncated, "next_since": last}
        return out

    # -- aggregation ---------------------------------------------------------------------------

    def _build(self, dir_problem: str | None) -> dict:
        now = self.clock()
        notes: list[str] = []
        if dir_problem:
            notes.append(dir_problem)
        good = {r: sf for r, sf in self._status.items() if sf.data is not None}
        for sf in sorted(self._status.values(), key=lambda s: s.rank):
            if sf.error:
                notes.append(sf.error)

        run_id, chosen, ignored = _pick_run(good)
        world_size = _world_size(chosen)
        ranks_out = []
        for rank in sorted(chosen):
            if world_size is not None and rank >= world_size:
                notes.append(f"training_gpu{rank}.json: rank {rank} is outside world_size {world_size}; left out")
                continue
            sf = chosen[rank]
            notes.extend(sf.notes)
            hf = self._history_for(rank)
            hf.poll()
            notes.extend(hf.notes())
            ranks_out.append(self._rank_view(sf, hf, now))
        present = {r["rank"] for r in ranks_out}
        missing = sorted(set(range(world_size or 0)) - present)
        for rank in missing:
            sf = self._status.get(rank)
            why = "its status file is unreadable" if sf is not None and sf.data is None else "no status file yet"
            notes.append(f"rank {rank} missing: {why}")
        ignored_runs: dict[str, list[int]] = {}
        for sf in ignored:
            key = str(sf.data.get("run_id"))
            ignored_runs.setdefault(key, []).append(sf.rank)
        for key, ranks in sorted(ignored_runs.items()):
            notes.append(f"ignored files of run {key} (ranks {', '.join(map(str, sorted(ranks)))}): "
                         f"older than run {run_id}")
        notes.extend(self._warned)

        status = _run_status(ranks_out)
        agg = _aggregate(ranks_out, status, now)
        errors = []
        for r in ranks_out:
            if r.get("status") == "failed":
                error = r.get("error") or {"type": None, "message": "failed without an error record",
                                           "traceback_tail": None}
                errors.append({"rank": r["rank"], "hostname": r.get("hostname"), **error})
        return {
            "status": status,
            "run_id": run_id,
            "world_size": world_size,
            **agg,
            "ranks": ranks_out,
            "stalled_ranks": [r["rank"] for r in ranks_out if r["stalled"]],
            "missing_ranks": missing,
            "errors": errors,
            "ignored_runs": [{"run_id": k, "ranks": sorted(v)} for k, v in sorted(ignored_runs.items())],
            "notes": list(dict.fromkeys(notes)),
            "now": now,
            "schema_version": run_files.SCHEMA_VERSION,
        }

    def _rank_view(self, sf: _StatusFile, hf: HistoryFile, now: float) -> dict:
        data = dict(sf.data)
        updated = data.get("updated_at")
        if updated is None:
            updated = sf.mtime
        age = None if updated is None else max(0.0, now - updated)
        median = hf.median_step_time()
        if median is None:
            median = data.get("step_time_s")
        if self.stall_after is not None:
            threshold = float(self.stall_after)
        else:
            threshold = max(STALL_MIN_S, STALL_STEP_FACTOR * median) if median else STALL_MIN_S
        stalled = bool(data.get("status") in run_files.ACTIVE_STATUSES and age is not None and age > threshold)
        data.update({
            "stalled": stalled,
            "age_s": None if age is None else round(age, 3),
            "stall_after_s": threshold,
            "stalled_since": updated if stalled else None,
            "median_step_time_s": median,
            "loss_trend": hf.loss.trend(TREND_POINTS),
            "history_lines": hf.records,
        })
        return data


def _pick_run(good: dict[int, _StatusFile]) -> tuple[str | None, dict[int, _StatusFile], list[_StatusFile]]:
    if not good:
        return None, {}, []
    groups: dict[Any, list[_StatusFile]] = {}
    for sf in good.values():
        groups.setdefault(sf.data.get("run_id"), []).append(sf)

    def recency(files: list[_StatusFile]) -> tuple:
        def best(key):
            values = [f.data.get(key) for f in files if f.data.get(key) is not None]
            return max(values) if values else -math.inf
        return best("started_at"), best("updated_at"), max((f.mtime or 0.0) for f in files)

    run_id = max(groups, key=lambda k: recency(groups[k]))
    chosen = {sf.rank: sf for sf in groups[run_id]}
    ignored = [sf for k, files in groups.items() if k != run_id for sf in files]
    return run_id, chosen, sorted(ignored, key=lambda s: s.rank)


def _world_size(chosen: dict[int, _StatusFile]) -> int | None:
    if not chosen:
        return None
    declared = [sf.data["world_size"] for sf in chosen.values() if (sf.data.get("world_size") or 0) > 0]
    if declared:
        return max(set(declared), key=lambda v: (declared.count(v), v))
    return max(chosen) + 1


def _run_status(ranks: list[dict]) -> str:
    if not ranks:
        return "no_data"
    statuses = [r.get("status") for r in ranks]
    if "failed" in statuses:
        return "failed"
    if any(r["stalled"] for r in ranks):
        return "stalled"
    if all(s == "finished" for s in statuses):
        return "finished"
    active = [s for s in statuses if s in run_files.ACTIVE_STATUSES]
    if not active:
        return "stopped" if "stopped" in statuses else ("finished" if "finished" in statuses else "starting")
    for candidate in ("training", "loading", "starting"):
        if candidate in active:
            return candidate
    return "starting"


def _values(ranks: Iterable[dict], key: str) -> list[float]:
    return [r[key] for r in ranks if isinstance(r.get(key), (int, float)) and not isinstance(r.get(key), bool)]


def _aggregate(ranks: list[dict], status: str, now: float) -> dict:
    if not ranks:
        return {"step": None, "total_steps": None, "progress": None, "elapsed_s": None, "eta_s": None,
                "samples_per_s": None, "loss": None, "started_at": None, "updated_at": None}
    steps = _values(ranks, "step")
    totals = _values(ranks, "total_steps")
    total = max(totals) if totals else None
    progresses = []
    for r in ranks:
        p = r.get("progress")
        if p is None and r.get("step") is not None and r.get("total_steps"):
            p = 100.0 * r["step"] / r["total_steps"]
        if p is not None:
            progresses.append(min(100.0, max(0.0, p)))
    progress = 100.0 if status == "finished" else (min(progresses) if progresses else None)
    active = [r for r in ranks if r.get("status") in run_files.ACTIVE_STATUSES]
    etas = []
    for r in active:
        eta = r.get("eta_s")
        if eta is None and r.get("total_steps") is not None and r.get("step") is not None \
                and r.get("median_step_time_s"):
            eta = max(0, r["total_steps"] - r["step"]) * r["median_step_time_s"]
        if eta is not None:
            etas.append(max(0.0, eta))
    if status == "finished":
        eta_s = 0.0
    elif status in ("failed", "stopped"):
        eta_s = None
    else:
        eta_s = max(etas) if etas else None
    started = _values(ranks, "started_at")
    if active and started:
        elapsed = max(0.0, now - min(started))
    else:
        elapsed_values = _values(ranks, "elapsed_s")
        elapsed = max(elapsed_values) if elapsed_values else None
    rates = [r["samples_per_s"] for r in ranks
             if r.get("status") == "training" and isinstance(r.get("samples_per_s"), float)]
    losses = _values(ranks, "loss")
    updated = _values(ranks, "updated_at")
    return {
        "step": int(min(steps)) if steps else None,
        "total_steps": int(total) if total is not None else None,
        "progress": None if progress is None else round(progress, 3),
        "elapsed_s": None if elapsed is None else round(elapsed, 3),
        "eta_s": None if eta_s is None else round(eta_s, 3),
        "samples_per_s": round(sum(rates), 6) if rates else None,
        "loss": sum(losses) / len(losses) if losses else None,
        "started_at": min(started) if started else None,
        "updated_at": max(updated) if updated else None,
    }
