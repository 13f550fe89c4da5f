"""Where a run's schedules stand at each optimizer step: the learning rate's factor, and the step
``--resolution_stages`` counts its shares of. Pure: no torch.

The schedules run over ``total`` *schedule steps*, which are the optimizer steps themselves until a resume on
another number of processes (``training/plan/elastic.py``): from that step on, what was left of the schedules is
spread evenly over the steps the run has left (a step of M processes trains M/N of a step of N: the schedules go on
by samples seen). A forced resume whose plan ends elsewhere runs them to its own end (``end_at``). The state goes
into every checkpoint (``checkpoint.json``: ``schedule``), so a later resume goes on from it.
"""

from __future__ import annotations

import math

from diffsynth_mbc.training.plan.step_plan import lr_factor


class StepSchedule:
    def __init__(self, total: int, warmup_steps: int = 0, kind: str = "constant"):
        self.total = total           # the schedules' length, in schedule steps
        self.warmup_steps, self.kind = warmup_steps, kind   # the learning rate's (--warmup_steps, --lr_scheduler)
        self.resumed_at = 0          # a resume on other processes: the step it resumed at,
        self.schedule_at = 0.0       # ... the schedule step it was at then,
        self.end = 0                 # ... and the run's last step (0: no such resume; schedule step = step)

    @property
    def last_step(self) -> int:
        """The optimizer step the schedules end at."""
        return self.end or self.total

    def schedule_step(self, step: float) -> float:
        """Where the schedules stand at optimizer ``step``."""
        if not self.end or step <= self.resumed_at:
            return step if not self.end else self.schedule_at - (self.resumed_at - step)
        return self.schedule_at + (step - self.resumed_at) * (self.total - self.schedule_at) / \
            max(1, self.end - self.resumed_at)

    def run_step(self, schedule_step: float) -> int:
        """The first optimizer step at which the schedules reach ``schedule_step`` (a stage's boundary)."""
        if not self.end or schedule_step <= self.schedule_at:
            return round(schedule_step if not self.end else self.resumed_at - (self.schedule_at - schedule_step))
        left = max(1e-9, self.total - self.schedule_at)
        return self.resumed_at + math.ceil(round((schedule_step - self.schedule_at) * (self.end - self.resumed_at)
                                                 / left, 6))

    def lr_factor(self, step: int) -> float:
        """The learning rate's multiplier before optimizer ``step`` (0-based): ``step_plan.lr_factor`` at its
        schedule step."""
        return lr_factor(self.schedule_step(step), self.total, self.warmup_steps, self.kind)

    def spread_from(self, step: int, end: int) -> None:
        """A resume on other processes at ``step``, ending at ``end``: what is left of the schedules spread over
        the steps between."""
        self.schedule_at, self.resumed_at, self.end = self.schedule_step(step), step, end

    def end_at(self, total: int) -> None:
        """The schedules run over ``total`` steps, one schedule step per step (a forced resume's own plan)."""
        self.total, self.resumed_at, self.schedule_at, self.end = total, 0, 0.0, 0

    def state_dict(self) -> dict:
        return {"total": self.total, "resumed_at": self.resumed_at, "schedule_at": self.schedule_at, "end": self.end}

    def load_state_dict(self, state: dict) -> None:
        self.total, self.resumed_at = int(state["total"]), int(state["resumed_at"])
        self.schedule_at, self.end = float(state["schedule_at"]), int(state["end"])
