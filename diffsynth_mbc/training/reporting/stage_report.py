"""``--resolution_stages`` in the run's reports: the stage the next optimizer step trains at, in the status file
(``stage``: its number, size and steps; ``stages``: every stage) and, when it changes, a line on rank 0's terminal.
Without stages it does nothing."""

from __future__ import annotations


class StageReport:
    """Made when the run is set up: the loader's batches carry their stage (``batches.set_stages``), the status file
    says every stage; ``after_step`` says the next step's stage when it is not the one said last."""

    def __init__(self, run):
        from diffsynth_mbc.data.media.stages import boundaries

        self.plan = run.plan
        self.ends: list[int] | None = None   # the optimizer step each stage ends after, from the loader's total
        self.said: int | None = None         # the stage said last
        if not self.plan.stages:
            return
        self.ends = boundaries(self.plan.stages, run.logger.total_steps)
        run.batches.set_stages(self.ends, run.steps_per_epoch, run.accelerator.gradient_accumulation_steps)
        run.status.update(stages=self.plan.stage_dicts())
        self.after_step(run)

    def after_step(self, run) -> None:
        if self.ends is None:
            return
        from diffsynth_mbc.data.media.stages import stage_at

        index = stage_at(self.ends, run.position.step)
        if index == self.said:
            return
        row, count = self.plan.stage_dicts()[index], len(self.plan.stages) + 1
        final = index == count - 1
        run.status.update(stage={**row, "of": count, "final": final})
        if self.said is not None or run.position.step:   # a change, or a resume past the first stage's start
            run.logger.printer.event(f"stage {row['stage']}/{count} from step {row['from_step']:,}: {row['size']}"
                                     + (" (the final size)" if final else ""))
        self.said = index
