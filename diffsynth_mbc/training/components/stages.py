"""``--resolution_stages``, what trains and what is said, from one list of boundaries: the optimizer step each stage
ends after, computed once from the run's schedule (``data/media/stages.boundaries`` of its total; after a resume on
other processes, where the schedule reaches them, ``training/plan/schedule.py``). The batch sampler is given it,
so each batch goes out with its stage (the dataset and the latent cache load that stage's size); the status file
says every stage (``stages``) and the one the next optimizer step trains at (``stage``), and rank 0's terminal says
when it changes. Without stages it does nothing."""

from __future__ import annotations

from diffsynth_mbc.training.components.protocol import Component, StepContext


class ResolutionStages(Component):
    name = "stages"

    def __init__(self, plan, schedule, batches, first_step_of_epoch, accumulation: int, status, printer):
        from diffsynth_mbc.data.media.stages import boundaries, stage_at

        self.status, self.printer = status, printer
        # the boundaries fall at shares of the schedule (its steps: this run's, unless it resumed on other processes)
        ends = [schedule.run_step(end) for end in boundaries(plan.stages, schedule.total)] if plan.stages else None
        self.ends: list[int] | None = ends
        self.rows = plan.stage_dicts(ends=ends) if plan.stages else []   # the same boundaries, said
        self.said: int | None = None   # the stage said last
        if ends:
            batches.set_stages(lambda step: stage_at(ends, step), first_step_of_epoch, accumulation)

    def at_start(self, context: StepContext) -> None:
        if self.ends:
            self.status.update(stages=self.rows)
            self.say(context.step)

    def after_step(self, context: StepContext) -> None:
        if self.ends:
            self.say(context.step)

    def say(self, step: int) -> None:
        """The stage of the optimizer step after ``step``, when it is not the one said last."""
        from diffsynth_mbc.data.media.stages import stage_at

        index = stage_at(self.ends, step)
        if index == self.said:
            return
        row, count = self.rows[index], len(self.rows)
        final = index == count - 1
        self.status.update(stage={**row, "of": count, "final": final})
        if self.said is not None or step:   # a change, or a resume past the first stage's start
            self.printer.event(f"stage {row['stage']}/{count} from step {row['from_step']:,}: {row['size']}"
                               + (" (the final size)" if final else ""))
        self.said = index
