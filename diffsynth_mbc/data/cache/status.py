"""Each cache rank's status file, so the monitor and the dashboard show the cache build like training. No torch.

Rank r writes ``LOG_DIR/training_gpu{r}.json`` through the training's own status writer (same name, same atomic
write, same heartbeat while it waits for the other ranks; ``diffsynth_mbc.cache`` hands it in, as this package
never imports the training's), with status ``caching`` from its first moment:
rows done/total of its share (also as step/total_steps), rows/s (``RowRate``: encoding only, over the last rows),
the ETA, failures and the last failure's reason. The file is rewritten at most every ``min_interval_s`` seconds
(and at once when the phase changes), never per row, and nothing is appended per row. At the end it says
``finished`` (or ``failed`` / ``stopped``); the training that follows replaces it with its own.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from diffsynth_mbc import environment, run_files
from diffsynth_mbc.run_layout import CACHE_LOGS
from diffsynth_mbc.data.cache.progress import RowRate

PHASE = "caching"


def default_run_id(environ=os.environ) -> str:
    """The launch's run id (the launcher exports MBC_RUN_ID, which the training then uses too), else time-based."""
    return environ.get(environment.RUN_ID) or f"cache-{environ.get('MASTER_PORT', '0')}-{time.strftime('%Y%m%d-%H%M')}"


def default_log_dir(cache_dir: str | os.PathLike) -> Path:
    return Path(cache_dir) / CACHE_LOGS


class CacheStatus:
    """``writer_class``: ``training.status_writer.RankStatusWriter`` (or one with its interface)."""

    def __init__(self, writer_class, log_dir: str | os.PathLike, run_id: str, rank: int, local_rank: int,
                 world_size: int, cache_dir: str | os.PathLike, min_interval_s: float = 5.0, clock=time.monotonic,
                 wall_clock=time.time, stream=None):
        self._clock = clock
        # continue_history: a cache rank appends no history and leaves the training's alone
        self.writer = writer_class(log_dir, run_id, rank, local_rank, world_size, min_interval_s=min_interval_s,
                                   monotonic=clock, wall_clock=wall_clock, continue_history=True, stream=stream,
                                   kind=run_files.CACHE)
        self.rate: RowRate | None = None
        self.failures, self.last_failure = 0, None
        self.writer.set_status(run_files.STATUS_CACHING, phase=f"{PHASE}: planning the rows",
                               cache_dir=str(cache_dir), launch_id=os.environ.get(environment.RUN_ID),
                               rows_done=0, rows_total=None, failures=0, last_failure=None)

    @property
    def status_file(self) -> Path:
        return self.writer.status_file

    def planned(self, total: int, done: int, failed: list[dict]) -> None:
        """The rank's share is known: ``total`` rows, ``done`` of them needing no work (already cached, or failed)."""
        self.rate = RowRate(total, done, clock=self._clock)
        self._failed(failed)
        self._update(phase=PHASE)

    def loading(self) -> None:
        self._update(phase=f"{PHASE}: loading the VAE and the text encoder")

    def encoding(self) -> None:
        """The models are loaded: rows/s and ETA count from now."""
        self.rate.restart()
        self._update(phase=PHASE)

    def row_done(self, failed: list[dict]) -> None:
        self.rate.advance()
        self._failed(failed)
        self._update()

    def waiting(self, what: str):
        """Around a wait for the other ranks: the file stays fresh and says what the rank waits for."""
        return self.writer.waiting(what)

    def finished(self, phase: str) -> None:
        self.writer.set_status(run_files.STATUS_FINISHED, phase=f"{PHASE} done: {phase}", **{**self._fields(),
                                                                                                "eta_s": 0.0})

    def fail(self, exc: BaseException) -> None:
        self.writer.fail(exc)

    def stopped(self) -> None:
        self.writer.set_status(run_files.STATUS_STOPPED, phase=f"{PHASE} stopped; finished entries are kept")

    def close(self) -> None:
        self.writer.close()

    # -- inside -------------------------------------------------------------------------------------
    def _failed(self, failed: list[dict]) -> None:
        if len(failed) != self.failures:
            self.failures = len(failed)
            self.last_failure = failed[-1]["reason"] if failed else None

    def _fields(self) -> dict:
        fields = {"failures": self.failures, "last_failure": self.last_failure}
        rate = self.rate
        if rate is None:
            return fields
        rows_per_s = rate.rows_per_s
        return {**fields, "rows_done": rate.done, "rows_total": rate.total, "step": rate.done,
                "total_steps": rate.total, "progress": round(rate.progress, 3),
                "rows_per_s": None if rows_per_s is None else round(rows_per_s, 6),
                "samples_per_s": None if rows_per_s is None else float(round(rows_per_s, 6)),
                "step_time_s": None if not rows_per_s else round(1.0 / rows_per_s, 6),
                "eta_s": None if rate.eta_s is None else round(rate.eta_s, 3)}

    def _update(self, **fields) -> None:
        # the throttle is the writer's: most rows only change the state in memory
        self.writer.update(**self._fields(), **fields)
