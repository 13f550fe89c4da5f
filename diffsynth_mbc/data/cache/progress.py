"""Rank 0's view of the cache job: a rich bar in a terminal, else a plain line every 30 s."""

from __future__ import annotations

import sys
import time


class ProgressView:
    """Rank 0's bar (rich, with ETA) in a terminal; otherwise a line every ``interval_s``."""

    def __init__(self, total: int, rank: int, world_size: int, enabled: bool, interval_s: float = 30.0):
        self.total, self.done, self.enabled = total, 0, enabled and total > 0
        self.label = f"encoding (rank {rank} of {world_size})"
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
            self.progress.update(self.task, advance=1, rate=f"{rate:.2f} rows/s")
        elif now - self.last_line >= self.interval_s or self.done == self.total:
            self.last_line = now
            eta = (self.total - self.done) / rate if rate > 0 else float("inf")
            print(f"{self.label}: {self.done}/{self.total} rows, {rate:.2f} rows/s, ETA {eta:.0f} s",
                  file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.progress is not None:
            self.progress.stop()
            self.progress = None


