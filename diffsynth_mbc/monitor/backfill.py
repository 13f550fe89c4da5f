"""Reading long histories whole in a background thread while the monitor answers from their tails.

A history read tail first (``HistoryFile.complete`` False) is handed to ``Backfill.request``. One thread
reads each such file from its start into a new ``HistoryFile`` without holding the monitor's lock (so
status requests are answered meanwhile), then hands it to ``adopt``, which catches it up on the lines
appended in the meantime and puts it in the place of the partial one. ``request`` returns an event set
when that is done, for a request that needs the whole history (the down-sampled series) to wait on.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Callable

from diffsynth_mbc.monitor.history import HistoryFile


class Backfill:
    def __init__(self, adopt: Callable[[int, HistoryFile], None]):
        self._adopt = adopt
        self._lock = threading.Lock()
        self._pending: dict[tuple[int, Path], tuple[HistoryFile, threading.Event]] = {}
        self._thread: threading.Thread | None = None
        self.failure: str | None = None   # the last error of a whole read, for the notes

    def request(self, rank: int, partial: HistoryFile) -> threading.Event:
        """Read ``partial``'s file whole (once, however often asked); the event is set when it is in place."""
        key = (rank, partial.path)
        with self._lock:
            if key in self._pending:
                return self._pending[key][1]
            whole = HistoryFile(partial.path, max_points=partial.max_points, index_every=partial.index_every)
            done = threading.Event()
            self._pending[key] = (whole, done)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="mbc-monitor-backfill", daemon=True)
                self._thread.start()
            return done

    def _run(self) -> None:
        while True:
            with self._lock:
                if not self._pending:
                    self._thread = None
                    return
                key = next(iter(self._pending))
                whole, done = self._pending[key]
            try:
                whole.poll()
                self._adopt(key[0], whole)
            except Exception as exc:   # a reader bug must not leave a request waiting forever
                self.failure = f"{whole.path.name}: reading the whole history failed ({type(exc).__name__}: {exc})"
            finally:
                with self._lock:
                    self._pending.pop(key, None)
                done.set()
