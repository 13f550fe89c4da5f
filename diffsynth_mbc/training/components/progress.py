"""Each optimizer step's progress: its history record, the status file's step, loss, rate and ETA, and rank 0's
terminal line, through the run's ``ProgressLogger`` (``training/reporting/progress.py``)."""

from __future__ import annotations

from diffsynth_mbc.training.components.protocol import Component, StepContext


class StepProgress(Component):
    name = "progress"

    def __init__(self, logger, accelerator):
        self.logger, self.accelerator = logger, accelerator

    def after_step(self, context: StepContext) -> None:
        result = context.result
        self.logger.on_step_end(self.accelerator, None, loss=result.loss, lr=result.lr, samples=result.samples,
                                grad_norm=result.grad_norm, tokens=result.tokens, timestep_draws=result.draws,
                                rows=result.rows,
                                **({"nonfinite": True} if result.skipped else {}))
