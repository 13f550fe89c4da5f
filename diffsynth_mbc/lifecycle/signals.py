"""Ctrl-C, SIGTERM and SIGHUP, seen even while the main thread is stuck inside a collective or a C call.

A Python signal handler only runs when the main thread returns to the interpreter, which a rank
blocked in an NCCL/gloo all-reduce never does. So the stop signals (``STOP_SIGNALS``, the one table, which the
supervisor uses too) are blocked in the main thread and
received by a small thread with ``sigwait``:

- while ``graceful`` is off (loading models, preparing), the main thread is interrupted at once
  (KeyboardInterrupt);
- while ``graceful`` is on (the training loop), ``requested`` is set; the loop finishes its step,
  agrees with the other ranks, saves a checkpoint and stops. If that takes longer than
  ``grace_s``, the main thread is interrupted.

Either way, if the main thread has not finished ``hard_grace_s`` after being interrupted, the
thread calls ``on_stuck`` (which records the stop) and exits the process.

A repeated stop request is the same request: another SIGTERM (two ``stop.sh`` at once, a supervisor
passing on a stop while ``stop.sh`` sends its own) changes nothing, so the step still finishes and the
checkpoint is still written. Only a second SIGINT, a person's second Ctrl-C (the supervisor passes that
on as SIGINT), records the stop and exits at once.

``request(reason)`` asks for the same stop from inside the process (a rank whose launcher died): it
names the reason and sends the process SIGTERM, so every path above applies unchanged.
"""

from __future__ import annotations

import _thread
import os
import signal
import threading
from typing import Callable

# Each asks a run to stop as Ctrl-C does (finish the step, checkpoint, write 'stopped'): in the supervisor and in
# every rank. SIGHUP is the launcher's terminal closing.
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
NOW_SIGNAL = signal.SIGINT   # after a stop was requested: stop now (a person's second Ctrl-C)


class StopSignals:
    def __init__(self, on_stuck: Callable[[int], None], grace_s: float = 300.0, hard_grace_s: float = 15.0):
        self.on_stuck = on_stuck
        self.grace_s = grace_s
        self.hard_grace_s = hard_grace_s
        self.graceful = False
        self.received: int | None = None
        self.reason: str | None = None
        self.requested = threading.Event()
        self.repeated = 0   # stop requests received again after the first (ignored)
        self._finished = threading.Event()

    def install(self) -> "StopSignals":
        """Call from the main thread before other threads start (they inherit the blocked mask)."""
        self._previous_mask = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
        threading.Thread(target=self._wait, name="stop-signals", daemon=True).start()
        return self

    def finished(self) -> None:
        """The main thread has recorded the outcome; no forced exit is needed. The signal mask is restored, so
        a process that goes on (``main`` called in-process) and the processes it starts receive signals again."""
        self._finished.set()
        if getattr(self, "_previous_mask", None) is not None:
            signal.pthread_sigmask(signal.SIG_SETMASK, self._previous_mask)

    def request(self, reason: str) -> None:
        """Stop as on SIGTERM, for ``reason`` (shown in the status: "stopped ... (its launcher ... ended)")."""
        if not self.requested.is_set():
            self.reason = reason
            os.kill(os.getpid(), signal.SIGTERM)

    def describe(self) -> str:
        """What asked for the stop: the reason given to ``request``, else the signal, else another rank."""
        if self.reason:
            return self.reason
        return signal.Signals(self.received).name if self.received else "made on another rank"

    @property
    def exit_code(self) -> int:
        return 128 + (self.received or signal.SIGINT)

    def _wait(self) -> None:
        self.received = signal.sigwait(STOP_SIGNALS)
        self.requested.set()
        threading.Thread(target=self._second_signal, name="stop-signals-second", daemon=True).start()
        if self.graceful and self._finished.wait(self.grace_s):
            return
        _thread.interrupt_main(signal.SIGINT)
        if self._finished.wait(self.hard_grace_s):
            return
        self._give_up(self.received)

    def _second_signal(self) -> None:
        while signal.sigwait(STOP_SIGNALS) != NOW_SIGNAL:
            self.repeated += 1   # the same request again: the stop already under way goes on
        self._give_up(NOW_SIGNAL)

    def _give_up(self, received: int) -> None:
        try:
            self.on_stuck(received)
        finally:
            os._exit(128 + received)


def unblock_in_child(*_args) -> None:
    """worker_init_fn for data-loader workers: they must die on SIGTERM like any process."""
    signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)
