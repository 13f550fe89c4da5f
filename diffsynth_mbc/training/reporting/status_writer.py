"""Per-rank status and history files, written from the first moment of the process. No torch.

``RankStatusWriter`` owns ``training_gpu{rank}.json`` (the current state, replaced atomically, at
most every ``min_interval_s`` seconds and at once on every status change) and
``training_gpu{rank}.jsonl`` (one appended, flushed line per optimizer step). The cost of a step is
constant however long the run: the JSON file is small and rewritten, the history only appended. Every field
written is one ``run_files.STATUS_SCHEMA`` declares for this kind of file (a training rank's, or a cache rank's:
``kind``), with its type: ``update`` refuses any other (``StatusFieldError``, a programming error). Once
torch is up, ``gpu_reader`` (``gpu.GpuReader``) is asked for the ``gpu`` fields right before each write
of the status file (NVML and the allocator are queried only then), from the main thread only.

While the main thread waits for the other ranks (``with writer.waiting("ranks in all-reduce (step agreement)")``
around a collective), a heartbeat thread keeps the file fresh once the wait outlasts ``min_interval_s``, with
``waiting = {"for": ..., "since": T}``: a rank that stops (SIGSTOP, a hung process) goes stale while the ranks
waiting for it stay fresh and say what they wait for, so the monitor calls only the silent one stalled.
"""

from __future__ import annotations

import collections
import contextlib
import json
import os
import socket
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Callable

from diffsynth_mbc import run_files, run_layout
from diffsynth_mbc.atomic import write_json_even_when_full
from diffsynth_mbc.training.reporting.history_appender import HistoryAppender
from diffsynth_mbc.training.reporting.log_folder import LogFolderWatch


def error_record(exc: BaseException, tail_lines: int = 30) -> dict:
    lines = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__)).splitlines()
    return {"type": type(exc).__name__, "message": str(exc), "traceback_tail": "\n".join(lines[-tail_lines:])}


class WriteGuard:
    """Monitoring never kills training: a failed status or history write is counted, reported on stderr at
    most once per ``report_every_s``, and retried after a back-off (1 s doubling to 60 s)."""

    def __init__(self, what: str, monotonic: Callable[[], float], report_every_s: float = 60.0, stream=None):
        self.what = what
        self.failures = 0
        self._monotonic = monotonic
        self._report_every_s = report_every_s
        self._stream = stream
        self._retry_at = None
        self._backoff_s = 1.0
        self._last_report = None
        self._unreported = 0

    def due(self) -> bool:
        return self._retry_at is None or self._monotonic() >= self._retry_at

    def warn(self, message: str) -> None:
        print(f"warning: {message}", file=self._stream or sys.stderr, flush=True)

    def run(self, write: Callable[[], None]) -> bool:
        """Call ``write``; True if it succeeded. OSError is absorbed (counted, reported, retried later)."""
        try:
            write()
        except OSError as exc:
            self.failures += 1
            self._unreported += 1
            now = self._monotonic()
            self._retry_at = now + self._backoff_s
            self._backoff_s = min(self._backoff_s * 2, 60.0)
            if self._last_report is None or now - self._last_report >= self._report_every_s:
                print(f"warning: cannot write {self.what} ({self._unreported} failed write(s) since the last "
                      f"report, {self.failures} in all; last: {type(exc).__name__}: {exc}); training goes on, "
                      f"retrying", file=self._stream or sys.stderr, flush=True)
                self._last_report, self._unreported = now, 0
            return False
        if self._retry_at is not None:
            print(f"note: {self.what} written again after {self.failures} failed write(s)",
                  file=self._stream or sys.stderr, flush=True)
        self._retry_at, self._backoff_s = None, 1.0
        return True


class RankHistory:
    """A rank's ``training_gpu{rank}.jsonl``: one appended line per record, in order; while the folder cannot be
    written, lines wait in memory (bounded). A new run sets the previous history aside (``keep`` of them stay)."""

    MAX_PENDING = 100_000   # history lines kept in memory while the log folder cannot be written

    def __init__(self, log_dir: Path, rank: int, guard: WriteGuard, keep: int, continue_history: bool):
        self.path = run_layout.history_path(log_dir, rank)
        self.rank, self.guard, self.keep = rank, guard, keep
        self.pending: collections.deque[str] = collections.deque()
        self.lines_lost = 0
        # called with every record as it is appended (training/components/lora_health.py reads the steps)
        self.listeners: list[Callable[[dict], None]] = []
        self.appender = HistoryAppender(self.path)
        if not continue_history:
            self.guard.run(self.set_aside_previous)

    def append(self, record: dict) -> None:
        for listener in self.listeners:
            listener(record)
        if len(self.pending) >= self.MAX_PENDING:
            self.pending.popleft()
            self.lines_lost += 1
        self.pending.append(json.dumps(record, ensure_ascii=False) + "\n")
        if self.guard.due():
            self.guard.run(self.write_pending)

    def write_pending(self) -> None:
        self.appender.write_lines(self.pending)
        if self.appender.replaced:
            self.guard.warn(f"rank {self.rank}'s history {self.appender.replaced}")
            self.appender.replaced = None

    def set_aside_previous(self) -> None:
        """A new run starts a new history; the previous one is kept beside it, never overwritten."""
        if self.path.exists() and self.path.stat().st_size > 0:
            stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(self.path.stat().st_mtime))
            target = self.path.with_name(run_layout.old_history_name(self.rank, stamp))
            suffix = 1
            while target.exists():
                target = self.path.with_name(run_layout.old_history_name(self.rank, f"{stamp}-{suffix}"))
                suffix += 1
            os.replace(self.path, target)
        self.prune_old()

    def prune_old(self) -> None:
        """Only the newest ``keep`` set-aside histories of this rank stay (they once piled up)."""
        old = sorted(self.path.parent.glob(run_layout.old_histories_glob(self.rank)),
                     key=lambda path: path.stat().st_mtime_ns)
        for path in old[:max(0, len(old) - self.keep)]:
            path.unlink(missing_ok=True)

    def close(self) -> None:
        if self.pending:
            self.guard.run(self.write_pending)
        self.appender.close()


class Waits:
    """What a rank waits for in a collective, and the heartbeat that says it: while a wait lasts longer than the
    write interval, ``beat`` (every ``period``) rewrites the status file with ``{"for": ..., "since": ...}``."""

    def __init__(self, writer: "RankStatusWriter"):
        self.writer = writer
        self.open: dict[int, tuple[str, float, float]] = {}   # token -> (what, since wall, since monotonic)
        self.tokens = 0
        self.heartbeat: threading.Thread | None = None
        self.closed = threading.Event()

    def begin(self, what: str) -> int:
        writer = self.writer
        with writer.lock:
            self.tokens += 1
            self.open[self.tokens] = (what, writer.wall_clock(), writer.monotonic())
            if self.heartbeat is None:
                self.heartbeat = threading.Thread(target=self.beat, name="status-heartbeat", daemon=True)
                self.heartbeat.start()
            return self.tokens

    def end(self, token: int) -> None:
        writer = self.writer
        with writer.lock:
            self.open.pop(token, None)
            if not self.open and writer.state.get("waiting") is not None:
                writer.state["waiting"] = None
                writer.write()   # the file said it waited: say at once that it no longer does

    def beat(self) -> None:
        writer = self.writer
        period = max(0.1, min(1.0, writer.min_interval_s / 2))
        while not self.closed.wait(period):
            with writer.lock:
                if not self.open:
                    continue
                what, since, started = min(self.open.values(), key=lambda wait: wait[2])
                if writer.monotonic() - started < writer.min_interval_s:
                    continue   # a wait of the usual length: nothing worth a write
                writer.state["waiting"] = {"for": what, "since": since}
                if writer.write_due():
                    writer.write()


class RankStatusWriter:
    def __init__(self, log_dir: str | os.PathLike, run_id: str, rank: int, local_rank: int, world_size: int,
                 min_interval_s: float = 5.0, wall_clock: Callable[[], float] = time.time,
                 monotonic: Callable[[], float] = time.monotonic, continue_history: bool = False,
                 report_every_s: float = 60.0, stream=None, keep_old_histories: int = 3,
                 kind: str = run_files.TRAINING):
        self.log_dir = Path(log_dir)
        self.kind = kind
        self._status_guard = WriteGuard(f"rank {rank}'s status file in {self.log_dir}", monotonic, report_every_s,
                                        stream)
        self._status_guard.run(lambda: self.log_dir.mkdir(parents=True, exist_ok=True))
        self.history = RankHistory(self.log_dir, rank, WriteGuard(f"rank {rank}'s history file in {self.log_dir}",
                                                                  monotonic, report_every_s, stream),
                                   keep_old_histories, continue_history)
        self._folder = LogFolderWatch(self.log_dir)
        self.min_interval_s = min_interval_s
        self.wall_clock, self.monotonic = wall_clock, monotonic
        self._last_write = None
        self._started_monotonic = monotonic()
        self.elapsed_before_s = 0.0     # a resumed run's training time before its checkpoint
        self.gpu_reader: Callable[[], dict | None] | None = None
        self.lock = threading.RLock()       # the main thread, the heartbeat and the stop-signal thread write
        self.waits = Waits(self)
        self.state = {field: None for field in run_files.fields_in_every_file(kind)}
        self.state.update(
            schema_version=run_files.SCHEMA_VERSION, run_id=run_id, rank=rank, local_rank=local_rank,
            world_size=world_size, hostname=socket.gethostname(), pid=os.getpid(),
            status=run_files.STATUS_STARTING, phase="starting", step=0, samples_seen=0, progress=0.0,
            started_at=wall_clock(), elapsed_s=0.0,
        )
        self.write()

    @property
    def status_file(self) -> Path:
        return run_layout.status_path(self.log_dir, self.state["rank"])

    @property
    def history_file(self) -> Path:
        return self.history.path

    @property
    def history_listeners(self) -> list[Callable[[dict], None]]:
        return self.history.listeners

    # -- the current state ------------------------------------------------------------------
    def update(self, **fields) -> None:
        """Merge fields; write now if the status changed or enough time passed since the last write. A field the
        schema does not declare for this kind of file, or a value of another type, raises ``StatusFieldError``."""
        run_files.check_status_fields(fields, self.kind)
        with self.lock:
            status_changed = "status" in fields and fields["status"] != self.state["status"]
            phase_changed = "phase" in fields and fields["phase"] != self.state["phase"]
            self.state.update(fields)
            if status_changed or phase_changed or self.write_due():
                self.write()

    def write_due(self) -> bool:
        """Whether the next update() rewrites the file even without a status change (the throttle)."""
        return self._last_write is None or self.monotonic() - self._last_write >= self.min_interval_s

    def set_status(self, status: str, phase: str | None = None, **fields) -> None:
        if status not in run_files.STATUSES:
            raise ValueError(f"unknown status {status!r}")
        self.update(status=status, phase=phase if phase is not None else status, **fields)

    def fail(self, exc: BaseException) -> None:
        self.set_status(run_files.STATUS_FAILED, phase=f"failed: {type(exc).__name__}", error=error_record(exc))

    def flush(self) -> None:
        with self.lock:
            self.write()

    # -- waiting for the other ranks --------------------------------------------------------
    @contextlib.contextmanager
    def waiting(self, what: str):
        """Around a collective: ``what`` the rank waits for ("ranks in all-reduce (step agreement)")."""
        token = self.begin_wait(what)
        try:
            yield
        finally:
            self.end_wait(token)

    def begin_wait(self, what: str) -> int:
        """A wait that may end on another thread (a collective's completion callback); returns its token."""
        return self.waits.begin(what)

    def end_wait(self, token: int) -> None:
        self.waits.end(token)

    @property
    def write_failures(self) -> int:
        return self._status_guard.failures + self.history.guard.failures

    def write(self) -> None:
        self.state["updated_at"] = self.wall_clock()
        self.state["elapsed_s"] = round(self.elapsed_before_s + self.monotonic() - self._started_monotonic, 3)
        self._last_write = self.monotonic()
        if self.write_failures:
            self.state["write_failures"] = self.write_failures
        is_final = self.state["status"] in run_files.TERMINAL_STATUSES
        if is_final or self._status_guard.due():
            self._read_gpu()
            self._status_guard.run(lambda: write_json_even_when_full(self.status_file, self.state))
        if self._folder.replaced():
            self._folder_replaced()

    def _folder_replaced(self) -> None:
        """The log folder was deleted (and recreated by the write above) or replaced: the history goes on in the
        new one, the run's lock is taken there again, and the rank says so."""
        lock = self._folder.retake_lock()
        self.history.guard.run(self.history.write_pending)   # reopens the history there at once
        self._status_guard.warn(f"the log folder {self.log_dir} was deleted or replaced during the run; rank {self.state['rank']} "
                   f"writes its status and history in the new one; {lock}")

    def _read_gpu(self) -> None:
        """Fresh GPU fields for the write about to happen. Not from the stop-signal thread, which may write while
        the main thread is inside a CUDA call or a collective: there the previous reading stays."""
        if self.gpu_reader is not None and threading.current_thread() is threading.main_thread():
            self.state["gpu"] = self.gpu_reader()

    # -- the per-step history ---------------------------------------------------------------
    def append_history(self, record: dict) -> None:
        """One line per record, in order (``RankHistory``)."""
        self.history.append(record)

    def close(self) -> None:
        self.waits.closed.set()
        self.history.close()
        self._folder.close()
