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
from diffsynth_mbc.run_layout import CHECKPOINT_MANIFEST, DAMAGED_PREFIX, FINAL_LORA
from diffsynth_mbc.training.checkpoints.fingerprint import FINGERPRINT_KEYS, fingerprint_differences, run_fingerprint
from diffsynth_mbc.training.checkpoints.folder import read_manifest, resolve_resume, set_aside_unreadable
from diffsynth_mbc.training.checkpoints.row_sizes import changes_since, media_now, resume_refusal, rows_of
from diffsynth_mbc.training.checkpoints.state import truncate_history
from diffsynth_mbc.training.distributed.collectives import wait_for_everyone

# Settings only the prepared accelerator knows (the precision "auto" chooses and the fp32 residual stream chosen for
# it, DeepSpeed's accumulation) or only the opened dataset (its rows): compared when the checkpoint loads, not before.
KNOWN_LATE = ("mixed_precision", "gradient_accumulation_steps", "metadata_rows", "fp32_residual")


def refuse_early(options, run_id: str, world_size: int, report=None) -> Path | None:
    """OptionsError for what the files alone refuse: a ``--resume`` without an intact checkpoint, or with other
    settings or media than the checkpoint's (``--force_resume`` aside; every row that changed named at once); a
    fresh run on folders holding another run's checkpoints or LoRA files without ``--start_over``; a run whose
    missing media files alone would stop it past ``--max_bad_media_fraction``. Returns the checkpoint folder a resume
    goes on from."""
    from diffsynth_mbc.training.checkpoints.owner import check_claim

    folder = None
    try:
        if options.resume:
            folder = resolve_resume(options.resume, options.checkpoint_dir, world_size, report=report)
        else:
            check_claim(options.checkpoint_dir, options.output_path, run_id, options.start_over, options.log_dir)
    except ValueError as exc:
        raise OptionsError(str(exc)) from None
    manifest = (read_manifest(folder) or {}) if folder else {}
    compare = bool(folder) and not options.force_resume   # the checkpoint's rows and sizes with these
    rows = rows_of(options)
    now = media_now(options, rows, with_sizes=compare) if rows is not None else None
    missing_media = too_many_missing(options, rows, now, manifest)
    if compare:
        refusal = other_checkpoint(options, world_size, folder, manifest, now, missing_media)
        if refusal:
            raise OptionsError(refusal)
    if missing_media:
        raise OptionsError(f"{missing_media}. Nothing was trained or written.")
    return folder


def other_checkpoint(options, world_size: int, folder, manifest: dict, now, missing_media: str | None) -> str | None:
    """The refusal of resuming ``folder`` with other settings or media (``KNOWN_LATE`` aside), None when it matches."""
    try:
        current = early_fingerprint(options, world_size)
    except OSError:   # the metadata cannot be read: opening the dataset says so, naming the file
        return None
    keys = [key for key in FINGERPRINT_KEYS if key not in KNOWN_LATE]
    differences = fingerprint_differences(manifest.get("fingerprint", {}), current, keys)
    return resume_refusal(folder, differences, changes_since(folder, manifest, now), now, missing_media)


def too_many_missing(options, rows: list[dict] | None, now, manifest: dict) -> str | None:
    """``missing_media_refusal`` for this run: each row's samples per epoch from the repeats, the samples to come
    from ``--num_epochs`` less those a resumed checkpoint's ranks have seen."""
    from diffsynth_mbc.data.dataset_list import row_repeats
    from diffsynth_mbc.training.components.guards import missing_media_refusal

    if now is None or not now.missing:
        return None
    catalogues = row_repeats(options.datasets, [int(row.get("dataset") or 0) for row in rows]) if options.datasets \
        else None
    draws = [options.dataset_repeat * (catalogues[index] if catalogues else 1) for index in range(len(rows))]
    seen = sum(int(rank.get("samples_seen") or 0) for rank in manifest.get("per_rank") or [] if isinstance(rank, dict))
    return missing_media_refusal([(number, now.videos[number - 1]) for number in now.missing], draws,
                                 max(0, sum(draws) * options.num_epochs - seen), options.max_bad_media_fraction)


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
    step, lora = manifest["step"], Path(options.output_path) / FINAL_LORA
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
            print(f"note: {moved.name.removeprefix(DAMAGED_PREFIX)} had no readable {CHECKPOINT_MANIFEST}: moved aside "
                  f"to {moved}", file=sys.stderr)
    wait_for_everyone(accelerator, status, "rank 0 setting unreadable checkpoint folders aside")
    kept = truncate_history(status.history_file, position.step)
    status.elapsed_before_s = position.elapsed_s
    lineage = {"checkpoint": position.checkpoint, "step": position.step, "run_id": position.run_id}
    if position.run_id and position.run_id != status.state["run_id"]:   # fell back to another run's checkpoint
        status.update(run_id=position.run_id)
    status.update(phase=f"resumed from {position.checkpoint} of run {status.state['run_id']} "
                        f"(history: {kept} lines kept)", resumed_from=lineage, samples_seen=position.samples_seen)
    return position, states


def go_on_with_this_plan(parts, position) -> int:
    """After a forced resume: where this run's plan takes the checkpoint's ``position``, said once; the run's last
    step (its status, ETA and learning-rate schedule end there: where that plan really ends)."""
    from diffsynth_mbc.training.checkpoints.fingerprint import schedule_to
    from diffsynth_mbc.training.plan.step_plan import end_step

    options = parts.options
    batches = len(parts.loader)
    planned = parts.total_steps
    last = end_step(position.step, position.epoch, position.batches_in_epoch, batches,
                    parts.accelerator.gradient_accumulation_steps, options.num_epochs)
    if last != planned:
        schedule_to(parts.scheduler, options, last)
    if parts.accelerator.is_main_process:
        ends = (f"step {last}" if last == planned else
                f"step {last}, not this plan's {planned}: the checkpoint's {position.step} steps were counted "
                f"under its own plan (the learning-rate schedule ends at step {last} too)")
        steps = f"{parts.steps_per_epoch} step{'s' if parts.steps_per_epoch != 1 else ''}"
        print(f"the run now uses this run's settings and media: {steps} per epoch ({batches} "
              f"batches per GPU) x {options.num_epochs} epochs; from the checkpoint's step {position.step} (epoch "
              f"{position.epoch + 1}, batch {position.batches_in_epoch}) it goes on to {ends}", file=sys.stderr)
    return last
