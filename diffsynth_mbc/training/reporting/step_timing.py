"""Honest step times: a step clock that stops while the loop checkpoints, validates or renders samples. Pure: no torch.

A step's time is what the step itself costs: waiting for its data, forward, backward and the optimizer
step. The loop brackets everything else it does between two steps (a full checkpoint, a LoRA file,
validation, sample clips) as an overhead section (``begin``/``end``); the step clock does not run inside
one, so the step after a 5-second checkpoint still reads its own 1 second. Every kind is tallied (count,
total, last, mean), and the ETA is the remaining steps at the steady step time plus the overheads still
ahead (``eta.OverheadSchedule``) at their measured mean. Tallies start at zero in every process (a resumed
run measures its own).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from diffsynth_mbc.training.reporting.eta import OverheadSchedule, StepRateWindow, eta_seconds


@dataclass
class Tally:
    """One kind of overhead: how many, how long in all, the last one."""
    count: int = 0
    total_s: float = 0.0
    last_s: float | None = None

    def add(self, seconds: float) -> None:
        self.count += 1
        self.total_s += seconds
        self.last_s = seconds

    @property
    def mean_s(self) -> float | None:
        return self.total_s / self.count if self.count else None

    def as_dict(self) -> dict:
        return {"count": self.count, "total_s": round(self.total_s, 3), "last_s": round(self.last_s, 3),
                "mean_s": round(self.mean_s, 3)}


@dataclass
class _Open:
    kind: str
    started: float
    nested_s: float = 0.0   # time of sections opened inside this one (tallied under their own kind)


class StepClock:
    """Monotonic seconds with the overhead sections taken out, and the tally of those sections per kind.

    Sections may nest (a LoRA file saved inside another section): the clock stops once, and each
    section's tally gets its own time without the sections inside it, so the tallies add up to the time
    the clock stood still.
    """

    def __init__(self, monotonic=time.monotonic):
        self._monotonic = monotonic
        self._paused_s = 0.0
        self._open: list[_Open] = []
        self.tallies: dict[str, Tally] = {}

    def now(self) -> float:
        """The step clock: stands still from the start of the outermost open section until its end."""
        current = self._open[0].started if self._open else self._monotonic()
        return current - self._paused_s

    def begin(self, kind: str) -> None:
        self._open.append(_Open(kind, self._monotonic()))

    def end(self, tally: bool = True) -> tuple[str, float]:
        """Close the innermost section: (its kind, its seconds without nested sections). With ``tally`` False
        (the work in it failed) its time is still left out of the step clock but not counted as one of its kind."""
        if not self._open:
            raise RuntimeError("no overhead section is open")
        section = self._open.pop()
        elapsed = max(0.0, self._monotonic() - section.started)
        if self._open:
            self._open[-1].nested_s += elapsed
        else:
            self._paused_s += elapsed
        own = max(0.0, elapsed - section.nested_s)
        if tally:
            self.tallies.setdefault(section.kind, Tally()).add(own)
        return section.kind, own

    def means(self) -> dict[str, float]:
        return {kind: tally.mean_s for kind, tally in self.tallies.items() if tally.count}

    def as_dict(self) -> dict:
        """The status file's ``overheads``: ``{kind: {count, total_s, last_s, mean_s}}``."""
        return {kind: tally.as_dict() for kind, tally in self.tallies.items() if tally.count}


@dataclass(frozen=True)
class StepTimes:
    step_time_s: float          # this step alone
    step_time_avg_s: float | None   # over the rate window (None during warm-up)
    eta_s: float | None
    eta_overheads_s: float


@dataclass
class StepTiming:
    """What the progress callback needs at each step end: the step's own time, the steady rate and the ETA."""
    total_steps: int
    steps_per_epoch: int
    schedule: OverheadSchedule | None = None
    rate_window: int = 50
    warmup_steps: int = 2
    monotonic: object = time.monotonic
    clock: StepClock = field(init=False)
    rate: StepRateWindow = field(init=False)

    def __post_init__(self):
        self.clock = StepClock(self.monotonic)
        self.rate = StepRateWindow(window=self.rate_window, warmup_steps=self.warmup_steps)
        self._last_step_end = self.clock.now()

    def start(self) -> None:
        """Training begins: the next step is timed from now (loading and a baseline sample are not in it)."""
        self._last_step_end = self.clock.now()

    def step_done(self, step: int) -> StepTimes:
        now = self.clock.now()
        step_time, self._last_step_end = now - self._last_step_end, now
        self.rate.record(step, now)
        seconds_per_step = self.rate.seconds_per_step
        upcoming = (self.schedule.upcoming(step, self.total_steps, self.steps_per_epoch, seconds_per_step)
                    if self.schedule else {})
        eta, eta_overheads = eta_seconds(seconds_per_step, self.total_steps - step, upcoming, self.clock.means())
        return StepTimes(step_time, seconds_per_step, eta, eta_overheads)
