"""How a run starts on its checkpoint folder: ``resume`` goes on from a checkpoint as the same run (weights,
optimizer, scheduler, every rank's RNG, data position, run id, clock, history); a fresh run first claims the
folder (another run's checkpoints there are refused, or set aside with --start_over)."""

from __future__ import annotations

from diffsynth_mbc.errors import OptionsError
from diffsynth_mbc.training.checkpoints import truncate_history
from diffsynth_mbc.training.ema import restore as restore_ema


def claim_checkpoint_folder(run) -> None:
    from diffsynth_mbc.training.checkpoint_owner import claim_folder

    try:
        claim_folder(run.checkpoints.root, run.status.state["run_id"], run.options.start_over, run.accelerator,
                     run.status)
    except ValueError as exc:
        raise OptionsError(str(exc)) from None


def resume(run) -> None:
    """Restores weights, optimizer, scheduler and the RNG of every rank, and the data position."""
    run.position = position = run.checkpoints.load(run.options.resume)
    restore_ema(run)
    kept = truncate_history(run.status.history_file, position.step)
    run.status.elapsed_before_s = position.elapsed_s
    lineage = {"checkpoint": position.checkpoint, "step": position.step, "run_id": position.run_id}
    if position.run_id and position.run_id != run.status.state["run_id"]:   # fell back to another run's checkpoint
        run.status.update(run_id=position.run_id)
    run.status.update(phase=f"resumed from {position.checkpoint} of run {run.status.state['run_id']} "
                            f"(history: {kept} lines kept)", resumed_from=lineage,
                      samples_seen=position.samples_seen, skipped_samples=position.skipped_samples)
