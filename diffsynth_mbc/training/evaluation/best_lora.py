"""The loop's hook after a validation: keep the best LoRA (``lora-best.safetensors``, written as every LoRA file is,
with its EMA twin when there is an EMA) and say it in the status file (``best``); and ``--early_stop``: whether the run
ends here. Every rank calls it at the same step; the validation's loss is every rank's, so they decide alike."""

from __future__ import annotations

import os
import sys

from diffsynth_mbc.run_layout import BEST_LORA
from diffsynth_mbc.training.evaluation.best_so_far import BestSoFar


def best_file_path(options) -> str:
    return os.path.join(options.output_path, BEST_LORA)


def keep_best(run) -> bool:
    """After ``run.validator`` validated at this step: the best LoRA kept when it is a new best; True when
    ``--early_stop`` ends the run here."""
    best: BestSoFar = run.validator.best
    if best.last_new_best:
        run.logger.timed("lora", run.checkpoints.save_lora, BEST_LORA, run.position.step)
        run.status.update(best=best.best_record(best_file_path(run.options)))
    run.position.best_so_far = best.as_dict()   # into the next checkpoint: a resume goes on counting
    return best.stop_due


def resume_best(run) -> None:
    """A resumed run's best and count, from its checkpoint."""
    if run.validator:
        run.validator.best = BestSoFar.from_options(run.options, run.position.best_so_far)
        record = run.validator.best.best_record(best_file_path(run.options))
        if record:
            run.status.update(best=record)


def stopped_before(run) -> bool:
    """Whether a resumed run had already stopped early (its count at ``--early_stop`` N or more): then it trains no
    further, and rank 0 says how to go on."""
    if not run.validator or not run.validator.best.stop_due:
        return False
    best = run.validator.best
    if run.accelerator.is_main_process:
        print(f"this run stopped early at step {run.position.step}: no better validation in {best.without} "
              f"evaluations since step {best.reference_step} (--early_stop {best.patience}); nothing more to "
              "train. To go on: a larger --early_stop N, or --early_stop off", file=sys.stderr)
    return True


def say_early_stop(run) -> None:
    """The status file's ``early_stop`` on every rank (the run's summary ends with it: ``early_stop_line``)."""
    run.status.update(early_stop=run.validator.best.early_stop_record(run.position.step))
