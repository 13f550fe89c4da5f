"""Rank 0's view of the cache job or of any long read of files (a rich bar in a terminal, else a plain line every
30 s), and every rank's rows/s and ETA for its status file (``RowRate``; pure, no torch)."""

from __future__ import annotations

import collections
import sys
import time


class ProgressView:
    """Rank 0's bar (rich, with ETA) in a terminal; otherwise a line every ``interval_s``."""

    def __init__(self, total: int, rank: int, world_size: int, enabled: bool, interval_s: float = 30.0,
                 label: str | None = None, unit: str = "rows"):
        self.total, self.done, self.enabled = total, 0, enabled and total > 0
        self.label = label or f"encoding (rank {rank} of {world_size})"
        self.unit = unit
        self.interval_s = interval_s
        self.started = self.last_line = time.monotonic()
        self.counted_from = 0
        self.progress = None
        if self.enabled and sys.stderr.isatty():
            from rich.console import Console
            from rich.progress import (
                BarColumn,
                MofNCompleteColumn,
                Progress,
                TextColumn,
                TimeElapsedColumn,
                TimeRemainingColumn,
            )

            self.progress = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                                     TextColumn("{task.fields[rate]}"), TimeElapsedColumn(), TextColumn("ETA"),
                                     TimeRemainingColumn(), console=Console(stderr=True))
            self.task = self.progress.add_task(self.label, total=total, rate="")
            self.progress.start()

    def restart_clock(self) -> None:
        """Rows/s and ETA from now on: model loading is not encoding."""
        self.started = time.monotonic()
        self.counted_from = self.done
        if self.progress is not None:
            self.progress.reset(self.task, total=self.total, completed=self.done, rate="")

    def advance(self) -> None:
        self.done += 1
        if not self.enabled:
            return
        now = time.monotonic()
        rate = (self.done - self.counted_from) / max(now - self.started, 1e-9)
        if self.progress is not None:
            self.progress.update(self.task, advance=1, rate=f"{rate:.2f} {self.unit}/s")
        elif now - self.last_line >= self.interval_s or self.done == self.total:
            self.last_line = now
            eta = (self.total - self.done) / rate if rate > 0 else float("inf")
            print(f"{self.label}: {self.done}/{self.total} {self.unit}, {rate:.2f} {self.unit}/s, ETA {eta:.0f} s",
                  file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.progress is not None:
            self.progress.stop()
            self.progress = None




class RowRate:
    """Rows/s and the ETA of one rank's share of the cache, in constant memory and time per row.

    The rate is taken over the last ``window`` rows (a sample of (time, rows done) per row, bounded), so a slow
    start or a change of media (clips, then images) fades out; ``restart`` leaves out what came before it (the
    model loading), and rows done before the first ``restart``/creation (skipped as already cached) count as
    done but not in the rate. ``clock`` is a monotonic clock in seconds."""

    def __init__(self, total: int, done: int = 0, window: int = 200, clock=time.monotonic):
        if window < 1:
            raise ValueError("window must be at least 1")
        self.total, self.done, self.window, self._clock = total, done, window, clock
        self._samples = collections.deque(maxlen=window + 1)
        self.restart()

    def restart(self) -> None:
        self._samples.clear()
        self._samples.append((self._clock(), self.done))

    def advance(self, rows: int = 1) -> None:
        self.done = min(self.total, self.done + rows)
        self._samples.append((self._clock(), self.done))

    @property
    def rows_per_s(self) -> float | None:
        """None until a row was done after the (re)start over a measurable time."""
        (t0, d0), (t1, d1) = self._samples[0], self._samples[-1]
        if d1 <= d0 or t1 <= t0:
            return None
        return (d1 - d0) / (t1 - t0)

    @property
    def eta_s(self) -> float | None:
        if self.done >= self.total:
            return 0.0
        rate = self.rows_per_s
        return None if rate is None else (self.total - self.done) / rate

    @property
    def progress(self) -> float:
        return 100.0 if self.total <= 0 else 100.0 * self.done / self.total
