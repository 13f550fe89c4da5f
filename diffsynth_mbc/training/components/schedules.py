"""What is saved when, and stop requests: the full checkpoint every ``--checkpoint_steps`` optimizer steps and/or
every ``--checkpoint_minutes`` (whichever comes first; the clock is agreed over the ranks, so every rank saves at
the same step), a LoRA file every ``--save_steps``, and a stop request (Ctrl-C, SIGTERM, ``stop.sh``; the scheduler's
warning or SIGTERM: a preemption) on any rank ending every rank at the same step, all in the same words. Pure: no
torch."""

from __future__ import annotations

import time

from diffsynth_mbc import run_files
from diffsynth_mbc.run_layout import step_file_name
from diffsynth_mbc.training.components.protocol import Component, Decision, Stop, StepContext, StepResult


class CheckpointSchedule(Component):
    """Due every ``every_steps`` optimizer steps and/or every ``every_minutes``, whichever comes first."""

    name = "checkpoint_schedule"

    def __init__(self, every_steps: int | None, every_minutes: float | None, monotonic=time.monotonic):
        self.every_steps = every_steps or None
        self.every_seconds = every_minutes * 60 if every_minutes else None
        self._monotonic = monotonic
        self._last = monotonic()

    @property
    def enabled(self) -> bool:
        return bool(self.every_steps or self.every_seconds)

    def due_by_steps(self, step: int) -> bool:
        return bool(self.every_steps) and step % self.every_steps == 0

    def due_by_time(self) -> bool:
        return bool(self.every_seconds) and self._monotonic() - self._last >= self.every_seconds

    def saved(self) -> None:
        self._last = self._monotonic()

    def votes(self, result: StepResult) -> dict[str, int]:
        return {"checkpoint_time": int(self.due_by_time())}

    def after_step(self, context: StepContext) -> Decision | None:
        if self.due_by_steps(context.step) or context.agreed["checkpoint_time"]:
            self.saved()
            return Decision(checkpoint=True)
        return None


class StepLoraFiles(Component):
    """``--save_steps N``: ``step-N.safetensors`` every N optimizer steps (written after the step's checkpoint)."""

    name = "step_lora_files"

    def __init__(self, every: int | None):
        self.every = every

    def after_step(self, context: StepContext) -> Decision | None:
        if self.every and context.step % self.every == 0:
            return Decision(lora_file=step_file_name(context.step))
        return None


class StopRequests(Component):
    """A stop request on any rank (``signals.requested``) stops every rank after the same step, with a checkpoint;
    when it is the scheduler's on any rank (``signals.preempted``), every rank ends ``preempted``."""

    name = "stop_requests"

    def __init__(self, signals):
        self.signals = signals
        self.preempted = False   # agreed at the stop

    def votes(self, result: StepResult) -> dict[str, int]:
        requested = self.signals.requested.is_set()
        return {"stop": int(requested), "preempted": int(requested and self.signals.preempted)}

    def after_step(self, context: StepContext) -> Decision | None:
        if not context.agreed["stop"]:
            return None
        self.preempted = bool(context.agreed["preempted"])
        return Decision(stop=Stop.REQUESTED)

    def outcome(self, step: int) -> tuple[str, str]:
        """(status, phase) of the run it stopped at ``step``, once the checkpoint is saved."""
        why = self.signals.describe() if self.signals.requested.is_set() else "made on another rank"
        if self.preempted:
            return run_files.STATUS_PREEMPTED, (f"preempted at step {step} ({why}); a checkpoint was saved: the "
                                                f"requeued job goes on from it with --resume latest")
        return run_files.STATUS_STOPPED, (f"stopped at step {step} after a stop request ({why}); resume with "
                                          f"--resume latest")
