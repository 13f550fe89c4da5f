"""Ctrl-C and SIGTERM, seen even while the main thread is stuck inside a collective or a C call.

A Python signal handler only runs when the main thread returns to the interpreter, which a rank
blocked in an NCCL/gloo all-reduce never does. So SIGINT/SIGTERM are blocked in the main thread and
received by a small thread with ``sigwait``. It interrupts the main thread (KeyboardInterrupt); if
the main thread has not finished within ``grace_s`` it calls ``on_stuck`` (which records the stop)
and exits the process. A second signal exits at once.
"""

from __future__ import annotations

import _thread
import os
import signal
import threading
from typing import Callable

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class StopSignals:
    def __init__(self, on_stuck: Callable[[int], None], grace_s: float = 15.0):
        self.on_stuck = on_stuck
        self.grace_s = grace_s
        self.received: int | None = None
        self._finished = threading.Event()
        self._thread: threading.Thread | None = None

    def install(self) -> "StopSignals":
        """Call from the main thread before other threads start (they inherit the blocked mask)."""
        signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
        self._thread = threading.Thread(target=self._wait, name="stop-signals", daemon=True)
        self._thread.start()
        return self

    def finished(self) -> None:
        """The main thread has recorded the outcome; no forced exit is needed."""
        self._finished.set()

    @property
    def exit_code(self) -> int:
        return 128 + (self.received or signal.SIGINT)

    def _wait(self) -> None:
        self.received = signal.sigwait(STOP_SIGNALS)
        _thread.interrupt_main(signal.SIGINT)
        second = _SecondSignal()
        second.start()
        if self._finished.wait(self.grace_s):
            return
        self.on_stuck(self.received)
        os._exit(self.exit_code)


class _SecondSignal(threading.Thread):
    def __init__(self):
        super().__init__(name="stop-signals-second", daemon=True)

    def run(self) -> None:
        received = signal.sigwait(STOP_SIGNALS)
        os._exit(128 + received)


def unblock_in_child(*_args) -> None:
    """worker_init_fn for data-loader workers: they must die on SIGTERM like any process."""
    signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)
