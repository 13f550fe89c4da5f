"""Reading a rank's JSONL history incrementally: only new bytes, bounded memory, a byte-offset index.

Feeds ``Series`` for drawing and serves raw records after a step (``read_history_window``). A long history
can be read tail first (``tail_first_above``): its last ``TAIL_BYTES`` give the recent step times at once,
a few lines sampled across the file the loss trend, and the whole file is read later (``monitor.backfill``).
"""

from __future__ import annotations

import bisect
import json
import math
import os
import statistics
from collections import deque
from pathlib import Path
from typing import Any

from diffsynth_mbc import run_files
from diffsynth_mbc.monitor.buckets import BucketLosses
from diffsynth_mbc.monitor.health import HealthRecords
from diffsynth_mbc.monitor.modes import ModeLosses
from diffsynth_mbc.monitor.series import MAX_POINTS, TREND_POINTS, Series
from diffsynth_mbc.monitor.status import json_safe, open_regular, to_float
from diffsynth_mbc.monitor.timestep_bins import LossByTimestep
from diffsynth_mbc.monitor.validation import ValidationQuantiles

INDEX_EVERY = 512  # JSONL lines between two entries of the byte-offset index
READ_CHUNK = 4 << 20
MAX_LINE_BYTES = 1 << 20  # a "line" longer than this without a newline is garbage, skipped
RECENT_STEP_TIMES = 101
MAX_EPOCH_MARKS = 1000  # epoch boundaries remembered for the charts
TAIL_FIRST_ABOVE = 8 << 20   # a history larger than this is first read from its tail (about 60,000 steps)
TAIL_BYTES = 256 << 10       # the tail read first: about 2,000 steps
SAMPLE_BYTES = 8 << 10       # read at each point of the sampled loss trend
DRAWN_SERIES = ("loss", "lr", "grad_norm", "step_time_s", "samples_per_s")  # per training record


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

    __slots__ = ("xs", "ys", "step_times")

    def __init__(self):
        self.xs: dict[str, list] = {name: [] for name in DRAWN_SERIES}
        self.ys: dict[str, list] = {name: [] for name in DRAWN_SERIES}
        self.step_times: list = []

    def add(self, name: str, x, y) -> None:
        self.xs[name].append(x)
        self.ys[name].append(y)


class HistoryFile:
    """One rank's ``training_gpu{rank}.jsonl``, read incrementally.

    Remembers the file's identity (device, inode) and how many bytes were consumed; each
    ``poll`` reads only what was appended. A file that shrank or whose inode changed is read
    again from the start. A last line without its newline is left for the next poll (torn
    line). Keeps bounded down-sampled series, the recent step times and a sparse index of
    byte offsets (one per ``INDEX_EVERY`` lines, with the largest step seen before it) so that
    a window of raw records can be read without scanning the whole file.

    With ``tail_first_above``, a file larger than that is read from its last ``tail_bytes`` on the
    first poll: ``complete`` is then False, ``head_bytes`` are left unread, the series and counts cover
    the tail only and ``sampled_trend`` is the loss across the whole file from lines sampled in it.
    """

    def __init__(self, path: str | Path, max_points: int = MAX_POINTS, index_every: int = INDEX_EVERY,
                 tail_first_above: int | None = None, tail_bytes: int = TAIL_BYTES):
        self.path = Path(path)
        self.max_points = max_points
        self.index_every = max(1, int(index_every))
        self.tail_first_above = tail_first_above
        self.tail_bytes = tail_bytes
        self.rereads = 0
        self._reset()

    def _reset(self) -> None:
        self.ident: tuple[int, int] | None = None
        self.offset = 0  # bytes consumed, always at a line boundary
        self.head_bytes = 0   # bytes before the first one read (tail first); 0: read from the start
        self.first_step: float | None = None   # step of the first record read
        self.sampled_trend: list[float] = []
        self.lines = 0
        self.records = 0
        self.bad_lines = 0
        self.last_bad_line: int | None = None
        self.torn = False
        self.skipped_bytes = 0
        self.index_keys: list[float] = []  # largest step before the entry (non-decreasing)
        self.index_offsets: list[int] = []
        self._prefix_max = -math.inf
        self.series = {name: Series(self.max_points) for name in DRAWN_SERIES}
        self.loss = self.series["loss"]
        self.lr = self.series["lr"]
        self.val_loss = Series(self.max_points)
        self.val_loss_ema = Series(self.max_points)   # the EMA of the LoRA's (--validate_with both)
        self.validation = ValidationQuantiles(self.max_points)   # per timestep quantile, the gain over the base
        self.health = HealthRecords()   # the LoRA's health records (update norm per block)
        self.by_timestep = LossByTimestep()   # training loss per timestep bin, EMA over the run
        self.modes = ModeLosses(self.max_points)   # loss per mode (t2i, i2v, t2v): steps, bins, validation
        self.buckets = BucketLosses()   # samples and loss per shape bucket over the run
        self.epoch_marks: list[tuple[float, int]] = []  # (first step seen of an epoch, epoch)
        self._last_epoch: int | None = None
        self.step_times: deque[float] = deque(maxlen=RECENT_STEP_TIMES)
        self.last_step: float | None = None
        self.last_time: float | None = None

    @property
    def complete(self) -> bool:
        return self.head_bytes == 0

    def median_step_time(self) -> float | None:
        return statistics.median(self.step_times) if self.step_times else None

    def poll(self) -> bool:
        """Read what was appended since the last poll. True when something new was read."""
        try:
            handle = open_regular(self.path)
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
            if self.lines == 0 and self.tail_first_above is not None and st.st_size > self.tail_first_above:
                self._start_at_tail(handle, st.st_size)
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

    def _start_at_tail(self, handle, size: int) -> None:
        """Skip to the first line that starts in the last ``tail_bytes``; sample the loss across the file."""
        start = size - self.tail_bytes
        if start <= 0:
            return
        handle.seek(start - 1)
        handle.readline()   # past the end of the line that holds byte start - 1
        self.offset = self.head_bytes = handle.tell()
        self.sampled_trend = sample_loss_trend(handle, size)

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
            if len(line) > MAX_LINE_BYTES:   # a record over the cap is bad data, never decoded
                self._bad()
                continue
            try:
                record = decode(line.decode("utf-8"))
            except (ValueError, UnicodeDecodeError, RecursionError):   # RecursionError: absurdly deep nesting
                if line.strip():
                    self._bad()
                continue
            if type(record) is not dict:
                self._bad()
                continue
            self._add(record, batch)
        self.offset = offset + end
        for name, series in self.series.items():
            series.extend(batch.xs[name], batch.ys[name])
        self.modes.flush()
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
        if self.first_step is None:
            self.first_step = step
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
            val_ema = _fast_float(get("val_loss_ema"))
            if val_ema is not None:
                self.val_loss_ema.add(step, val_ema)
            self.validation.add(step, record, val)
            self.modes.add_validation(step, get("val_loss_by_mode"))
            return
        if kind is not None:   # a line that is no training step (overhead, samples, lora_health): no step's figures
            if kind == run_files.HEALTH_RECORD:
                self.health.add(step, record)
            return
        if val is not None:
            self.val_loss.add(step, val)
        self.last_step = step
        for name in ("loss", "lr", "grad_norm"):
            value = _fast_float(get(name))
            if value is not None:
                batch.add(name, step, value)
        step_time = _fast_float(get("step_time_s"))
        if step_time is not None and step_time >= 0:
            batch.step_times.append(step_time)
            batch.add("step_time_s", step, step_time)
            samples = _fast_float(get("samples"))
            if samples is not None and step_time > 0:
                batch.add("samples_per_s", step, samples / step_time)
        drawn = get("timesteps")
        if drawn is not None:
            self.by_timestep.add(drawn, get("timestep_losses"))
        modes = get("modes")
        if modes is not None:
            self.modes.add(step, modes, drawn, get("timestep_losses"))
        shapes = get("shapes")
        if shapes is not None:
            self.buckets.add(shapes, get("timestep_losses"), drawn, modes)
        epoch = get("epoch")
        if type(epoch) is int and epoch != self._last_epoch:
            self._mark_epoch(step, epoch)

    def _mark_epoch(self, step: float, epoch: int) -> None:
        """Remember where an epoch starts (the first record seen with a new epoch number)."""
        if self._last_epoch is not None and len(self.epoch_marks) < MAX_EPOCH_MARKS:
            self.epoch_marks.append((step, epoch))
        self._last_epoch = epoch

    def seek_point(self, since: float | None) -> tuple[tuple[int, int] | None, int, int]:
        """(file identity, byte offset to start reading from, bytes known to be complete)."""
        if since is None or not self.index_keys:
            return self.ident, 0, self.offset
        if not self.complete and (self.first_step is None or since < self.first_step):
            return self.ident, 0, self.offset   # the records wanted begin in the part not read yet
        i = bisect.bisect_right(self.index_keys, since) - 1
        return self.ident, (self.index_offsets[i] if i >= 0 else 0), self.offset

    def notes(self, resumed: dict | None = None) -> list[str]:
        """What is odd about the file; ``resumed``: the rank's status ``resumed_from`` (a resumed run cuts its
        history back to the checkpoint's step, which reads as a truncation: said as the resume it is)."""
        name = self.path.name
        out = []
        if self.bad_lines:
            out.append(f"{name}: skipped {self.bad_lines} unreadable line(s) (last at line {self.last_bad_line})")
        if self.torn:
            out.append(f"{name}: last line incomplete, waiting for the rest")
        if self.skipped_bytes:
            out.append(f"{name}: skipped {self.skipped_bytes} bytes without line breaks")
        step = resumed.get("step") if isinstance(resumed, dict) else None
        if self.rereads and isinstance(step, int) and not isinstance(step, bool):
            out.append(f"{name}: resumed at step {step} (the history was cut back to it and read again)")
        elif self.rereads:
            out.append(f"{name}: file was replaced or truncated {self.rereads} time(s); read again from the start")
        return out


def sample_loss_trend(handle, size: int, points: int = TREND_POINTS) -> list[float]:
    """The training loss across a history without reading it all: the mean loss of the lines in
    ``SAMPLE_BYTES`` at the middle of each of ``points`` equal parts of the file."""
    trend = []
    for i in range(points):
        start = size * (2 * i + 1) // (2 * points)
        handle.seek(start)
        chunk = handle.read(SAMPLE_BYTES)
        lines = chunk.split(b"\n")[1:-1]   # the first is cut, the last may be torn
        losses = []
        for line in lines:
            try:
                record = json.loads(line)
            except (ValueError, RecursionError):
                continue
            loss = _fast_float(record.get("loss")) if type(record) is dict and record.get("kind") is None else None
            if loss is not None:
                losses.append(loss)
        if losses:
            trend.append(float(f"{sum(losses) / len(losses):.6g}"))
    return trend


def read_history_window(path: Path, ident: tuple[int, int] | None, start: int, since: float | None,
                        limit: int) -> tuple[list[dict], bool]:
    """Raw JSONL records with step > since, in file order, from byte ``start``; at most ``limit``.

    Returns (records, truncated). Falls back to the start of the file when the file is no
    longer the one the offset was taken from.
    """
    records: list[dict] = []
    try:
        handle = open_regular(path)
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
        while True:
            line = handle.readline(MAX_LINE_BYTES + 1)   # never more than the cap in memory
            if len(line) > MAX_LINE_BYTES and not line.endswith(b"\n"):
                if not _skip_rest_of_line(handle):   # an oversized record: skip to its end, then go on
                    break
                continue
            if not line.endswith(b"\n"):
                break  # torn last line, or the end
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except (ValueError, RecursionError):
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


def _skip_rest_of_line(handle) -> bool:
    """Read past the next newline in chunks; False if the file ends first (an unterminated tail)."""
    while True:
        chunk = handle.readline(READ_CHUNK)
        if not chunk:
            return False
        if chunk.endswith(b"\n"):
            return True
