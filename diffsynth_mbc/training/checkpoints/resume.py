"""How a run starts on its checkpoint folder: ``resume`` goes on from a checkpoint as the same run (weights,
optimizer, scheduler, every rank's RNG, data position, run id, clock, history); a fresh run first claims the
folder (another run's checkpoints and LoRA files there are refused, or set aside with --start_over).

``refuse_early`` makes every refusal that needs only files before anything is loaded or written: a refused
``--resume`` or a fresh run on another run's folders leaves every file as it was (the status files of a finished
run still say finished). ``nothing_to_train`` likewise: a resume of a run that has ended (finished, or stopped
early) trains nothing and writes nothing."""

from __future__ import annotations

import sys
from pathlib import Path

from diffsynth_mbc.errors import OptionsError
from diffsynth_mbc.training.checkpoints.fingerprint import FINGERPRINT_KEYS, fingerprint_differences, run_fingerprint
from diffsynth_mbc.training.checkpoints.folder import (different_configuration, read_manifest, resolve_resume,
                                                       set_aside_unreadable)
from diffsynth_mbc.training.checkpoints.row_sizes import resized_since
from diffsynth_mbc.training.checkpoints.state import truncate_history
from diffsynth_mbc.training.distributed.collectives import wait_for_everyone

# Settings only the prepared accelerator knows (the precision "auto" chooses, DeepSpeed's accumulation) or only
# the opened dataset (its rows): compared when the checkpoint loads, not before.
KNOWN_LATE = ("mixed_precision", "gradient_accumulation_steps", "metadata_rows")


def refuse_early(options, run_id: str, world_size: int, report=None) -> Path | None:
    """OptionsError for what the files alone refuse: a ``--resume`` without an intact checkpoint or with other
    settings than the checkpoint's (``--force_resume`` aside); a fresh run on folders holding another run's
    checkpoints or LoRA files without ``--start_over``. Returns the checkpoint folder a resume goes on from."""
    from diffsynth_mbc.training.checkpoints.owner import check_claim

    try:
        if not options.resume:
            check_claim(options.checkpoint_dir, options.output_path, run_id, options.start_over, options.log_dir)
            return None
        folder = resolve_resume(options.resume, options.checkpoint_dir, world_size, report=report)
    except ValueError as exc:
        raise OptionsError(str(exc)) from None
    if options.force_resume:
        return folder
    try:
        current = early_fingerprint(options, world_size)
    except OSError:   # the metadata cannot be read: opening the dataset says so, naming the file
        return folder
    keys = [key for key in FINGERPRINT_KEYS if key not in KNOWN_LATE]
    manifest = read_manifest(folder) or {}
    differences = fingerprint_differences(manifest.get("fingerprint", {}), current, keys)
    if differences:
        raise OptionsError(different_configuration(folder, differences))
    resized = resized_since(options, folder, manifest)   # media files that changed shape since: the rows named
    if resized:
        raise OptionsError(resized)
    return folder


def ended_run_note(options, run_id: str, world_size: int, report=None) -> str | None:
    """For a ``--resume`` of a run that has ended (``nothing_to_train``): what rank 0 says, after the refusals of
    ``refuse_early`` (OptionsError); None for every other resume. Every rank asks it before the folders' locks: it
    only reads, and a rank that found nothing to train ends before any lock is taken (nor waits for one). The
    checkpoint the resume names is looked at first without its files' digests, so another resume pays nothing."""
    from diffsynth_mbc.training.checkpoints.folder import complete_checkpoints

    if options.resume == "latest":
        found = complete_checkpoints(options.checkpoint_dir)
        named = found[-1][1] if found else None
    else:
        named = Path(options.resume)
    if nothing_to_train(options, named) is None:
        return None
    return nothing_to_train(options, refuse_early(options, run_id, world_size, report=report))


def nothing_to_train(options, folder: Path | None) -> str | None:
    """What a resume says that has nothing to train, else None: its checkpoint ``folder`` is the run's end (every
    epoch trained, or ``--early_stop``'s count reached under this run's N) and ``lora.safetensors`` was written at
    that step by that run. Such a resume writes nothing (status, history and LoRA files stay as the run left them).
    A run that ended before it wrote its LoRA is not ended: its resume finishes it (``recipe.finish``)."""
    from diffsynth_mbc.training.checkpoints.state import component_states
    from diffsynth_mbc.training.components.best_lora import stopped_note
    from diffsynth_mbc.training.lora.read import file_metadata_of

    manifest = read_manifest(folder) if folder is not None else None
    if manifest is None:
        return None
    step, lora = manifest["step"], Path(options.output_path) / "lora.safetensors"
    written = file_metadata_of(lora)
    if written.get("step") != str(step) or written.get("run_id") != manifest.get("run_id"):
        return None
    unchanged = "; nothing was written (its files are as it left them)"
    stopped = stopped_note(options, component_states(manifest, 0).get("best_lora"), step)
    if stopped:
        return stopped + unchanged
    epoch = manifest.get("epoch")
    if isinstance(epoch, int) and epoch >= options.num_epochs:
        return (f"this run finished at step {step} ({options.num_epochs} of {options.num_epochs} epochs): nothing "
                f"more to train{unchanged}. To train on from its LoRA: a new run with --init_lora {lora}")
    return None


def early_fingerprint(options, world_size: int) -> dict:
    """This run's fingerprint as far as options and files tell it (``KNOWN_LATE`` left as placeholders)."""
    from diffsynth_mbc.data.cache.index import file_sha256
    from diffsynth_mbc.training.plan.step_plan import plan_from_options

    image_batch = plan_from_options(options, rows=0, images=0, world_size=world_size).image_batch_size
    return run_fingerprint(options, world_size=world_size, accumulation=options.gradient_accumulation_steps, rows=0,
                           metadata_sha256=file_sha256(options.dataset_metadata_path), image_batch=image_batch,
                           precision="")


def claim_checkpoint_folder(checkpoints, options, status, accelerator) -> None:
    """A fresh run's checkpoint and output folders: another run's files there are refused, or set aside with
    ``--start_over``."""
    from diffsynth_mbc.training.checkpoints.owner import claim_folder

    try:
        claim_folder(checkpoints.root, options.output_path, status.state["run_id"], options.start_over, accelerator,
                     status, options.log_dir)
    except ValueError as exc:
        raise OptionsError(str(exc)) from None


def resume(checkpoints, options, status, accelerator):
    """Restores weights, optimizer, scheduler and the RNG of every rank, and the data position; the run's id, clock
    and history go on from the checkpoint's step. Returns (the position, each component's saved state)."""
    position, states = checkpoints.load(options.resume)
    if accelerator.is_main_process:   # a damaged folder past the checkpoint would block saving that step again
        for moved in set_aside_unreadable(checkpoints.root, position.step):
            print(f"note: {moved.name[len('damaged-'):]} had no readable checkpoint.json: moved aside to {moved}",
                  file=sys.stderr)
    wait_for_everyone(accelerator, status, "rank 0 setting unreadable checkpoint folders aside")
    kept = truncate_history(status.history_file, position.step)
    status.elapsed_before_s = position.elapsed_s
    lineage = {"checkpoint": position.checkpoint, "step": position.step, "run_id": position.run_id}
    if position.run_id and position.run_id != status.state["run_id"]:   # fell back to another run's checkpoint
        status.update(run_id=position.run_id)
    status.update(phase=f"resumed from {position.checkpoint} of run {status.state['run_id']} "
                        f"(history: {kept} lines kept)", resumed_from=lineage, samples_seen=position.samples_seen)
    return position, states
