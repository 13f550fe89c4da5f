"""Checkpoints, in one home: folder naming, ``latest``, pruning, fingerprint checks (pure, no torch), and
``Checkpoints``, which saves and resumes the whole training state through accelerate (torch imported
inside its methods, so the rest of this module imports without torch).

A checkpoint is ``CHECKPOINTS/step-00001234/`` holding the LoRA (``lora.safetensors``, loadable by
DiffSynth), accelerate's saved state (optimizer, LR scheduler, RNG state of every rank), the components' files
(``training/components/protocol.py``: the EMA's ``ema_state.safetensors``) and ``checkpoint.json`` (step, epoch,
data position, configuration fingerprint, each component's state under its name: ``components``, and each rank's
in ``per_rank``). It is written as
``.tmp-step-00001234.<run id>/`` and renamed when complete, so a crash mid-save leaves only a temp folder,
which is never picked as ``latest`` and is removed by the next save. A folder with a ``KEEP`` file
is never pruned.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from diffsynth_mbc import environment
from diffsynth_mbc.atomic import atomic_write_text
from diffsynth_mbc.run_layout import (
    CHECKPOINT_LORA,
    CHECKPOINT_MANIFEST,
    DEFAULT_CHECKPOINTS_FOLDER,
    KEEP_MARKER,
    SCALER_FILE,
    TEMP_PREFIX,
    checkpoint_folder_name,
    published_name,
)
from diffsynth_mbc.errors import OptionsError
from diffsynth_mbc.training.checkpoints.fingerprint import (apply_run_settings, fingerprint_differences,
                                                             hardware_changes, sharded_optimizer_refusal)
from diffsynth_mbc.training.checkpoints.folder import (
    complete_checkpoints,
    find_latest,
    resolve_resume,
    temp_path,
)
from diffsynth_mbc.training.checkpoints.integrity import inventory, missing_rank_files
from diffsynth_mbc.training.checkpoints.row_sizes import (MediaNow, changes_since, resume_refusal, sizes_digest,
                                                          write_row_sizes)
from diffsynth_mbc.training.checkpoints.space import CheckpointWriteError, folder_bytes, free_bytes, write_failure
from diffsynth_mbc.training.distributed.accelerator import unwrapped_model
from diffsynth_mbc.training.distributed.collectives import broadcast_from_main, gather_from_all, wait_for_everyone
from diffsynth_mbc.training.lora.saved_files import LoraFiles
from diffsynth_mbc.training.lora.variants import check_adapter_shape
from diffsynth_mbc.training.reporting.status_writer import RankStatusWriter

# Fault injection for tests: every checkpoint save takes this many seconds longer on every rank (a slow shared
# filesystem), to show on a real run that step times and the ETA keep checkpoints apart. Unset in normal use.


def publish(temp_folder: Path, manifest: dict) -> Path:
    """Write the manifest last, then rename the temp folder into place. Returns the final folder."""
    atomic_write_text(temp_folder / CHECKPOINT_MANIFEST, json.dumps(manifest, indent=2, ensure_ascii=False) + "\n")
    final = temp_folder.with_name(published_name(temp_folder.name))
    if final.exists():
        from diffsynth_mbc.training.checkpoints.owner import check_replaceable

        check_replaceable(final, manifest.get("run_id"))   # never replace a folder another run wrote
        shutil.rmtree(final)
    os.replace(temp_folder, final)
    return final


def prune(root: str | Path, keep_last: int, run_id: str | None = None) -> list[Path]:
    """Remove complete checkpoints beyond the newest ``keep_last`` (never a KEEP one, and with ``run_id`` only
    that run's own) and stale temp folders."""
    from diffsynth_mbc.training.checkpoints.owner import owner

    root = Path(root)
    removed = []
    checkpoints = [(step, folder) for step, folder in complete_checkpoints(root)
                   if run_id is None or owner(folder) == run_id]
    for _step, folder in checkpoints[:max(0, len(checkpoints) - keep_last)]:
        if not (folder / KEEP_MARKER).exists():
            shutil.rmtree(folder, ignore_errors=True)
            removed.append(folder)
    for entry in root.iterdir() if root.is_dir() else ():
        if entry.name.startswith(TEMP_PREFIX) and entry.is_dir():
            shutil.rmtree(entry, ignore_errors=True)
            removed.append(entry)
    return removed


def truncate_history(path: str | Path, last_step: int) -> int:
    """Keep the JSONL lines up to ``last_step`` (a resumed run repeats what came after); returns lines kept."""
    path = Path(path)
    if not path.exists():
        return 0
    kept = []
    with open(path, encoding="utf-8") as handle:
        for line in handle:
            try:
                record = json.loads(line)
            except ValueError:
                continue  # a torn last line from a killed process
            if isinstance(record, dict) and isinstance(record.get("step"), int) and record["step"] <= last_step:
                kept.append(json.dumps(record, ensure_ascii=False) + "\n")
    atomic_write_text(path, "".join(kept))
    return len(kept)


@dataclass
class Position:
    """Where the run is; saved in every checkpoint (each component's own state beside it, under its name)."""
    step: int = 0
    epoch: int = 0
    batches_in_epoch: int = 0   # batches of ``epoch`` already consumed (a multiple of the accumulation)
    samples_seen: int = 0       # this rank's, including replaced bad files
    run_id: str | None = None   # the run a resumed position came from (its run id goes on)
    elapsed_s: float = 0.0      # training time before this position, so a resumed run's clock goes on
    checkpoint: str = ""        # the checkpoint folder it was loaded from
    world_size: int = 0         # the processes that wrote that checkpoint (0: a fresh run)
    # The parts of ``epoch`` trained on other numbers of processes before this run's, as [processes, batches per
    # process] (training/plan/elastic.py): the epoch goes on over what they left.
    epoch_before: list = field(default_factory=list)
    schedule: dict | None = None   # the schedules' state in that checkpoint (training/plan/schedule.py), if it kept it


def vanished_rank_states(manifest: dict, world_size: int) -> list[dict[str, dict]]:
    """The component states of the checkpoint's ranks this run of ``world_size`` ranks does not have (a resume on
    fewer processes), for rank 0 to take over (``Component.take_over``)."""
    saved = len(manifest.get("per_rank") or [])
    return [component_states(manifest, rank) for rank in range(world_size, saved)]


def component_states(manifest: dict, rank: int) -> dict[str, dict]:
    """Each component's saved state (``components``), with this rank's own for the per-rank ones; a checkpoint
    written before the training had components keeps the same states elsewhere: the best validation and the early
    stop's count as ``best_so_far``, each rank's bad media beside its counters in ``per_rank``."""
    per_rank = manifest.get("per_rank") or []
    mine = per_rank[rank] if rank < len(per_rank) and isinstance(per_rank[rank], dict) else {}
    if "components" in manifest:
        return {**(manifest.get("components") or {}), **(mine.get("components") or {})}
    states = {"bad_media": {"skipped_samples": mine.get("skipped_samples", 0),
                            "recent_skips": mine.get("recent_skips", []), "replaced": mine.get("replaced", {})}}
    if manifest.get("best_so_far"):
        states["best_lora"] = manifest["best_so_far"]
    return states


def _attempt(write) -> str | None:
    """Run ``write``; None, or what went wrong (a string every rank can be told)."""
    try:
        write()
    except Exception as exc:  # noqa: BLE001 - a failed write on one rank: gathered, said, raised on every rank
        return f"{type(exc).__name__}: {exc}"
    return None


def injected_checkpoint_delay_s(value: str | None, rank: int) -> float:
    """The fault ``MBC_FAULT_SLOW_CHECKPOINT_S``: SECONDS added to every rank's checkpoint saves, or RANK:SECONDS
    to that rank's only (the others then wait for it in the save's collectives)."""
    if not value:
        return 0.0
    only, _, seconds = value.rpartition(":")
    return float(seconds) if not only or int(only) == rank else 0.0


class Checkpoints(LoraFiles):
    """Saving and loading the full training state through accelerate, with only the LoRA weights.

    accelerate's ``save_state`` would write the whole 5B DiT; a pre-hook keeps only the trainable
    (LoRA) tensors for DDP, and DeepSpeed is asked to exclude frozen parameters.
    """

    def __init__(self, accelerator, module, scheduler, options, status: RankStatusWriter, fingerprint: dict,
                 sized_rows: list | None = None, ema=None, schedule=None):
        from accelerate.utils import DistributedType

        self.accelerator = accelerator
        self.module = module
        self.scheduler = scheduler
        self.schedule = schedule   # the StepSchedule its learning rate follows: where it stands goes in the manifest
        self.options = options
        self.status = status
        self.fingerprint = fingerprint
        self.sized_rows = sized_rows   # (video, size or None) of every row (none from a cache): a resume compares
        self.sizes_digest = sizes_digest(sized_rows) if options.buckets == "aspect" else None
        self.missing_rows = self.rows_without_files() if sized_rows is not None else None
        self.ema = ema   # the run's LoraEma: its twin beside every LoRA file (``LoraFiles``)
        self.root = Path(options.checkpoint_dir or Path(options.output_path) / DEFAULT_CHECKPOINTS_FOLDER)
        self.deepspeed = accelerator.distributed_type == DistributedType.DEEPSPEED
        self.last_step = None
        self.injected_delay_s = injected_checkpoint_delay_s(os.environ.get(environment.FAULT_SLOW_CHECKPOINT_S),
                                                            accelerator.process_index)
        unwrapped = unwrapped_model(accelerator, module)
        trainable = {name for name, parameter in unwrapped.named_parameters() if parameter.requires_grad}

        def keep_only_trainable(models, weights, output_dir):
            for index, state in enumerate(weights):
                weights[index] = {key: value for key, value in state.items()
                                  if key in trainable or key.removeprefix("module.") in trainable}

        accelerator.register_save_state_pre_hook(keep_only_trainable)
        accelerator.register_for_checkpointing(scheduler)

    def rows_without_files(self) -> list[int]:
        """The 1-based rows whose file is not there, as rank 0 finds them (every rank takes rank 0's)."""
        from diffsynth_mbc.data.media.size_table import first_rank_reads
        from diffsynth_mbc.data.metadata_csv import missing_files

        return first_rank_reads(
            lambda: missing_files([{"video": video} for video, _ in self.sized_rows], self.options.dataset_base_path),
            self.accelerator.is_main_process, lambda value: broadcast_from_main(
                self.accelerator, value, self.status, "rank 0 looking for the media files"))

    def media_now(self) -> MediaNow | None:
        """This run's rows and files (the dataset's, rank 0's sizes) as a resume compares them; None from a cache."""
        if self.sized_rows is None:
            return None
        sizes = [size for _, size in self.sized_rows] if self.options.buckets == "aspect" else None
        return MediaNow([video for video, _ in self.sized_rows], sizes, self.missing_rows, [],
                        self.options.dataset_base_path)

    # -- full training state --------------------------------------------------------------------
    def save(self, position: Position, components=()) -> Path:
        """Every rank's state into a temp folder, then rank 0 adds the LoRA and manifest and renames it into place.
        A write that fails on any rank (a full disk) stops every rank with one message naming the folder and the
        space needed; the partial folder is removed and the previous checkpoints stay (CheckpointWriteError)."""
        accelerator = self.accelerator
        name = checkpoint_folder_name(position.step)
        self.status.update(phase=f"saving checkpoint {name}")
        others = f"ranks saving checkpoint {name}"   # a rank blocked in a collective says so (a hung one does not)
        # Named by run and step, so no rank ever deletes a folder another rank is writing into;
        # folders left by killed saves are removed by prune() after the next successful one.
        temporary = temp_path(self.root, position.step, self.status.state["run_id"])
        # Checked before anything is written: a broken LoRA never becomes a checkpoint, nor prunes a good one.
        file_tensors = self.checked_file_tensors(self.lora_tensors(), self.root / name, others)
        error = _attempt(lambda: temporary.mkdir(parents=True, exist_ok=True))
        wait_for_everyone(accelerator, self.status, others)
        extra = {"exclude_frozen_parameters": True} if self.deepspeed else {}
        error = error or _attempt(lambda: accelerator.save_state(str(temporary), **extra))
        time.sleep(self.injected_delay_s)
        errors = [error for error in gather_from_all(accelerator, error, self.status, others) if error]
        if errors:
            message = self.failure_message(name, temporary, errors[0]) if accelerator.is_main_process else None
            raise CheckpointWriteError(broadcast_from_main(accelerator, message, self.status, others))
        final = self.root / name
        per_rank = self.gather_positions(position, components, others)
        problem = failure = None
        if accelerator.is_main_process:
            try:
                problem = self.publish_state(temporary, position, per_rank, file_tensors, components)
            except Exception as exc:  # noqa: BLE001 - a failed write (full disk): said with the folder, then raised
                failure = self.failure_message(name, temporary, exc)
        problem, failure = broadcast_from_main(accelerator, (problem, failure), self.status, others)
        if failure:
            raise CheckpointWriteError(failure)
        if problem:
            raise RuntimeError(problem)
        wait_for_everyone(accelerator, self.status, others)
        self.last_step = position.step
        self.status.update(phase=f"saved checkpoint {name}", last_checkpoint=str(final),
                           last_checkpoint_step=position.step)
        return final

    def publish_state(self, temporary: Path, position: Position, per_rank: list, file_tensors: dict,
                      components=()) -> str | None:
        """Rank 0: the LoRA file, the components' files, the manifest, the rename, pruning. Returns why it was not
        published, or None."""
        name = checkpoint_folder_name(position.step)
        self.write_lora(temporary / CHECKPOINT_LORA, position.step, file_tensors)
        for component in components:
            component.save_files(temporary)
        if self.sized_rows is not None:
            write_row_sizes(temporary, self.sized_rows, self.missing_rows)
        files = inventory(temporary)
        missing = missing_rank_files(files, self.accelerator.num_processes)
        if missing:   # published only when every rank's state is in it
            return (f"checkpoint {name} is incomplete: {temporary / missing[0]} was not written (that rank "
                    f"saved elsewhere?); {self.root} must be one folder shared by every node. Not published.")
        publish(temporary, {
            "step": position.step, "epoch": position.epoch, "batches_in_epoch": position.batches_in_epoch,
            "samples_seen": position.samples_seen, "run_id": self.status.state["run_id"], "created_at": time.time(),
            "elapsed_s": self.status.state.get("elapsed_s") or 0.0,
            "fingerprint": self.fingerprint, "per_rank": per_rank,
            "components": {component.name: state for component in components if not component.per_rank
                           and (state := component.state_dict()) is not None},
            "world_size": self.accelerator.num_processes, "epoch_before": position.epoch_before,
            "schedule": self.schedule.state_dict() if self.schedule is not None else None,
            "files": files, "row_sizes_sha256": self.sizes_digest})
        prune(self.root, self.options.keep_checkpoints, self.status.state["run_id"])
        return None

    def failure_message(self, name: str, temporary: Path, error) -> str:
        """Rank 0, after a failed write: remove the partial folder, then say why (free space measured after)."""
        written = folder_bytes(temporary)
        shutil.rmtree(temporary, ignore_errors=True)
        previous = find_latest(self.root)
        model = unwrapped_model(self.accelerator, self.module)
        trainable = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
        # The previous checkpoint's size, else the LoRA weights, AdamW's two moments and the LoRA file.
        needed = folder_bytes(previous) or max(written, 4 * trainable)
        return write_failure(name, self.root, error, free=free_bytes(self.root), needed=needed, previous=previous)

    def verify_lora(self, path: Path) -> None:
        """strict=False loads nothing silently if names drift: check every LoRA tensor arrived."""
        import torch
        from safetensors.torch import load_file

        expected = load_file(str(path))
        loaded = self.file_tensors(self.lora_tensors())
        wrong = sorted(key for key in expected if key not in loaded or not torch.equal(
            loaded[key].to(expected[key].dtype), expected[key]))
        if wrong or not expected:
            raise RuntimeError(f"resuming from {path.parent}: {len(wrong)} of {len(expected)} LoRA tensors were not "
                               f"restored (first: {wrong[:1]})")

    def gather_positions(self, position: Position, components, what: str) -> list:
        """Every rank's own counters and per-rank components' states (collective: all ranks call it, each waiting as
        ``what``)."""
        mine = {component.name: component.state_dict() for component in components if component.per_rank}
        return gather_from_all(self.accelerator, {"samples_seen": position.samples_seen, "components": mine},
                               self.status, what)

    def load(self, resume: str) -> tuple[Position, dict[str, dict], list[dict[str, dict]]]:
        """The checkpoint ``resume`` names, loaded (weights, optimizer, scheduler, every rank's RNG): where it was,
        each component's state (``component_states``), and on rank 0 of a run of fewer processes, the states of the
        ranks it no longer has (``vanished_rank_states``; their samples count as rank 0's)."""
        try:
            folder = resolve_resume(resume, self.root,
                                    report=lambda message: print(f"[rank {self.accelerator.process_index}] "
                                                                 f"{message}", file=sys.stderr))
        except ValueError as exc:
            raise OptionsError(str(exc)) from None
        manifest = json.loads((folder / CHECKPOINT_MANIFEST).read_text(encoding="utf-8"))
        differences = fingerprint_differences(manifest.get("fingerprint", {}), self.fingerprint)
        check_adapter_shape(manifest.get("fingerprint", {}), self.fingerprint)   # DoRA / LoRA+ on or off
        now = self.media_now()
        changes = changes_since(folder, manifest, now)   # rows that changed size, vanished, left or are new
        refusal = resume_refusal(folder, differences, changes, now)
        if refusal and not self.options.force_resume:
            raise OptionsError(refusal)
        saved_world = int(manifest.get("world_size") or self.accelerator.num_processes)
        sharded = sharded_optimizer_refusal(folder, manifest, self.accelerator.num_processes)
        if sharded:
            raise OptionsError(sharded)
        self.status.update(phase=f"loading checkpoint {folder.name}")
        self.load_state(folder)
        self.verify_lora(folder / CHECKPOINT_LORA)
        changed = hardware_changes(manifest.get("fingerprint", {}), self.fingerprint)
        if changed and self.accelerator.is_main_process:   # other GPUs, nodes or precision: said once
            print(f"resuming from {folder} on other hardware:\n  " + "\n  ".join(changed), file=sys.stderr)
        self.last_step = manifest["step"]   # this step has its checkpoint: finishing here saves none again
        if differences or changes:   # --force_resume: this run's settings and media, not the saved ones, said
            applied = apply_run_settings(self.scheduler, self.options) if differences else []
            if self.accelerator.is_main_process:
                print(f"resuming from {folder} with --force_resume true despite:\n  " + "\n  ".join(
                    differences + changes) + ("\nthe optimizer now uses this run's " + ", ".join(applied)
                                              if applied else ""), file=sys.stderr)
            self.status.update(resumed_with_changes=differences + changes)
        rank, here = self.accelerator.process_index, self.accelerator.num_processes
        rank_state = [state if isinstance(state, dict) else {} for state in manifest.get("per_rank") or []]
        samples = [state.get("samples_seen", 0) for state in rank_state]
        mine = samples[rank] if rank < len(samples) else 0
        if rank == 0:   # the ranks this run does not have: rank 0 counts their samples and takes their states
            mine += sum(samples[here:])
        position = Position(step=manifest["step"], epoch=manifest["epoch"],
                            batches_in_epoch=manifest["batches_in_epoch"], samples_seen=mine,
                            run_id=manifest.get("run_id"), elapsed_s=float(manifest.get("elapsed_s") or 0.0),
                            checkpoint=folder.name, world_size=saved_world,
                            epoch_before=[list(part) for part in manifest.get("epoch_before") or []],
                            schedule=manifest.get("schedule"))
        return position, component_states(manifest, rank), vanished_rank_states(manifest, here) if rank == 0 else []

    def load_state(self, folder: Path) -> None:
        """accelerate's state of ``folder`` into this run: weights, optimizer, scheduler, this rank's RNG (a rank the
        checkpoint did not have keeps its own seed). A loss scaler (fp16) starts fresh when the checkpoint was saved
        without one (bf16 or fp32), said once; a checkpoint's scaler is left aside by a run without one."""
        accelerator, scaler = self.accelerator, self.accelerator.scaler
        fresh_scaler = scaler is not None and not (folder / SCALER_FILE).exists()
        if fresh_scaler:
            accelerator.scaler = None   # accelerate would read the missing file
            if accelerator.is_main_process:
                print(f"note: {folder} holds no loss scaler (it was saved without fp16): the loss scaler starts fresh",
                      file=sys.stderr)
        try:
            if self.deepspeed:
                accelerator.load_state(str(folder), load_module_strict=False)
            else:
                accelerator.load_state(str(folder), strict=False)
        finally:
            accelerator.scaler = scaler
