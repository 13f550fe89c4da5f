"""How a run starts on its checkpoint folder: ``resume`` goes on from a checkpoint as the same run (weights,
optimizer, scheduler, every rank's RNG, data position, run id, clock, history); a fresh run first claims the
folder (another run's checkpoints and LoRA files there are refused, or set aside with --start_over).

``refuse_early`` makes every refusal that needs only files before anything is loaded or written: a refused
``--resume`` or a fresh run on another run's folders leaves every file as it was (the status files of a finished
run still say finished)."""

from __future__ import annotations

import sys

from diffsynth_mbc.errors import OptionsError
from diffsynth_mbc.training.checkpoints.fingerprint import FINGERPRINT_KEYS, fingerprint_differences, run_fingerprint
from diffsynth_mbc.training.checkpoints.folder import (different_configuration, read_manifest, resolve_resume,
                                                       set_aside_unreadable)
from diffsynth_mbc.training.checkpoints.row_sizes import resized_since
from diffsynth_mbc.training.checkpoints.state import truncate_history
from diffsynth_mbc.training.distributed.collectives import wait_for_everyone
from diffsynth_mbc.training.lora.ema import restore as restore_ema

# Settings only the prepared accelerator knows (the precision "auto" chooses and the fp32 residual stream chosen for
# it, DeepSpeed's accumulation) or only the opened dataset (its rows): compared when the checkpoint loads, not before.
KNOWN_LATE = ("mixed_precision", "gradient_accumulation_steps", "metadata_rows", "fp32_residual")


def refuse_early(options, run_id: str, world_size: int, report=None) -> None:
    """OptionsError for what the files alone refuse: a ``--resume`` without an intact checkpoint or with other
    settings than the checkpoint's (``--force_resume`` aside); a fresh run on folders holding another run's
    checkpoints or LoRA files without ``--start_over``."""
    from diffsynth_mbc.training.checkpoints.owner import check_claim

    try:
        if not options.resume:
            check_claim(options.checkpoint_dir, options.output_path, run_id, options.start_over, options.log_dir)
            return
        folder = resolve_resume(options.resume, options.checkpoint_dir, world_size, report=report)
    except ValueError as exc:
        raise OptionsError(str(exc)) from None
    if options.force_resume:
        return
    try:
        current = early_fingerprint(options, world_size)
    except OSError:   # the metadata cannot be read: opening the dataset says so, naming the file
        return
    keys = [key for key in FINGERPRINT_KEYS if key not in KNOWN_LATE]
    manifest = read_manifest(folder) or {}
    differences = fingerprint_differences(manifest.get("fingerprint", {}), current, keys)
    if differences:
        raise OptionsError(different_configuration(folder, differences))
    resized = resized_since(options, folder, manifest)   # media files that changed shape since: the rows named
    if resized:
        raise OptionsError(resized)


def early_fingerprint(options, world_size: int) -> dict:
    """This run's fingerprint as far as options and files tell it (``KNOWN_LATE`` left as placeholders)."""
    from diffsynth_mbc.data.cache.index import file_sha256
    from diffsynth_mbc.training.plan.step_plan import plan_from_options

    image_batch = plan_from_options(options, rows=0, images=0, world_size=world_size).image_batch_size
    return run_fingerprint(options, world_size=world_size, accumulation=options.gradient_accumulation_steps, rows=0,
                           metadata_sha256=file_sha256(options.dataset_metadata_path), image_batch=image_batch,
                           precision="")


def claim_checkpoint_folder(run) -> None:
    from diffsynth_mbc.training.checkpoints.owner import claim_folder

    try:
        claim_folder(run.checkpoints.root, run.options.output_path, run.status.state["run_id"], run.options.start_over,
                     run.accelerator, run.status, run.options.log_dir)
    except ValueError as exc:
        raise OptionsError(str(exc)) from None


def resume(run) -> None:
    """Restores weights, optimizer, scheduler and the RNG of every rank, and the data position."""
    run.position = position = run.checkpoints.load(run.options.resume)
    if run.accelerator.is_main_process:   # a damaged folder past the checkpoint would block saving that step again
        for moved in set_aside_unreadable(run.checkpoints.root, position.step):
            print(f"note: {moved.name[len('damaged-'):]} had no readable checkpoint.json: moved aside to {moved}",
                  file=sys.stderr)
    wait_for_everyone(run.accelerator, run.status, "rank 0 setting unreadable checkpoint folders aside")
    restore_ema(run)
    kept = truncate_history(run.status.history_file, position.step)
    run.status.elapsed_before_s = position.elapsed_s
    lineage = {"checkpoint": position.checkpoint, "step": position.step, "run_id": position.run_id}
    if position.run_id and position.run_id != run.status.state["run_id"]:   # fell back to another run's checkpoint
        run.status.update(run_id=position.run_id)
    run.status.update(phase=f"resumed from {position.checkpoint} of run {run.status.state['run_id']} "
                            f"(history: {kept} lines kept)", resumed_from=lineage,
                      samples_seen=position.samples_seen, skipped_samples=position.skipped_samples)
