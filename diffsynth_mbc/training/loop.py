"""The training loop, as named stages: ``setup`` -> ``train_epochs`` -> ``finish`` -> ``cleanup``.

``setup`` joins the process group, opens the data, loads the models, prepares them with accelerate
and resumes; ``train_epochs`` runs optimizer steps and what follows each (progress, agreement between
ranks, validation, checkpoints, stop requests); ``finish`` validates, writes the LoRA and the last
checkpoint. Started by ``diffsynth_mbc.training.cli.main`` on every rank.
"""

from __future__ import annotations

import dataclasses
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING

from diffsynth_mbc import run_files
from diffsynth_mbc.lifecycle.signals import StopSignals, unblock_in_child
from diffsynth_mbc.lifecycle.startup import resume_collector
from diffsynth_mbc.training.checkpoints.resume import claim_checkpoint_folder, resume
from diffsynth_mbc.training.checkpoints.state import CheckpointSchedule, Checkpoints, Position
from diffsynth_mbc.training.distributed.accelerator import start_accelerator, unwrapped_model
from diffsynth_mbc.training.distributed.collectives import (agree, iterate_waiting_at_start, wait_for_everyone,
                                                            watch_gradient_all_reduce)
from diffsynth_mbc.training.evaluation.best_lora import keep_best, resume_best, say_early_stop, stopped_before
from diffsynth_mbc.training.evaluation.lora_health import LoraHealth, end_of_run, make_health
from diffsynth_mbc.training.evaluation.sample_clips import make_sampler, maybe_sample
from diffsynth_mbc.training.evaluation.validation import Validator
from diffsynth_mbc.training.lora.ema import make_ema
from diffsynth_mbc.training.lora.init_from_file import start_from_lora
from diffsynth_mbc.training.lora.saved_files import epoch_file_name
from diffsynth_mbc.training.reporting.run_start import start_progress
from diffsynth_mbc.training.reporting.stage_report import StageReport
from diffsynth_mbc.training.reporting.status_writer import RankStatusWriter
from diffsynth_mbc.training.step.block_runner import CompileTimer
from diffsynth_mbc.training.step.caption_dropout import CaptionDropout
from diffsynth_mbc.training.step.guards import BadMediaGuard, NonFiniteGuard
from diffsynth_mbc.training.step.micro_batch import forward_backward, latent_frames, sample_tokens

if TYPE_CHECKING:   # the types of Run's parts; importing them here would load torch before setup says so
    import torch
    from accelerate import Accelerator

    from diffsynth_mbc.training.evaluation.sample_clips import Sampler
    from diffsynth_mbc.training.lora.ema import LoraEma
    from diffsynth_mbc.training.options import TrainOptions
    from diffsynth_mbc.training.plan.batches import ShapeGroupedBatchSampler
    from diffsynth_mbc.training.plan.step_plan import StepPlan
    from diffsynth_mbc.training.reporting.progress import ProgressLogger

RECENT_SKIPS_SHOWN = 5


@dataclass
class Run:
    """The parts of one training run, built by ``setup``; what ``prepare`` leaves empty, ``setup`` fills in."""
    options: TrainOptions
    status: RankStatusWriter
    signals: StopSignals
    accelerator: Accelerator
    module: torch.nn.Module          # the WanTI2VLoraModule, as accelerate wrapped it (DDP or DeepSpeed)
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    loader: torch.utils.data.DataLoader
    trainable: list[torch.nn.Parameter]
    plan: StepPlan
    steps_per_epoch: int
    checkpoints: Checkpoints
    validator: Validator | None
    batches: ShapeGroupedBatchSampler   # its epoch is set with the loader's
    logger: ProgressLogger | None = None
    position: Position = dataclasses.field(default_factory=Position)
    schedule: CheckpointSchedule | None = None
    bad_media: BadMediaGuard | None = None
    nonfinite: NonFiniteGuard | None = None
    injected_nonfinite: frozenset[int] = frozenset()
    sampler: Sampler | None = None          # --sample_prompts (training/evaluation/sample_clips.py)
    first_step: int = 0
    compile_timer: CompileTimer | None = None
    captions: CaptionDropout | None = None  # --caption_dropout (training/step/caption_dropout.py)
    ema: LoraEma | None = None              # the EMA of the LoRA weights (--ema_decay; training/lora/ema.py)
    health: LoraHealth | None = None        # --health_steps (training/evaluation/lora_health.py)
    stages: StageReport | None = None       # --resolution_stages (training/reporting/stage_report.py)


def train(options, status: RankStatusWriter, signals: StopSignals) -> None:
    run = setup(options, status, signals)
    resume_collector()   # paused by `python -m diffsynth_mbc.train` while it imported and set up
    outcome = "early_stop" if stopped_before(run) else train_epochs(run)
    if outcome != "stopped":
        finish(run, early_stop=outcome == "early_stop")
    cleanup(run)


# ---------------------------------------------------------------------------------------------
# setup


def setup(options, status: RankStatusWriter, signals: StopSignals) -> Run:
    status.set_status(run_files.STATUS_LOADING, phase="importing torch and diffsynth")
    if options.model_dir and not options.demo:
        # Fail on a missing or broken file before any GPU memory is touched.
        from diffsynth_mbc.models.model_files import locate_model_files
        locate_model_files(options.model_dir)
    accelerator = start_accelerator(options, status)
    import torch

    torch.manual_seed(options.seed)  # identical model init on every rank
    dataset, validator, module = open_data_and_models(options, status, accelerator)
    run = prepare(options, status, signals, accelerator, dataset, module, validator)
    run.captions = CaptionDropout.from_options(options, accelerator.process_index, dataset, status)
    run.ema = make_ema(run)
    # Different noise and timesteps on every rank (DiffSynth alone draws identical ones everywhere).
    torch.manual_seed(options.seed + 1000 * accelerator.process_index)
    if options.resume:
        resume(run)
        resume_best(run)
    else:
        claim_checkpoint_folder(run)
    if options.report_to != "none":   # after a resume: the run id (the tracker's run name) goes on, so does its run
        accelerator.init_trackers(status.state["run_id"])
    if validator:
        validator.attach(accelerator, run.module)
    run.sampler = make_sampler(options, status, accelerator, run.module, run.ema) if options.sample_prompts else None
    run.first_step = run.position.step
    start_progress(run)
    run.stages = StageReport(run)   # --resolution_stages: each batch's stage, and the status file's
    run.health = make_health(run)   # the LoRA health's first record, at step 0 (a resume's: kept, not written)
    return run


def open_data_and_models(options, status: RankStatusWriter, accelerator):
    import torch

    from diffsynth_mbc.data.cache.dataset import open_training_dataset
    from diffsynth_mbc.training.distributed.agreed_sizes import rank_zero_sizes
    from diffsynth_mbc.models.pipeline import training_pipeline
    from diffsynth_mbc.training.lora.module import WanTI2VLoraModule

    # The data first: a latent cache that does not match these options fails before any model loads.
    status.update(phase="reading metadata" + (f" and the latent cache {options.cache}" if options.cache else ""))
    dataset = open_training_dataset(options, substitute_bad_media=True,   # one read of sizes, rank 0's everywhere
                                    read_sizes=rank_zero_sizes(options, accelerator, status))
    validator = Validator(options, status) if options.val_metadata_path else None

    encoders = not options.cache   # with the cache only the DiT (plus LoRA) is needed
    status.update(phase="loading models" + (" (demo: tiny random TI2V-5B architecture)" if options.demo else "")
                  + ("" if encoders else " (DiT only: training from the latent cache)"))
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(accelerator.mixed_precision, torch.float32)
    pipe = training_pipeline(options, str(accelerator.device), dtype, accelerator.process_index)
    from diffsynth_mbc.training.plan.step_choices import residual_choice, step_choices
    from diffsynth_mbc.training.step.timestep_sampling import sampler_from_options

    recompute, compile_blocks = step_choices(options, status, accelerator, len(pipe.dit.blocks))
    module = WanTI2VLoraModule(
        pipe, lora_target_modules=options.lora_target_modules, lora_rank=options.lora_rank,
        lora_alpha=options.lora_alpha, use_gradient_checkpointing=options.use_gradient_checkpointing,
        use_gradient_checkpointing_offload=options.use_gradient_checkpointing_offload,
        max_timestep_boundary=options.max_timestep_boundary, min_timestep_boundary=options.min_timestep_boundary,
        recompute_blocks=recompute, compile_blocks=compile_blocks,
        timestep_sampler=sampler_from_options(options, pipe.scheduler.shift), loss_weighting=options.loss_weighting,
        lora_variant=options.lora_variant, objective=options.objective,
        fp32_residual=residual_choice(options, status, accelerator.mixed_precision))
    start_from_lora(module, options, status)   # --init_lora: before accelerate wraps it (DDP, ZeRO-2 copy it then)
    return dataset, validator, module


def prepare(options, status, signals, accelerator, dataset, module, validator) -> Run:
    """Plan, loader, optimizer and scheduler, wrapped by accelerate (DDP or DeepSpeed)."""
    import torch

    from diffsynth_mbc.data.cache.index import file_sha256
    from diffsynth_mbc.data.dataset_list import catalogue_plan
    from diffsynth_mbc.data.media.shapes import IMAGE, VIDEO
    from diffsynth_mbc.training.plan.batches import ShapeGroupedBatchSampler, key_samples
    from diffsynth_mbc.training.checkpoints.fingerprint import run_fingerprint
    from diffsynth_mbc.training.plan.step_plan import lr_factor, plan_from_options, steps_from_loader

    keys = dataset.batch_keys()
    row_repeats, catalogues = catalogue_plan(options, dataset, keys)   # several catalogues: their repeats, counts
    equal_load = options.buckets == "aspect"   # every rank on one bucket at a time (training/plan/batches.py)
    plan = plan_from_options(options, rows=dataset.rows, images=sum(key.startswith(IMAGE) for key in keys),
                             world_size=accelerator.num_processes, datasets=catalogues,
                             bucket_samples=tuple(key_samples(keys, options.dataset_repeat, row_repeats).items())
                             if equal_load else ())
    image_batch = plan.image_batch_size
    if plan.rows == 0:
        raise ValueError(f"{options.dataset_metadata_path} has no rows to train on")
    workers = options.dataset_num_workers
    # One shape per batch (one DiT forward); all ranks' batches in turn, dealt one per rank by accelerate's sharding
    batches = ShapeGroupedBatchSampler(keys, options.dataset_repeat, {VIDEO: options.batch_size, IMAGE: image_batch},
                                       accelerator.num_processes, options.seed, row_repeats, equal_load)
    dataset.epoch_span = batches.epoch_span   # random_window's draw: each index's epoch and copy of its row
    loader = torch.utils.data.DataLoader(
        dataset, batch_sampler=batches, collate_fn=list, num_workers=workers,
        persistent_workers=workers > 0, prefetch_factor=2 if workers > 0 else None,
        worker_init_fn=unblock_in_child if workers > 0 else None,
        # Starting an iterator draws a seed; from the global RNG that would shift the noise of a
        # resumed run (which starts its iterator after restoring the RNG). Keep the two apart.
        generator=torch.Generator().manual_seed(options.seed))
    trainable = [p for p in module.parameters() if p.requires_grad]
    from diffsynth_mbc.training.lora.variants import optimizer_groups

    optimizer = torch.optim.AdamW(optimizer_groups(module.named_parameters(), options.learning_rate,
                                                   options.loraplus_lr_ratio),
                                  lr=options.learning_rate, weight_decay=options.weight_decay)

    status.update(phase="preparing (DDP / DeepSpeed)")
    plugin = accelerator.state.deepspeed_plugin
    if plugin is not None and plugin.is_auto("train_micro_batch_size_per_gpu"):
        # Batches differ in size (videos / images), so the loader has no one batch_size for DeepSpeed to read;
        # its micro-batch figure is bookkeeping here (the loss is each batch's mean): the video batch.
        plugin.deepspeed_config["train_micro_batch_size_per_gpu"] = options.batch_size
    module, optimizer, loader = accelerator.prepare(module, optimizer, loader)
    watch_gradient_all_reduce(module, status)   # a rank waiting for the others' gradients says so
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
    checkpoints = Checkpoints(accelerator, module, scheduler, options, status, fingerprint=run_fingerprint(
        options, world_size=accelerator.num_processes, accumulation=accumulation, rows=dataset.rows,
        metadata_sha256=file_sha256(options.dataset_metadata_path), image_batch=image_batch,
        precision=accelerator.mixed_precision), sized_rows=dataset.sized_rows())
    return Run(options=options, status=status, signals=signals, accelerator=accelerator, module=module,
               optimizer=optimizer, scheduler=scheduler, loader=loader, trainable=trainable, plan=plan,
               steps_per_epoch=steps_per_epoch, checkpoints=checkpoints, validator=validator, batches=batches)


# ---------------------------------------------------------------------------------------------
# train


def train_epochs(run: Run) -> str:
    """Every remaining epoch; 'stopped' when a stop request ended the run, 'early_stop' when --early_stop did,
    else 'done'."""
    maybe_sample(run)   # the baseline, before the first step of a fresh run (see training/evaluation/sample_clips.py)
    run.logger.on_train_begin()
    run.signals.graceful = True
    for epoch in range(run.position.epoch, run.options.num_epochs):
        outcome = train_epoch(run, epoch)
        if outcome != "done":   # a stop request, or --early_stop
            return outcome
        run.logger.timed("lora", run.checkpoints.save_lora, epoch_file_name(epoch, run.options.num_epochs),
                        run.position.step)
        run.logger.on_epoch_end(save_epoch_file=False)
    return "done"


def train_epoch(run: Run, epoch: int) -> str:
    import torch

    accelerator, position = run.accelerator, run.position
    run.logger.on_epoch_begin(epoch)
    run.loader.set_epoch(epoch)
    run.batches.set_epoch(epoch)
    skip = position.batches_in_epoch if epoch == position.epoch else 0
    position.epoch, position.batches_in_epoch = epoch, skip
    # Resuming mid-epoch: skip the batches already trained on without decoding them.
    epoch_batches = accelerator.skip_first_batches(run.loader, skip) if skip else run.loader
    losses, samples_in_step, bad_in_step, tokens_in_step, drawn = [], 0, 0, 0, []
    draws = unwrapped_model(accelerator, run.module).draws   # each sample's timestep and loss, for the history
    for batch in iterate_waiting_at_start(epoch_batches, run.status):
        for sample in batch:
            for bad in sample.pop("skipped", ()):
                bad_in_step += 1
                position.recent_skips = (position.recent_skips + [bad])[-RECENT_SKIPS_SHOWN:]
        if not losses:
            run.compile_timer.step_started()
        tokens_in_step += sum(sample_tokens(sample) for sample in batch)
        run.captions.apply(batch, epoch, position.batches_in_epoch)
        choose_modes(run, batch, epoch)
        run.logger.count_catalogues(batch)   # several catalogues: each one's samples this epoch
        loss, grad_norm, skipped = forward_backward(run, batch, losses)
        losses.append(loss.detach())
        drawn += draws.take(with_shapes=True)
        samples_in_step += len(batch) + bad_in_step
        position.batches_in_epoch += 1
        if not accelerator.sync_gradients:
            continue
        run.compile_timer.step_finished()
        step_loss = torch.stack(losses).mean().item()
        outcome = after_optimizer_step(run, epoch, step_loss, grad_norm, samples_in_step, bad_in_step, skipped,
                                       tokens=tokens_in_step, drawn=drawn)
        losses, samples_in_step, bad_in_step, tokens_in_step, drawn = [], 0, 0, 0, []
        if outcome != "continue":
            return outcome
    return "done"


def choose_modes(run: Run, batch: list[dict], epoch: int) -> None:
    """Each sample's training mode (t2i / i2v / t2v, ``training/step/objective.py``), from its place in the run."""
    from diffsynth_mbc.training.step.objective import training_mode

    options, rank = run.options, run.accelerator.process_index
    for place, sample in enumerate(batch):
        sample["mode"] = training_mode(options.objective, options.i2v_probability, latent_frames(sample) == 1,
                                       options.seed, rank, epoch, run.position.batches_in_epoch, place)


def after_optimizer_step(run: Run, epoch: int, loss: float, grad_norm, samples: int, bad: int,
                         skipped: bool = False, tokens: int | None = None, drawn: list | None = None) -> str:
    """Progress, agreement between ranks, validation, checkpoints and stop requests after one optimizer step."""
    import torch

    accelerator, options, position, status = run.accelerator, run.options, run.position, run.status
    lr = run.optimizer.param_groups[0]["lr"]
    run.scheduler.step()
    position.step += 1
    if run.ema is not None:
        run.ema.after_step(skipped)
    position.samples_seen += samples
    position.skipped_samples += bad
    run.nonfinite.note_residual(unwrapped_model(accelerator, run.module).blocks.take_largest_residual())
    if run.nonfinite.check(position.step, loss, grad_norm, skipped) or run.nonfinite.total:
        status.update(**run.nonfinite.status_fields())
    status.update(**run.nonfinite.residual_fields())
    run.logger.on_step_end(accelerator, None, loss=loss, lr=lr, samples=samples, grad_norm=grad_norm,
                           tokens=tokens, timestep_draws=drawn, **({"nonfinite": True} if skipped else {}))
    run.health.after_step(position.step)
    run.stages.after_step(run)
    if bad:
        status.update(skipped_samples=position.skipped_samples, skip_reasons=position.recent_skips)
    # One small all-reduce per step keeps every rank's decisions identical.
    stop_any, time_due, bad_total, seen_total = agree(
        accelerator, torch, run.signals.requested.is_set(), run.schedule.due_by_time(), bad, samples, status=status)
    run.bad_media.account(bad_total, seen_total, position.recent_skips)
    if position.batches_in_epoch >= len(run.loader):
        position.epoch, position.batches_in_epoch = epoch + 1, 0
    early_stop = False
    if run.validator and options.val_steps and position.step % options.val_steps == 0:
        run.logger.timed("validation", run.validator.run, position.step)
        run.logger.on_validation(accelerator)
        early_stop = keep_best(run)
    maybe_sample(run)
    if stop_any:
        run.logger.timed("checkpoint", run.checkpoints.save, position)
        status.set_status(run_files.STATUS_STOPPED, phase=f"stopped at step {position.step} after a "
                          f"stop request ({run.signals.describe()}); resume with --resume latest")
        return "stopped"
    if run.schedule.due_by_steps(position.step) or time_due:
        run.logger.timed("checkpoint", run.checkpoints.save, position)
        run.schedule.saved()
    if options.save_steps and position.step % options.save_steps == 0:
        run.logger.timed("lora", run.checkpoints.save_lora, f"step-{position.step}.safetensors", position.step)
    return "early_stop" if early_stop else "continue"


# ---------------------------------------------------------------------------------------------
# finish and cleanup


def finish(run: Run, early_stop: bool = False) -> None:
    """The end of the run (its planned total, or ``--early_stop``'s): the last validation, the LoRA file and the last
    checkpoint (an early stop's always, as a stop request's)."""
    options, position = run.options, run.position
    if run.validator and (not options.val_steps or position.step % options.val_steps):
        run.logger.timed("validation", run.validator.run, position.step)
        run.logger.on_validation(run.accelerator)
        keep_best(run)
    if early_stop:
        say_early_stop(run)
    end_of_run(run)   # the last health record, after the last validation; a broken LoRA fails the run here
    maybe_sample(run)
    run.logger.timed("lora", run.checkpoints.save_lora, "lora.safetensors", position.step)
    if (run.schedule.enabled or early_stop) and run.checkpoints.last_step != position.step:
        run.logger.timed("checkpoint", run.checkpoints.save, position)
    wait_for_everyone(run.accelerator, run.status, "ranks to finish")
    run.logger.on_training_end()


def cleanup(run: Run) -> None:
    from diffsynth_mbc.lifecycle.run_lock import follow_run_log, launcher_gone

    if launcher_gone():   # a rank that stopped on another rank's word has not followed the log yet
        follow_run_log()
    run.logger.print_summary()   # once: after finish() it was printed already; after a stop, here
    run.accelerator.end_training()
