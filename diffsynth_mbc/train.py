"""LoRA fine-tuning of Wan2.2-TI2V-5B through DiffSynth's own pipeline, loss and LoRA injection.

Started by ``accelerate launch`` (DDP, DeepSpeed ZeRO-2 and several nodes come from accelerate's
config), e.g. ``bash launchers/train_test.sh``. Every rank writes ``LOG_DIR/training_gpu{rank}.json``
from its first instant (status ``starting``), then ``loading``, ``training`` and finally
``finished``, ``failed`` (with the error) or ``stopped`` (Ctrl-C / SIGTERM).

Exit codes: 0 finished, 1 failed, 2 bad options or model files, 130/143 stopped by SIGINT/SIGTERM.
"""

from __future__ import annotations

import os
import sys
import time
import traceback

from . import run_files
from .model_files import ModelFileError
from .run_status import RankStatusWriter, rank_from_environment
from .stop_signals import StopSignals, unblock_in_child
from .train_options import OptionsError, resolve_options


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
                              min_interval_s=options.status_interval_s)
    signals = StopSignals(on_stuck=lambda sig: status.set_status(
        run_files.STATUS_STOPPED, phase=f"stopped by signal {sig} while blocked in: {status.state['phase']}"))
    signals.install()
    try:
        train(options, status)
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


def train(options, status: RankStatusWriter) -> None:
    status.set_status(run_files.STATUS_LOADING, phase="importing torch and diffsynth")
    import dataclasses
    import datetime

    import torch
    from accelerate import Accelerator
    from accelerate.utils import DataLoaderConfiguration, DistributedDataParallelKwargs, InitProcessGroupKwargs

    from .dataset import MBCVideoDataset
    from .pipeline import build_demo_pipeline, load_pipeline
    from .progress import ProgressLogger
    from .step_plan import StepPlan, lr_factor, steps_from_loader
    from .training_module import WanTI2VLoraModule

    if options.model_dir and not options.demo:
        # Fail on a missing or broken file before any GPU memory is touched.
        from .model_files import locate_model_files
        locate_model_files(options.model_dir)

    status.update(phase="joining the process group")
    handlers = [DistributedDataParallelKwargs(find_unused_parameters=options.find_unused_parameters)]
    if status.state["world_size"] > 1:
        # NCCL_TIMEOUT is not read by NCCL itself; it becomes the process group's timeout here.
        timeout = datetime.timedelta(seconds=int(os.environ.get("NCCL_TIMEOUT", "1800")))
        backend = options.dist_backend or ("nccl" if torch.cuda.is_available() else "gloo")
        handlers.append(InitProcessGroupKwargs(backend=backend, timeout=timeout))
    accelerator = Accelerator(
        gradient_accumulation_steps=options.gradient_accumulation_steps,
        kwargs_handlers=handlers,
        dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True, data_seed=options.seed),
    )
    if accelerator.num_processes != status.state["world_size"]:
        status.update(world_size=accelerator.num_processes)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(accelerator.mixed_precision, torch.float32)
    torch.manual_seed(options.seed)  # identical model init on every rank

    status.update(phase="loading models" + (" (demo: tiny random TI2V-5B architecture)" if options.demo else ""))
    if options.demo:
        pipe = build_demo_pipeline(device=str(accelerator.device), torch_dtype=torch.float32, seed=options.seed,
                                   tokenizer_dir=os.path.join(options.output_path, ".demo_tokenizer",
                                                              f"rank{accelerator.process_index}"))
    else:
        pipe = load_pipeline(options.model_dir, options.model_id, device=str(accelerator.device), torch_dtype=dtype)
    module = WanTI2VLoraModule(
        pipe, lora_target_modules=options.lora_target_modules, lora_rank=options.lora_rank,
        lora_alpha=options.lora_alpha, use_gradient_checkpointing=options.use_gradient_checkpointing,
        use_gradient_checkpointing_offload=options.use_gradient_checkpointing_offload,
        max_timestep_boundary=options.max_timestep_boundary, min_timestep_boundary=options.min_timestep_boundary)

    status.update(phase="reading metadata")
    dataset = MBCVideoDataset(options.dataset_base_path, options.dataset_metadata_path, num_frames=options.num_frames,
                              height=options.height, width=options.width, repeat=options.dataset_repeat)
    plan = StepPlan(rows=dataset.rows, repeat=options.dataset_repeat, world_size=accelerator.num_processes,
                    batch_size=options.batch_size, gradient_accumulation=options.gradient_accumulation_steps,
                    num_epochs=options.num_epochs)
    if plan.rows == 0:
        raise ValueError(f"{options.dataset_metadata_path} has no rows to train on")
    workers = options.dataset_num_workers
    loader = torch.utils.data.DataLoader(
        dataset, batch_size=options.batch_size, shuffle=True, collate_fn=list, num_workers=workers,
        persistent_workers=workers > 0, prefetch_factor=2 if workers > 0 else None,
        worker_init_fn=unblock_in_child if workers > 0 else None)
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
    # Different noise and timesteps on every rank (DiffSynth alone draws identical ones everywhere).
    torch.manual_seed(options.seed + 1000 * accelerator.process_index)

    logger = ProgressLogger(options.output_path, status, steps_per_epoch=steps_per_epoch,
                            num_epochs=options.num_epochs, samples_per_step=options.batch_size)
    status.update(plan=plan.as_dict())
    if accelerator.is_main_process:
        print(f"step plan: {plan.describe()}", file=sys.stderr)
    logger.on_train_begin()
    for epoch in range(options.num_epochs):
        logger.on_epoch_begin(epoch)
        if hasattr(loader, "set_epoch"):
            loader.set_epoch(epoch)
        losses, samples = [], 0
        for batch in loader:
            with accelerator.accumulate(module):
                loss = module(batch)
                accelerator.backward(loss)
                grad_norm = None
                if accelerator.sync_gradients and options.max_grad_norm > 0:
                    grad_norm = accelerator.clip_grad_norm_(trainable, options.max_grad_norm)
                optimizer.step()
                optimizer.zero_grad()
            losses.append(loss.detach())
            samples += len(batch)
            if accelerator.sync_gradients:
                lr = optimizer.param_groups[0]["lr"]
                scheduler.step()
                logger.on_step_end(accelerator, None, loss=torch.stack(losses).mean().item(), lr=lr,
                                   samples=samples, grad_norm=None if grad_norm is None else float(grad_norm))
                losses, samples = [], 0
                if options.save_steps and logger.step % options.save_steps == 0:
                    save_lora(accelerator, module, options, f"step-{logger.step}.safetensors", status)
        save_lora(accelerator, module, options, f"epoch-{epoch}.safetensors", status)
        logger.on_epoch_end(save_epoch_file=False)
    save_lora(accelerator, module, options, "lora.safetensors", status)
    accelerator.wait_for_everyone()
    logger.on_training_end()
    accelerator.end_training()


def save_lora(accelerator, module, options, file_name: str, status: RankStatusWriter) -> None:
    """Rank 0 writes the LoRA (DiffSynth key layout) as safetensors: temp file, then rename."""
    from pathlib import Path

    from safetensors.torch import save_file

    status.update(phase=f"saving {file_name}")
    accelerator.wait_for_everyone()
    state_dict = accelerator.get_state_dict(module)
    if accelerator.is_main_process:
        lora = accelerator.unwrap_model(module).lora_state_dict(state_dict)
        lora = {key: value.detach().to("cpu").contiguous() for key, value in lora.items()}
        target = Path(options.output_path) / file_name
        target.parent.mkdir(parents=True, exist_ok=True)
        temporary = target.with_name(f".{target.name}.tmp")
        save_file(lora, str(temporary), metadata={
            "format": "pt", "base_model": "Wan2.2-TI2V-5B" + (" (demo)" if options.demo else ""),
            "lora_rank": str(options.lora_rank), "lora_alpha": str(options.lora_alpha or options.lora_rank),
            "lora_target_modules": options.lora_target_modules, "run_id": str(status.state["run_id"]),
            "step": str(status.state["step"])})
        os.replace(temporary, target)
    accelerator.wait_for_everyone()


if __name__ == "__main__":
    raise SystemExit(main())
