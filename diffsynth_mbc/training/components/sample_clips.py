"""``--sample_prompts``: sample clips rendered by ``training/evaluation/sample_clips.Sampler`` before the first step of
a fresh run (the baseline), every ``--sample_steps`` optimizer steps and at the end, timed apart from the steps
(every rank waits while rank 0 renders), with a line on rank 0's terminal."""

from __future__ import annotations

from diffsynth_mbc.training.components.protocol import Component, StepContext


class SampleClips(Component):
    name = "samples"

    def __init__(self, sampler, logger, first_step: int):
        self.sampler, self.logger, self.first_step = sampler, logger, first_step

    def at_start(self, context: StepContext) -> None:
        if context.stop is None:   # a run with nothing left to train renders no baseline
            self.render_when_due(context.step)

    def after_step(self, context: StepContext) -> None:
        self.render_when_due(context.step)

    def at_end(self, context: StepContext) -> None:
        self.render_when_due(context.step)

    def render_when_due(self, step: int) -> None:
        """Sample clips when due; every rank calls it at the same step."""
        if not self.sampler.due(step, self.logger.total_steps, self.first_step):
            return
        with self.logger.overhead("samples") as section:
            self.sampler.run(step)
        last = self.sampler.status.state.get("last_samples")
        if last:
            base = len(last.get("base_files") or []) // 2
            self.logger.printer.event(f"samples at step {last['step']}: {len(last['files']) // 2} clip(s) in "
                                      f"{last['dir']}" + (f", {base} of the base model in {last['base_dir']}"
                                                          if base else "") + f" ({section.seconds:.1f} s)")
