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


class RankStatusWriter:
    MAX_PENDING_HISTORY = 100_000   # history lines kept in memory while the log folder cannot be written

    def __init__(self, log_dir: str | os.PathLike, run_id: str, rank: int, local_rank: int, world_size: int,
                 min_interval_s: float = 5.0, wall_clock: Callable[[], float] = time.time,
                 monotonic: Callable[[], float] = time.monotonic, continue_history: bool = False,
                 report_every_s: float = 60.0, stream=None, keep_old_histories: int = 3,
                 kind: str = run_files.TRAINING):
        self.log_dir = Path(log_dir)
        self.kind = kind
        self._status_guard = WriteGuard(f"rank {rank}'s status file in {self.log_dir}", monotonic, report_every_s,
                                        stream)
        self._history_guard = WriteGuard(f"rank {rank}'s history file in {self.log_dir}", monotonic, report_every_s,
                                         stream)
        self._pending_history: collections.deque[str] = collections.deque()
        self.history_lines_lost = 0
        # called with every history record as it is appended (training/components/lora_health.py reads the steps)
        self.history_listeners: list[Callable[[dict], None]] = []
        self._status_guard.run(lambda: self.log_dir.mkdir(parents=True, exist_ok=True))
        self._stream = stream
        self._folder = LogFolderWatch(self.log_dir)
        self._rank = rank
        self.status_file = run_layout.status_path(self.log_dir, rank)
        self.history_file = run_layout.history_path(self.log_dir, rank)
        self.min_interval_s = min_interval_s
        self._wall_clock = wall_clock
        self._monotonic = monotonic
        self._last_write = None
        self._started_monotonic = monotonic()
        self.elapsed_before_s = 0.0     # a resumed run's training time before its checkpoint
        self._history = HistoryAppender(self.history_file)
        self.keep_old_histories = keep_old_histories
        self.gpu_reader: Callable[[], dict | None] | None = None
        self._lock = threading.RLock()       # the main thread, the heartbeat and the stop-signal thread write
        self._waits: dict[int, tuple[str, float, float]] = {}   # token -> (what, since wall, since monotonic)
        self._wait_tokens = 0
        self._heartbeat: threading.Thread | None = None
        self._closed = threading.Event()
        if not continue_history:
            self._history_guard.run(self._set_aside_previous_history)
        self.state = {field: None for field in run_files.fields_in_every_file(kind)}
        self.state.update(
            schema_version=run_files.SCHEMA_VERSION, run_id=run_id, rank=rank, local_rank=local_rank,
            world_size=world_size, hostname=socket.gethostname(), pid=os.getpid(),
            status=run_files.STATUS_STARTING, phase="starting", step=0, samples_seen=0, progress=0.0,
            started_at=wall_clock(), elapsed_s=0.0,
        )
        self._write()

    # -- the current state ------------------------------------------------------------------
    def update(self, **fields) -> None:
        """Merge fields; write now if the status changed or enough time passed since the last write. A field the
        schema does not declare for this kind of file, or a value of another type, raises ``StatusFieldError``."""
        run_files.check_status_fields(fields, self.kind)
        with self._lock:
            status_changed = "status" in fields and fields["status"] != self.state["status"]
            phase_changed = "phase" in fields and fields["phase"] != self.state["phase"]
            self.state.update(fields)
            if status_changed or phase_changed or self.write_due():
                self._write()

    def write_due(self) -> bool:
        """Whether the next update() rewrites the file even without a status change (the throttle)."""
        return self._last_write is None or self._monotonic() - self._last_write >= self.min_interval_s

    def set_status(self, status: str, phase: str | None = None, **fields) -> None:
        if status not in run_files.STATUSES:
            raise ValueError(f"unknown status {status!r}")
        self.update(status=status, phase=phase if phase is not None else status, **fields)

    def fail(self, exc: BaseException) -> None:
        self.set_status(run_files.STATUS_FAILED, phase=f"failed: {type(exc).__name__}", error=error_record(exc))

    def flush(self) -> None:
        with self._lock:
            self._write()

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
        with self._lock:
            self._wait_tokens += 1
            self._waits[self._wait_tokens] = (what, self._wall_clock(), self._monotonic())
            if self._heartbeat is None:
                self._heartbeat = threading.Thread(target=self._beat, name="status-heartbeat", daemon=True)
                self._heartbeat.start()
            return self._wait_tokens

    def end_wait(self, token: int) -> None:
        with self._lock:
            self._waits.pop(token, None)
            if not self._waits and self.state.get("waiting") is not None:
                self.state["waiting"] = None
                self._write()   # the file said it waited: say at once that it no longer does

    def _beat(self) -> None:
        """While a wait lasts longer than the write interval, rewrite the file with what the rank waits for."""
        period = max(0.1, min(1.0, self.min_interval_s / 2))
        while not self._closed.wait(period):
            with self._lock:
                if not self._waits:
                    continue
                what, since, started = min(self._waits.values(), key=lambda wait: wait[2])
                if self._monotonic() - started < self.min_interval_s:
                    continue   # a wait of the usual length: nothing worth a write
                self.state["waiting"] = {"for": what, "since": since}
                if self.write_due():
                    self._write()

    @property
    def write_failures(self) -> int:
        return self._status_guard.failures + self._history_guard.failures

    def _write(self) -> None:
        self.state["updated_at"] = self._wall_clock()
        self.state["elapsed_s"] = round(self.elapsed_before_s + self._monotonic() - self._started_monotonic, 3)
        self._last_write = self._monotonic()
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
        self._history_guard.run(self._write_pending_history)   # reopens the history there at once
        self._warn(f"the log folder {self.log_dir} was deleted or replaced during the run; rank {self.state['rank']} "
                   f"writes its status and history in the new one; {lock}")

    def _warn(self, message: str) -> None:
        print(f"warning: {message}", file=self._stream or sys.stderr, flush=True)

    def _read_gpu(self) -> None:
        """Fresh GPU fields for the write about to happen. Not from the stop-signal thread, which may write while
        the main thread is inside a CUDA call or a collective: there the previous reading stays."""
        if self.gpu_reader is not None and threading.current_thread() is threading.main_thread():
            self.state["gpu"] = self.gpu_reader()

    # -- the per-step history ---------------------------------------------------------------
    def append_history(self, record: dict) -> None:
        """One line per record, in order. While the folder cannot be written, lines wait in memory (bounded)."""
        for listener in self.history_listeners:
            listener(record)
        if len(self._pending_history) >= self.MAX_PENDING_HISTORY:
            self._pending_history.popleft()
            self.history_lines_lost += 1
        self._pending_history.append(json.dumps(record, ensure_ascii=False) + "\n")
        if self._history_guard.due():
            self._history_guard.run(self._write_pending_history)

    def _write_pending_history(self) -> None:
        self._history.write_lines(self._pending_history)
        if self._history.replaced:
            self._warn(f"rank {self.state['rank']}'s history {self._history.replaced}")
            self._history.replaced = None

    def _set_aside_previous_history(self) -> None:
        """A new run starts a new history; the previous one is kept beside it, never overwritten."""
        if self.history_file.exists() and self.history_file.stat().st_size > 0:
            stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(self.history_file.stat().st_mtime))
            target = self.history_file.with_name(run_layout.old_history_name(self._rank, stamp))
            suffix = 1
            while target.exists():
                target = self.history_file.with_name(run_layout.old_history_name(self._rank, f"{stamp}-{suffix}"))
                suffix += 1
            os.replace(self.history_file, target)
        self._prune_old_histories()

    def _prune_old_histories(self) -> None:
        """Only the newest ``keep_old_histories`` set-aside histories of this rank stay (they once piled up)."""
        old = sorted(self.history_file.parent.glob(run_layout.old_histories_glob(self._rank)),
                     key=lambda path: path.stat().st_mtime_ns)
        for path in old[:max(0, len(old) - self.keep_old_histories)]:
            path.unlink(missing_ok=True)

    def close(self) -> None:
        self._closed.set()
        if self._pending_history:
            self._history_guard.run(self._write_pending_history)
        self._history.close()
        self._folder.close()
