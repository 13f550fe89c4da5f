"""How a run starts on its checkpoint folder: ``resume`` goes on from a checkpoint as the same run (weights,
optimizer, scheduler, every rank's RNG, data position, run id, clock, history); a fresh run first claims the
folder (another run's checkpoints and LoRA files there are refused, or set aside with --start_over).

``refuse_early`` makes every refusal that needs only files before anything is loaded or written: a refused
``--resume`` or a fresh run on another run's folders leaves every file as it was (the status files of a finished
run still say finished). ``nothing_to_train`` likewise: a resume of a run that has ended (finished, or stopped
early) trains nothing and writes nothing."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

from diffsynth_mbc.atomic import write_json_even_when_full
from diffsynth_mbc.errors import OptionsError
from diffsynth_mbc.run_files import STATUS_RETIRED
from diffsynth_mbc.run_layout import CHECKPOINT_MANIFEST, DAMAGED_PREFIX, FINAL_LORA, history_path, status_path
from diffsynth_mbc.training.checkpoints.fingerprint import (COMPARED_KEYS, fingerprint_differences, run_fingerprint,
                                                             sharded_optimizer_refusal)
from diffsynth_mbc.training.checkpoints.folder import read_manifest, resolve_resume, set_aside_unreadable
from diffsynth_mbc.training.checkpoints.row_sizes import changes_since, media_now, resume_refusal, rows_of
from diffsynth_mbc.training.checkpoints.state import truncate_history
from diffsynth_mbc.training.distributed.collectives import wait_for_everyone
from diffsynth_mbc.training.plan.elastic import EpochSteps, ceil_div

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
            folder = resolve_resume(options.resume, options.checkpoint_dir, report=report)
        else:
            check_claim(options.checkpoint_dir, options.output_path, run_id, options.start_over, options.log_dir)
    except ValueError as exc:
        raise OptionsError(str(exc)) from None
    manifest = (read_manifest(folder) or {}) if folder else {}
    sharded = sharded_optimizer_refusal(folder, manifest, world_size) if folder else None
    if sharded:
        raise OptionsError(sharded)
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
    keys = [key for key in COMPARED_KEYS if key not in KNOWN_LATE]
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
    and history go on from the checkpoint's step. Returns (the position, each component's saved state, the states of
    the checkpoint's ranks this run does not have: rank 0's to take over). The files of those ranks are closed at
    the checkpoint's step (``retire_ranks``)."""
    position, states, vanished = checkpoints.load(options.resume)
    if accelerator.is_main_process:   # a damaged folder past the checkpoint would block saving that step again
        for moved in set_aside_unreadable(checkpoints.root, position.step):
            print(f"note: {moved.name.removeprefix(DAMAGED_PREFIX)} had no readable {CHECKPOINT_MANIFEST}: moved aside "
                  f"to {moved}", file=sys.stderr)
        retire_ranks(status.log_dir, range(accelerator.num_processes, position.world_size), position.step,
                     accelerator.num_processes)
    wait_for_everyone(accelerator, status, "rank 0 setting unreadable checkpoint folders aside")
    kept = truncate_history(status.history_file, position.step)
    status.elapsed_before_s = position.elapsed_s
    lineage = {"checkpoint": position.checkpoint, "step": position.step, "run_id": position.run_id}
    if position.run_id and position.run_id != status.state["run_id"]:   # fell back to another run's checkpoint
        status.update(run_id=position.run_id)
    status.update(phase=f"resumed from {position.checkpoint} of run {status.state['run_id']} "
                        f"(history: {kept} lines kept)", resumed_from=lineage, samples_seen=position.samples_seen)
    return position, states, vanished


def go_on(parts, position) -> EpochSteps:
    """Where the run goes on from the checkpoint's ``position``: the epoch it was in (what is left of it, when it was
    trained on another number of processes), the schedules' state, and the steps of every epoch from here
    (returned). On another number of processes (``training/plan/elastic.py``) the epoch's rest is shared out over
    this run's, the steps counted again and the schedules spread over them, said once; after a forced resume whose
    plan changed, this run's plan goes on from the checkpoint's step (``go_on_with_this_plan``)."""
    accelerator, options, batches, schedule = parts.accelerator, parts.options, parts.batches, parts.schedule
    here, saved = accelerator.num_processes, position.world_size or accelerator.num_processes
    accumulation = accelerator.gradient_accumulation_steps
    before = [tuple(part) for part in position.epoch_before]
    if position.schedule:
        schedule.load_state_dict(position.schedule)
    elif saved != here:   # saved before checkpoints kept their schedule: it ran over that run's plan
        schedule.end_at(ceil_div(batches.rank_batches(position.epoch, saved), accumulation) * options.num_epochs)
    moved = saved != here and position.epoch < options.num_epochs
    if moved:
        left_before = ceil_div(batches.rank_batches(position.epoch, saved, before) - position.batches_in_epoch,
                               accumulation)
        if before or position.batches_in_epoch:
            before.append((saved, position.batches_in_epoch))
        position.batches_in_epoch = 0
    position.epoch_before = before
    if before:
        batches.go_on_after(position.epoch, before)
    steps = EpochSteps(position.step, position.epoch, position.batches_in_epoch,
                       batches.rank_batches(position.epoch, before=before), batches.rank_batches(position.epoch + 1),
                       accumulation)
    if moved:
        schedule.spread_from(position.step, steps.end_step(options.num_epochs))
        refresh_learning_rates(parts.scheduler)
        said_elsewhere(parts, position, steps, saved, left_before)
    elif parts.status.state.get("resumed_with_changes"):   # --force_resume on other settings or media
        go_on_with_this_plan(parts, position, steps)
    return steps


def said_elsewhere(parts, position, steps, saved: int, left_before: int) -> None:
    """A resume on another number of processes, in the status file (``resumed_elsewhere``); rank 0's terminal says
    it under the step plan (``recipe._start_reporting``)."""
    from diffsynth_mbc.training.plan.elastic import describe_resume_elsewhere

    options, accumulation = parts.options, parts.accelerator.gradient_accumulation_steps
    here = parts.accelerator.num_processes
    line = describe_resume_elsewhere(saved, here, steps, left_before,
                                     ceil_div(parts.batches.rank_batches(position.epoch + 1, saved), accumulation),
                                     options.num_epochs)
    parts.status.update(resumed_elsewhere={"step": position.step, "from_world_size": saved, "world_size": here,
                                           "end_step": steps.end_step(options.num_epochs), "said": line})


def go_on_with_this_plan(parts, position, steps) -> None:
    """After a forced resume: where this run's plan takes the checkpoint's ``position``, said once; the schedules
    end where that plan really ends (``steps``), not where the checkpoint's did."""
    options = parts.options
    batches, planned = steps.batches_per_epoch, parts.total_steps
    last = steps.end_step(options.num_epochs)
    parts.schedule.end_at(last)
    refresh_learning_rates(parts.scheduler)
    if parts.accelerator.is_main_process:
        ends = (f"step {last}" if last == planned else
                f"step {last}, not this plan's {planned}: the checkpoint's {position.step} steps were counted "
                f"under its own plan (the learning-rate schedule ends at step {last} too)")
        count = f"{parts.steps_per_epoch} step{'s' if parts.steps_per_epoch != 1 else ''}"
        print(f"the run now uses this run's settings and media: {count} per epoch ({batches} "
              f"batches per GPU) x {options.num_epochs} epochs; from the checkpoint's step {position.step} (epoch "
              f"{position.epoch + 1}, batch {position.batches_in_epoch}) it goes on to {ends}", file=sys.stderr)


def refresh_learning_rates(scheduler) -> None:
    """The optimizer's learning rates at the scheduler's step, from its (changed) schedule."""
    for base, group, factor in zip(scheduler.base_lrs, scheduler.optimizer.param_groups, scheduler.lr_lambdas):
        group["lr"] = base * factor(scheduler.last_epoch)
    scheduler._last_lr = [group["lr"] for group in scheduler.optimizer.param_groups]


def retire_ranks(log_dir: str | os.PathLike, ranks, step: int, world_size: int, wall_clock=time.time) -> list[int]:
    """After a resume on ``world_size`` processes at ``step``, the files of the checkpoint's ``ranks`` that this run
    does not have: each history cut at ``step`` (nothing of theirs past the checkpoint counts), each status file
    ``retired`` there. Rank 0 calls it. Returns the ranks whose status file it closed."""
    closed = []
    for rank in ranks:
        truncate_history(history_path(log_dir, rank), step)
        path = status_path(log_dir, rank)
        try:
            state = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue   # no readable status file: nothing to close
        if not isinstance(state, dict):
            continue
        gpus = f"{world_size} GPU{'s' if world_size != 1 else ''}"
        state.update(status=STATUS_RETIRED, step=min(int(state.get("step") or 0), step),
                     phase=f"retired at step {step}: the run went on from there on {gpus}", updated_at=wall_clock())
        write_json_even_when_full(path, state)
        closed.append(rank)
    return closed
