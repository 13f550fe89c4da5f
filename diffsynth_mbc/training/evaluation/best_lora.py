"""The loop's hook after a validation: keep the best LoRA (``lora-best.safetensors``, written as every LoRA file is,
with its EMA twin when there is an EMA) and say it in the status file (``best``); and ``--early_stop``: whether the run
ends here. Every rank calls it at the same step; the validation's loss is every rank's, so they decide alike. A run
that fails with a broken LoRA says what became of ``lora-best`` (``best_file_said_on_failure``)."""

from __future__ import annotations

import contextlib
import os
import sys

from diffsynth_mbc.training.evaluation.best_so_far import BEST_FILE, BestSoFar, best_file_note, stopped_early_note
from diffsynth_mbc.training.evaluation.lora_health import UnhealthyRunError
from diffsynth_mbc.training.step.guards import NonFiniteError


def best_file_path(options) -> str:
    return os.path.join(options.output_path, BEST_FILE)


def keep_best(run) -> bool:
    """After ``run.validator`` validated at this step: the best LoRA kept when it is a new best; True when
    ``--early_stop`` ends the run here."""
    best: BestSoFar = run.validator.best
    if best.last_new_best:
        run.logger.timed("lora", run.checkpoints.save_lora, BEST_FILE, run.position.step)
        run.status.update(best=best.best_record(best_file_path(run.options)))
    run.position.best_so_far = best.as_dict()   # into the next checkpoint: a resume goes on counting
    return best.stop_due


def start_best(run) -> None:
    """The run's best and count: a resumed run's from its checkpoint; under ``--resolution_stages`` with the stages'
    ends (``run.stages``: the count runs in the final stage, the best says its stage)."""
    if run.validator:
        ends = tuple(run.stages.ends or ())
        sizes = tuple(row["size"] for row in run.plan.stage_dicts()) if ends else ()
        run.validator.best = BestSoFar.from_options(run.options, run.position.best_so_far, ends, sizes)
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
        print(stopped_early_note(best.early_stop_record(run.position.step)), file=sys.stderr)
    return True


def say_early_stop(run) -> None:
    """The status file's ``early_stop`` on every rank (the run's summary ends with it: ``early_stop_line``)."""
    run.status.update(early_stop=run.validator.best.early_stop_record(run.position.step))


@contextlib.contextmanager
def best_file_said_on_failure(run):
    """Around the training and its end: a run that fails with a broken LoRA (non-finite steps, a LoRA file refused
    for NaN/inf, a broken LoRA at the end) ends its message with what became of ``lora-best.safetensors``."""
    try:
        yield
    except (NonFiniteError, UnhealthyRunError) as error:
        if run.validator is None:
            raise
        note = best_file_note(run.validator.best, best_file_path(run.options))
        raise type(error)(f"{str(error).rstrip('.')}. Best LoRA: {note}") from None
