"""``--resolution_stages`` in the run's reports: the stage the next optimizer step trains at, in the status file
(``stage``: its number, size and steps; ``stages``: every stage) and, when it changes, a line on rank 0's terminal."""

from __future__ import annotations


def start_stages(run) -> None:
    """The loader's batches carry their stage (``batches.set_stages``), and the status file says every stage."""
    plan = run.plan
    if not plan.stages:
        return
    from diffsynth_mbc.data.media.stages import boundaries

    run.stage_ends = boundaries(plan.stages, run.logger.total_steps)
    run.batches.set_stages(run.stage_ends, run.steps_per_epoch, run.accelerator.gradient_accumulation_steps)
    run.status.update(stages=plan.stage_dicts())
    say_stage(run)


def say_stage(run) -> None:
    """After a step (and at the start): the next step's stage, said when it is not the one said last."""
    if not run.plan.stages:
        return
    from diffsynth_mbc.data.media.stages import stage_at

    index = stage_at(run.stage_ends, run.position.step)
    if index == run.stage_said:
        return
    row = run.plan.stage_dicts()[index]
    final = index == len(run.plan.stages)
    run.status.update(stage={**row, "of": len(run.plan.stages) + 1, "final": final})
    if run.stage_said is not None or run.position.step:
        run.logger.printer.event(f"stage {row['stage']}/{len(run.plan.stages) + 1} from step {row['from_step']:,}: "
                                 f"{row['size']}" + (" (the final size)" if final else ""))
    run.stage_said = index
