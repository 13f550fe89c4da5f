"""LoRA fine-tuning of Wan2.2-TI2V-5B through DiffSynth's own pipeline, loss and LoRA injection.

Started by ``accelerate launch`` (DDP, DeepSpeed ZeRO-2 and several nodes come from accelerate's
config), e.g. ``bash launchers/train_test.sh``. Every rank writes ``LOG_DIR/training_gpu{rank}.json``
from its first instant (status ``starting``), then ``loading``, ``training`` and finally
``finished``, ``failed`` (with the error) or ``stopped``.

Exit codes: 0 finished, or stopped cleanly by Ctrl-C/SIGTERM (the step finished and a checkpoint
was saved); 1 failed; 2 bad options, model files or checkpoint; 130/143 stopped by a signal before
training began, or by a second signal.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

from diffsynth_mbc import run_files
from diffsynth_mbc.atomic import atomic_save_safetensors
from diffsynth_mbc.training.checkpoints import (CheckpointSchedule, checkpoint_name, fingerprint_differences, prune, publish,
                          resolve_resume, temp_path, truncate_history)
from diffsynth_mbc.models.model_files import ModelFileError
from diffsynth_mbc.run_files import rank_from_environment
from diffsynth_mbc.training.status_writer import RankStatusWriter
from diffsynth_mbc.training.stop_signals import StopSignals, unblock_in_child
from diffsynth_mbc.errors import OptionsError
from diffsynth_mbc.training.options import resolve_options

BAD_MEDIA_ALLOWANCE = 10  # bad files tolerated before --max_bad_media_fraction applies
RECENT_SKIPS_SHOWN = 5


class TooMuchBadMedia(RuntimeError):
    pass


def default_run_id() -> str:
    """Same on every rank of one launch: the launcher exports MBC_RUN_ID; else derived from the rendezvous."""
    if os.environ.get("MBC_RUN_ID"):
        return os.environ["MBC_RUN_ID"]
    return f"run-{os.environ.get('MASTER_PORT', '0')}-{time.strftime('%Y%m%d-%H%M')}"


def main(argv: list[str] | None = None) -> int:
    rank, local_rank, world_size = rank_from_environment()
    try:
        options = resolve_options(argv)
    except OptionsError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    status = RankStatusWriter(options.log_dir, options.run_id or default_run_id(), rank, local_rank, world_size,
                              min_interval_s=options.status_interval_s, continue_history=bool(options.resume))
    signals = StopSignals(grace_s=options.stop_grace_s, on_stuck=lambda sig: status.set_status(
        run_files.STATUS_STOPPED, phase=f"stopped by signal {sig} while in: {status.state['phase']}"))
    signals.install()
    try:
        train(options, status, signals)
        return 0
    except KeyboardInterrupt:
        status.set_status(run_files.STATUS_STOPPED, phase=f"stopped by signal {signals.received or 'SIGINT'} "
                                                          f"during: {status.state['phase']}")
        print(f"[rank {rank}] stopped", file=sys.stderr)
        return signals.exit_code
    except (ModelFileError, OptionsError) as exc:
        status.fail(exc)
        print(f"[rank {rank}] error: {exc}", file=sys.stderr)
        return 2
    except BaseException as exc:  # noqa: BLE001 - recorded, then reported as failure
        status.fail(exc)
        traceback.print_exc()
        print(f"[rank {rank}] failed: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    finally:
        signals.finished()
        status.close()


@dataclass
class Position:
    """Where the run is; saved in every checkpoint."""
    step: int = 0
    epoch: int = 0
    batches_in_epoch: int = 0   # batches of ``epoch`` already consumed (a multiple of the accumulation)
    samples_seen: int = 0       # this rank's, including replaced bad files
    skipped_samples: int = 0    # this rank's bad files
    recent_skips: list = field(default_factory=list)


def train(options, status: RankStatusWriter, signals: StopSignals) -> None:
    status.set_status(run_files.STATUS_LOADING, phase="importing torch and diffsynth")
    import dataclasses
    import datetime

    import torch
    from accelerate import Accelerator
    from accelerate.utils import DataLoaderConfiguration, DistributedDataParallelKwargs, InitProcessGroupKwargs

    from diffsynth_mbc.data.cache.index import file_sha256
    from diffsynth_mbc.data.cache.dataset import open_training_dataset
    from diffsynth_mbc.models.pipeline import build_demo_pipeline, load_pipeline
    from diffsynth_mbc.training.progress import ProgressLogger
    from diffsynth_mbc.training.step_plan import StepPlan, lr_factor, steps_from_loader
    from diffsynth_mbc.training.lora_module import WanTI2VLoraModule

    if options.model_dir and not options.demo:
        # Fail on a missing or broken file before any GPU memory is touched.
        from diffsynth_mbc.models.model_files import locate_model_files
        locate_model_files(options.model_dir)

    status.update(phase="joining the process group")
    handlers = [DistributedDataParallelKwargs(find_unused_parameters=options.find_unused_parameters)]
    if (status.state["world_size"] > 1 and not torch.cuda.is_available()
            and os.environ.get("ACCELERATE_USE_DEEPSPEED", "").lower() != "true"):
        # Without this, accelerate on a machine with no GPU shards the data over the processes but
        # wraps nothing in DDP: every rank would silently train a model of its own.
        os.environ.setdefault("ACCELERATE_USE_CPU", "1")
    if status.state["world_size"] > 1:
        # NCCL_TIMEOUT is not read by NCCL itself; it becomes the process group's timeout here.
        timeout = datetime.timedelta(seconds=int(os.environ.get("NCCL_TIMEOUT", "1800")))
        backend = options.dist_backend or ("nccl" if torch.cuda.is_available() else "gloo")
        handlers.append(InitProcessGroupKwargs(backend=backend, timeout=timeout))
    accelerator = Accelerator(
        gradient_accumulation_steps=options.gradient_accumulation_steps, kwargs_handlers=handlers,
        dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True, data_seed=options.seed))
    if accelerator.num_processes != status.state["world_size"]:
        status.update(world_size=accelerator.num_processes)
    from accelerate.utils import DistributedType
    if accelerator.num_processes > 1 and accelerator.distributed_type == DistributedType.NO:
        raise OptionsError(f"{accelerator.num_processes} processes were launched but accelerate set up no distributed "
                           "training, so gradients would never be averaged; check the accelerate config "
                           "(distributed_type) and that the GPUs are visible")
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(accelerator.mixed_precision, torch.float32)
    torch.manual_seed(options.seed)  # identical model init on every rank

    # The data first: a latent cache that does not match these options fails before any model loads.
    status.update(phase="reading metadata" + (f" and the latent cache {options.cache}" if options.cache else ""))
    dataset = open_training_dataset(options, substitute_bad_media=True)
    validator = Validator(options, status) if options.val_metadata_path else None

    encoders = not options.cache   # with the cache only the DiT (plus LoRA) is needed
    status.update(phase="loading models" + (" (demo: tiny random TI2V-5B architecture)" if options.demo else "")
                  + ("" if encoders else " (DiT only: training from the latent cache)"))
    if options.demo:
        pipe = build_demo_pipeline(device=str(accelerator.device), torch_dtype=torch.float32, seed=options.seed,
                                   tokenizer_dir=os.path.join(options.output_path, ".demo_tokenizer",
                                                              f"rank{accelerator.process_index}"),
                                   load_encoders=encoders)
    else:
        pipe = load_pipeline(options.model_dir, options.model_id, device=str(accelerator.device), torch_dtype=dtype,
                             load_encoders=encoders)
    module = WanTI2VLoraModule(
        pipe, lora_target_modules=options.lora_target_modules, lora_rank=options.lora_rank,
        lora_alpha=options.lora_alpha, use_gradient_checkpointing=options.use_gradient_checkpointing,
        use_gradient_checkpointing_offload=options.use_gradient_checkpointing_offload,
        max_timestep_boundary=options.max_timestep_boundary, min_timestep_boundary=options.min_timestep_boundary)

    plan = StepPlan(rows=dataset.rows, repeat=options.dataset_repeat, world_size=accelerator.num_processes,
                    batch_size=options.batch_size, gradient_accumulation=options.gradient_accumulation_steps,
                    num_epochs=options.num_epochs)
    if plan.rows == 0:
        raise ValueError(f"{options.dataset_metadata_path} has no rows to train on")
    workers = options.dataset_num_workers
    loader = torch.utils.data.DataLoader(
        dataset, batch_size=options.batch_size, shuffle=True, collate_fn=list, num_workers=workers,
        persistent_workers=workers > 0, prefetch_factor=2 if workers > 0 else None,
        worker_init_fn=unblock_in_child if workers > 0 else None,
        # Starting an iterator draws a seed; from the global RNG that would shift the noise of a
        # resumed run (which starts its iterator after restoring the RNG). Keep the two apart.
        generator=torch.Generator().manual_seed(options.seed))
    trainable = [p for p in module.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=options.learning_rate, weight_decay=options.weight_decay)

    status.update(phase="preparing (DDP / DeepSpeed)")
    module, optimizer, loader = accelerator.prepare(module, optimizer, loader)
    # What the loop will really do: DeepSpeed's config may override the accumulation we asked for.
    accumulation = accelerator.gradient_accumulation_steps
    if accumulation != options.gradient_accumulation_steps:
        print(f"[rank {accelerator.process_index}] note: gradient accumulation is {accumulation} (from the "
              f"DeepSpeed config), not --gradient_accumulation_steps {options.gradient_accumulation_steps}",
              file=sys.stderr)
        plan = dataclasses.replace(plan, gradient_accumulation=accumulation)
    steps_per_epoch, total_steps = steps_from_loader(len(loader), accumulation, options.num_epochs)
    if steps_per_epoch != plan.steps_per_epoch:
        print(f"[rank {accelerator.process_index}] note: the data loader gives {steps_per_epoch} steps/epoch, "
              f"the plan said {plan.steps_per_epoch}; using the data loader's", file=sys.stderr)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_factor(
        step, total_steps, options.warmup_steps, options.lr_scheduler))
    checkpoints = Checkpoints(accelerator, module, scheduler, options, status, fingerprint={
        "world_size": accelerator.num_processes, "batch_size": options.batch_size,
        "gradient_accumulation_steps": accumulation, "dataset_repeat": options.dataset_repeat,
        "num_frames": options.num_frames, "height": options.height, "width": options.width,
        "lora_rank": options.lora_rank, "lora_alpha": options.lora_alpha,
        "lora_target_modules": options.lora_target_modules, "metadata_rows": dataset.rows,
        "metadata_sha256": file_sha256(options.dataset_metadata_path), "seed": options.seed,
        "num_epochs": options.num_epochs, "cache": bool(options.cache)})
    # Different noise and timesteps on every rank (DiffSynth alone draws identical ones everywhere).
    torch.manual_seed(options.seed + 1000 * accelerator.process_index)
    position = Position()
    if options.resume:
        position = checkpoints.load(options.resume)   # restores weights, optimizer, scheduler, RNG of every rank
        kept = truncate_history(status.history_file, position.step)
        status.update(phase=f"resumed at step {position.step} (history: {kept} lines kept)",
                      samples_seen=position.samples_seen, skipped_samples=position.skipped_samples)

    if validator:
        validator.attach(accelerator, module)
    logger = ProgressLogger(options.output_path, status, steps_per_epoch=steps_per_epoch,
                            num_epochs=options.num_epochs, samples_per_step=options.batch_size,
                            start_step=position.step)
    status.update(plan=plan.as_dict(), skipped_samples=position.skipped_samples, skip_reasons=position.recent_skips,
                  lr_scheduler=options.lr_scheduler, max_grad_norm=options.max_grad_norm)
    if accelerator.is_main_process:
        print(f"step plan: {plan.describe()}", file=sys.stderr)
    schedule = CheckpointSchedule(options.checkpoint_steps, options.checkpoint_minutes)
    bad_media = BadMediaGuard(options.max_bad_media_fraction)
    logger.on_train_begin()
    signals.graceful = True
    for epoch in range(position.epoch, options.num_epochs):
        logger.on_epoch_begin(epoch)
        loader.set_epoch(epoch)
        skip = position.batches_in_epoch if epoch == position.epoch else 0
        position.epoch, position.batches_in_epoch = epoch, skip
        # Resuming mid-epoch: skip the batches already trained on without decoding them.
        epoch_batches = accelerator.skip_first_batches(loader, skip) if skip else loader
        losses, samples_in_step, bad_in_step = [], 0, 0
        for batch in epoch_batches:
            for sample in batch:
                for bad in sample.pop("skipped", ()):
                    bad_in_step += 1
                    position.recent_skips = (position.recent_skips + [bad])[-RECENT_SKIPS_SHOWN:]
            with accelerator.accumulate(module):
                loss = module(batch)
                accelerator.backward(loss)
                grad_norm = None
                if accelerator.sync_gradients and options.max_grad_norm > 0:
                    grad_norm = accelerator.clip_grad_norm_(trainable, options.max_grad_norm)
                optimizer.step()
                optimizer.zero_grad()
            losses.append(loss.detach())
            samples_in_step += len(batch) + bad_in_step
            position.batches_in_epoch += 1
            if not accelerator.sync_gradients:
                continue
            lr = optimizer.param_groups[0]["lr"]
            scheduler.step()
            position.step += 1
            position.samples_seen += samples_in_step
            position.skipped_samples += bad_in_step
            logger.on_step_end(accelerator, None, loss=torch.stack(losses).mean().item(), lr=lr,
                               samples=samples_in_step, grad_norm=None if grad_norm is None else float(grad_norm))
            if bad_in_step:
                status.update(skipped_samples=position.skipped_samples, skip_reasons=position.recent_skips)
            # One small all-reduce per step keeps every rank's decisions identical.
            stop_any, time_due, bad_total, seen_total = agree(
                accelerator, torch, signals.requested.is_set(), schedule.due_by_time(), bad_in_step, samples_in_step)
            losses, samples_in_step, bad_in_step = [], 0, 0
            bad_media.account(bad_total, seen_total, position.recent_skips)
            if position.batches_in_epoch >= len(loader):
                position.epoch, position.batches_in_epoch = epoch + 1, 0
            if validator and options.val_steps and position.step % options.val_steps == 0:
                validator.run(position.step)
            if stop_any:
                checkpoints.save(position)
                status.set_status(run_files.STATUS_STOPPED, phase=f"stopped at step {position.step} after a "
                                  "stop request; resume with --resume latest")
                accelerator.end_training()
                return
            if schedule.due_by_steps(position.step) or time_due:
                checkpoints.save(position)
                schedule.saved()
            if options.save_steps and position.step % options.save_steps == 0:
                checkpoints.save_lora(f"step-{position.step}.safetensors", position.step)
        checkpoints.save_lora(f"epoch-{epoch}.safetensors", position.step)
        logger.on_epoch_end(save_epoch_file=False)
    if validator and (not options.val_steps or position.step % options.val_steps):
        validator.run(position.step)
    checkpoints.save_lora("lora.safetensors", position.step)
    if schedule.enabled and checkpoints.last_step != position.step:
        checkpoints.save(position)
    accelerator.wait_for_everyone()
    logger.on_training_end()
    accelerator.end_training()


def agree(accelerator, torch, stop_requested: bool, checkpoint_due: bool, bad: int, seen: int):
    """All ranks learn: did any rank get a stop request / reach the checkpoint time; bad and seen in total."""
    flags = all_reduce_sum(accelerator, torch.tensor([int(stop_requested), int(checkpoint_due), bad, seen],
                                                     dtype=torch.int64, device=accelerator.device))
    stop_any, due_any, bad_total, seen_total = (int(v) for v in flags.tolist())
    return stop_any > 0, due_any > 0, bad_total, seen_total


def all_reduce_sum(accelerator, tensor):
    """Sum over ranks, in place (torch.distributed: the same on gloo and NCCL)."""
    if accelerator.num_processes > 1:
        import torch.distributed as dist
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    return tensor


class BadMediaGuard:
    """Counts undecodable files over all ranks; past the limit the run stops instead of training on what is left."""

    def __init__(self, max_fraction: float):
        self.max_fraction = max_fraction
        self.bad_total = 0
        self.seen_total = 0

    def account(self, bad: int, seen: int, recent_skips: list) -> None:
        self.bad_total += bad
        self.seen_total += seen
        if self.bad_total > max(BAD_MEDIA_ALLOWANCE, self.max_fraction * self.seen_total):
            last = recent_skips[-1]["reason"] if recent_skips else "(on another rank)"
            raise TooMuchBadMedia(
                f"{self.bad_total} of {self.seen_total} samples so far could not be decoded "
                f"({100 * self.bad_total / max(1, self.seen_total):.1f}% > {100 * self.max_fraction:g}%); "
                f"stopping instead of training on what is left. Last: {last}. Check the files, re-run the "
                "converter with --probe, or raise --max_bad_media_fraction.")


class Checkpoints:
    """Saving and loading the full training state through accelerate, with only the LoRA weights.

    accelerate's ``save_state`` would write the whole 5B DiT; a pre-hook keeps only the trainable
    (LoRA) tensors for DDP, and DeepSpeed is asked to exclude frozen parameters.
    """

    def __init__(self, accelerator, module, scheduler, options, status: RankStatusWriter, fingerprint: dict):
        from accelerate.utils import DistributedType

        self.accelerator = accelerator
        self.module = module
        self.options = options
        self.status = status
        self.fingerprint = fingerprint
        self.root = Path(options.checkpoint_dir or Path(options.output_path) / "checkpoints")
        self.deepspeed = accelerator.distributed_type == DistributedType.DEEPSPEED
        self.last_step = None
        unwrapped = accelerator.unwrap_model(module)
        trainable = {name for name, parameter in unwrapped.named_parameters() if parameter.requires_grad}

        def keep_only_trainable(models, weights, output_dir):
            for index, state in enumerate(weights):
                weights[index] = {key: value for key, value in state.items()
                                  if key in trainable or key.removeprefix("module.") in trainable}

        accelerator.register_save_state_pre_hook(keep_only_trainable)
        accelerator.register_for_checkpointing(scheduler)

    # -- LoRA files -----------------------------------------------------------------------------
    def lora_tensors(self) -> dict:
        state_dict = self.accelerator.get_state_dict(self.module)
        lora = self.accelerator.unwrap_model(self.module).lora_state_dict(state_dict) if state_dict else {}
        return {key: value.detach().to("cpu").contiguous() for key, value in lora.items()}

    def write_lora(self, target: Path, step: int, tensors: dict) -> None:
        options = self.options
        atomic_save_safetensors(target, tensors, metadata={
            "format": "pt", "base_model": "Wan2.2-TI2V-5B" + (" (demo)" if options.demo else ""),
            "lora_rank": str(options.lora_rank), "lora_alpha": str(options.lora_alpha or options.lora_rank),
            "lora_target_modules": options.lora_target_modules, "run_id": str(self.status.state["run_id"]),
            "step": str(step)})

    def save_lora(self, file_name: str, step: int) -> None:
        """Rank 0 writes the LoRA (DiffSynth key layout) as safetensors: temp file, then rename."""
        self.status.update(phase=f"saving {file_name}")
        self.accelerator.wait_for_everyone()
        tensors = self.lora_tensors()
        if self.accelerator.is_main_process:
            self.write_lora(Path(self.options.output_path) / file_name, step, tensors)
        self.accelerator.wait_for_everyone()

    # -- full training state --------------------------------------------------------------------
    def save(self, position: Position) -> Path:
        accelerator = self.accelerator
        name = checkpoint_name(position.step)
        self.status.update(phase=f"saving checkpoint {name}")
        # Named by run and step, so no rank ever deletes a folder another rank is writing into;
        # folders left by killed saves are removed by prune() after the next successful one.
        temporary = temp_path(self.root, position.step, self.status.state["run_id"])
        temporary.mkdir(parents=True, exist_ok=True)
        accelerator.wait_for_everyone()
        extra = {"exclude_frozen_parameters": True} if self.deepspeed else {}
        accelerator.save_state(str(temporary), **extra)
        tensors = self.lora_tensors()
        accelerator.wait_for_everyone()
        final = self.root / name
        if accelerator.is_main_process:
            self.write_lora(temporary / "lora.safetensors", position.step, tensors)
            publish(temporary, {
                "step": position.step, "epoch": position.epoch, "batches_in_epoch": position.batches_in_epoch,
                "samples_seen": position.samples_seen, "skipped_samples": position.skipped_samples,
                "run_id": self.status.state["run_id"], "created_at": time.time(), "fingerprint": self.fingerprint,
                "per_rank": self.gather_positions(position)})
            prune(self.root, self.options.keep_checkpoints)
        else:
            self.gather_positions(position)
        accelerator.wait_for_everyone()
        self.last_step = position.step
        self.status.update(phase=f"saved checkpoint {name}", last_checkpoint=str(final),
                           last_checkpoint_step=position.step)
        return final

    def verify_lora(self, path: Path) -> None:
        """strict=False loads nothing silently if names drift: check every LoRA tensor arrived."""
        import torch
        from safetensors.torch import load_file

        expected = load_file(str(path))
        loaded = self.lora_tensors()
        wrong = sorted(key for key in expected if key not in loaded or not torch.equal(
            loaded[key].to(expected[key].dtype), expected[key]))
        if wrong or not expected:
            raise RuntimeError(f"resuming from {path.parent}: {len(wrong)} of {len(expected)} LoRA tensors were not "
                               f"restored (first: {wrong[:1]})")

    def gather_positions(self, position: Position) -> list:
        """Every rank's own counters (collective: all ranks call it)."""
        import torch.distributed as dist

        mine = {"samples_seen": position.samples_seen, "skipped_samples": position.skipped_samples,
                "recent_skips": position.recent_skips}
        if self.accelerator.num_processes == 1:
            return [mine]
        everyone = [None] * self.accelerator.num_processes
        # accelerate's gather_object returns its input unchanged on CPU ranks; this works on gloo and NCCL.
        dist.all_gather_object(everyone, mine)
        return everyone

    def load(self, resume: str) -> Position:
        try:
            folder = resolve_resume(resume, self.root)
        except ValueError as exc:
            raise OptionsError(str(exc)) from None
        manifest = json.loads((folder / "checkpoint.json").read_text(encoding="utf-8"))
        differences = fingerprint_differences(manifest.get("fingerprint", {}), self.fingerprint)
        if differences and not self.options.force_resume:
            raise OptionsError(f"checkpoint {folder} was made with a different configuration:\n  "
                               + "\n  ".join(differences) + "\npass --force_resume true to resume anyway "
                               "(the data position will not be exact)")
        self.status.update(phase=f"loading checkpoint {folder.name}")
        if self.deepspeed:
            self.accelerator.load_state(str(folder), load_module_strict=False)
        else:
            self.accelerator.load_state(str(folder), strict=False)
        self.verify_lora(folder / "lora.safetensors")
        rank_state = (manifest.get("per_rank") or [{}] * self.accelerator.num_processes)
        mine = rank_state[self.accelerator.process_index] if len(rank_state) > self.accelerator.process_index else {}
        return Position(step=manifest["step"], epoch=manifest["epoch"], batches_in_epoch=manifest["batches_in_epoch"],
                        samples_seen=mine.get("samples_seen", 0), skipped_samples=mine.get("skipped_samples", 0),
                        recent_skips=mine.get("recent_skips", []))


class Validator:
    """Validation loss on a fixed subset, with a fixed seed per sample, so values compare over time.

    Each rank takes every world_size-th sample of the subset; the RNG of training is left untouched.
    """

    def __init__(self, options, status: RankStatusWriter):
        from diffsynth_mbc.data.cache.dataset import open_validation_dataset

        self.status = status
        self.seed = options.seed + 7919
        self.dataset = open_validation_dataset(options, substitute_bad_media=True)
        self.indices = list(range(min(options.val_samples, self.dataset.rows)))
        self.accelerator = self.module = None

    def attach(self, accelerator, module) -> None:
        self.accelerator, self.module = accelerator, module

    def run(self, step: int) -> float | None:
        import torch

        self.status.update(phase=f"validation at step {step}")
        model = self.accelerator.unwrap_model(self.module)
        mine = self.indices[self.accelerator.process_index::self.accelerator.num_processes]
        total = torch.zeros(2, dtype=torch.float64, device=self.accelerator.device)
        devices = [self.accelerator.device] if self.accelerator.device.type == "cuda" else []
        with torch.no_grad(), torch.random.fork_rng(devices=devices):
            for index in mine:
                torch.manual_seed(self.seed + index)   # same noise and timestep for this sample every time
                sample = self.dataset[index]
                sample.pop("skipped", None)
                with self.accelerator.autocast():
                    total[0] += model.sample_loss(sample).double()
                total[1] += 1
        total = all_reduce_sum(self.accelerator, total)
        if total[1] == 0:
            return None
        val_loss = float(total[0] / total[1])
        self.status.append_history({"kind": "val", "step": step, "val_loss": val_loss, "val_samples": int(total[1]),
                                    "time": round(time.time(), 3)})
        self.status.update(val_loss=val_loss, val_step=step, phase=f"validated at step {step}")
        return val_loss


if __name__ == "__main__":
    raise SystemExit(main())
