"""The training as a recipe, on every rank: ``setup`` builds the run's parts once, ``train`` runs its optimizer steps
and what follows each, ``finish`` ends it at its total (or an early stop), ``cleanup`` closes it. Started by
``diffsynth_mbc.training.cli.main`` (``train``).

What follows a step is the components' (``training/components/``): each per-step feature is one component that
owns its state and its part of the checkpoint, and the recipe calls them in the one order ``components`` gives,
then obeys their decisions (a stop request, a checkpoint, a LoRA file, an early stop). After every optimizer step,
on every rank alike:

1. the position moves on (step, samples, epoch);
2. the step's agreement: one all-reduce of every component's votes (a stop request, a checkpoint time, bad media);
3. every component's ``after_step``, in order;
4. a validation when due: measured, every component's ``after_validation`` (the best LoRA, the early stop), then its
   record written;
5. the decisions obeyed: a stop request's checkpoint (the run stops), a checkpoint, a LoRA file; an early stop ends
   the epochs and the run finishes. A stop on an epoch's last step writes the epoch's file first; a stop request's
   status (stopped, preempted) is written last.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING

from diffsynth_mbc import run_files
from diffsynth_mbc.run_layout import FINAL_LORA, epoch_file_name
from diffsynth_mbc.lifecycle.signals import StopSignals, unblock_in_child
from diffsynth_mbc.lifecycle.startup import resume_collector
from diffsynth_mbc.training.checkpoints.resume import claim_checkpoint_folder, go_on, resume
from diffsynth_mbc.training.checkpoints.state import Checkpoints, Position
from diffsynth_mbc.training.components.protocol import CONTINUE, Decision, Stop, StepContext, StepResult, run_hook
from diffsynth_mbc.training.distributed.accelerator import start_accelerator, unwrapped_model
from diffsynth_mbc.training.distributed.collectives import (agree, iterate_waiting_at_start, wait_for_everyone,
                                                            watch_gradient_all_reduce)
from diffsynth_mbc.training.reporting.status_writer import RankStatusWriter
from diffsynth_mbc.training.step.micro_batch import (adamw, forward, forward_backward, injected_nonfinite_steps,
                                                     sample_tokens)

if TYPE_CHECKING:   # the types of the parts; importing them here would load torch before setup says so
    import torch
    from accelerate import Accelerator

    from diffsynth_mbc.training.components.protocol import Component
    from diffsynth_mbc.training.components.schedules import StopRequests
    from diffsynth_mbc.training.evaluation.validation import Validator
    from diffsynth_mbc.training.lora.ema import LoraEma
    from diffsynth_mbc.training.options import TrainOptions
    from diffsynth_mbc.training.plan.batches import ShapeGroupedBatchSampler
    from diffsynth_mbc.training.plan.schedule import StepSchedule
    from diffsynth_mbc.training.plan.step_plan import StepPlan
    from diffsynth_mbc.training.reporting.progress import ProgressLogger


@dataclass(frozen=True)
class Parts:
    """What ``setup`` builds once, read by the recipe and its components."""
    options: TrainOptions
    status: RankStatusWriter
    accelerator: Accelerator
    module: torch.nn.Module          # the WanTI2VLoraModule, as accelerate wrapped it (DDP or DeepSpeed)
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    schedule: StepSchedule           # where the learning rate and --resolution_stages stand at each step
    loader: torch.utils.data.DataLoader
    batches: ShapeGroupedBatchSampler   # its epoch is set with the loader's
    trainable: list[torch.nn.Parameter]
    plan: StepPlan
    steps_per_epoch: int             # the data loader's (the plan's, unless DeepSpeed or the loader says otherwise)
    checkpoints: Checkpoints
    ema: LoraEma | None              # --ema_decay: the EMA of the LoRA weights

    @property
    def total_steps(self) -> int:
        return self.steps_per_epoch * self.options.num_epochs

    @property
    def model(self):
        """The LoRA module itself (accelerate's wrapper taken off)."""
        return unwrapped_model(self.accelerator, self.module)


def train(options, status: RankStatusWriter, signals: StopSignals) -> None:
    recipe = TrainingRecipe(options, status, signals)
    recipe.setup()
    resume_collector()   # paused by `python -m diffsynth_mbc.train` while it imported and set up
    recipe.train()


class TrainingRecipe:
    def __init__(self, options, status: RankStatusWriter, signals: StopSignals):
        self.options, self.status, self.signals = options, status, signals
        self.parts: Parts | None = None
        self.position = Position()
        self.validator: Validator | None = None
        self.logger: ProgressLogger | None = None
        self.components: list[Component] = []
        self.epoch_steps = None  # where each epoch's optimizer steps fall from this process's start (EpochSteps)
        self.end_step = 0        # the run's last step: its plan's total (a resume's own end, where they differ)
        self.stop_requests: StopRequests | None = None
        self.step_parts = None   # what a step needs besides the parts: caption dropout, compile timer, the forward

    # -----------------------------------------------------------------------------------------
    # setup

    def setup(self) -> None:
        options, status = self.options, self.status
        status.set_status(run_files.STATUS_LOADING, phase="importing torch and diffsynth")
        if options.model_dir and not options.demo:
            # Fail on a missing or broken file before any GPU memory is touched.
            from diffsynth_mbc.models.model_files import locate_model_files
            locate_model_files(options.model_dir)
        accelerator = start_accelerator(options, status)
        import torch

        torch.manual_seed(options.seed)  # identical model init on every rank
        dataset, self.validator, module = self._open_data_and_models(accelerator)
        self.parts = parts = self._prepare(accelerator, dataset, module)
        # Different noise and timesteps on every rank (DiffSynth alone draws identical ones everywhere).
        torch.manual_seed(options.seed + 1000 * accelerator.process_index)
        if options.resume:
            self.position, saved, vanished = resume(parts.checkpoints, options, status, accelerator)
            self.epoch_steps = go_on(parts, self.position)   # on other processes: the epoch's rest over these
        else:
            from diffsynth_mbc.training.plan.elastic import EpochSteps

            claim_checkpoint_folder(parts.checkpoints, options, status, accelerator)
            saved, vanished = {}, []
            self.epoch_steps = EpochSteps.fresh(len(parts.loader), accelerator.gradient_accumulation_steps)
        self.end_step = self.epoch_steps.end_step(options.num_epochs)
        if options.report_to != "none":   # after a resume: the run id (the tracker's run name) goes on, so does its run
            accelerator.init_trackers(status.state["run_id"])
        if self.validator:
            self.validator.attach(accelerator, parts.module, parts.ema)
        self.logger = self._start_reporting()
        self.components = self._components()
        self._load_component_states(saved, vanished)
        self.step_parts = self._step_parts(dataset)

    def _open_data_and_models(self, accelerator):
        from diffsynth_mbc.data.cache.dataset import open_training_dataset
        from diffsynth_mbc.gpu import torch_dtype
        from diffsynth_mbc.models.pipeline import training_pipeline
        from diffsynth_mbc.training.distributed.agreed_sizes import rank_zero_sizes
        from diffsynth_mbc.training.evaluation.validation import Validator
        from diffsynth_mbc.training.lora.init_from_file import start_from_lora
        from diffsynth_mbc.training.lora.module import lora_module
        from diffsynth_mbc.training.plan.step_choices import residual_choice, step_choices
        from diffsynth_mbc.training.step.timestep_sampling import sampler_from_options

        options, status = self.options, self.status
        # The data first: a latent cache that does not match these options fails before any model loads.
        status.update(phase="reading metadata" + (f" and the latent cache {options.cache}" if options.cache else ""))
        dataset = open_training_dataset(options, substitute_bad_media=True,   # one read of sizes, rank 0's everywhere
                                        read_sizes=rank_zero_sizes(options, accelerator, status))
        validator = Validator(options, status) if options.val_metadata_path else None

        encoders = not options.cache   # with the cache only the DiT (plus LoRA) is needed
        status.update(phase="loading models" + (" (demo: tiny random TI2V-5B architecture)" if options.demo else "")
                      + ("" if encoders else " (DiT only: training from the latent cache)"))
        pipe = training_pipeline(options, str(accelerator.device), torch_dtype(accelerator.mixed_precision),
                                 accelerator.process_index)
        recompute, compile_blocks = step_choices(options, status, accelerator, len(pipe.dit.blocks))
        module = lora_module(pipe, options, recompute_blocks=recompute, compile_blocks=compile_blocks,
                             timestep_sampler=sampler_from_options(options, pipe.scheduler.shift),
                             fp32_residual=residual_choice(options, status, accelerator.mixed_precision))
        start_from_lora(module, options, status)   # --init_lora: before accelerate wraps it (DDP, ZeRO-2 copy it then)
        return dataset, validator, module

    def _prepare(self, accelerator, dataset, module) -> Parts:
        """Plan, loader, optimizer and scheduler, wrapped by accelerate (DDP or DeepSpeed); the EMA and the
        checkpoints."""
        import torch

        from diffsynth_mbc.data.cache.index import file_sha256
        from diffsynth_mbc.data.dataset_list import catalogue_plan
        from diffsynth_mbc.data.media.shapes import IMAGE, VIDEO
        from diffsynth_mbc.training.checkpoints.fingerprint import run_fingerprint
        from diffsynth_mbc.training.lora.ema import LoraEma
        from diffsynth_mbc.training.lora.variants import optimizer_groups
        from diffsynth_mbc.training.plan.batches import ShapeGroupedBatchSampler, key_samples
        from diffsynth_mbc.training.plan.schedule import StepSchedule
        from diffsynth_mbc.training.plan.step_plan import plan_from_options, steps_from_loader

        options, status, rank = self.options, self.status, accelerator.process_index
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
        # One shape per batch (one DiT forward); all ranks' batches in turn, dealt one per rank by accelerate's
        # sharding
        batches = ShapeGroupedBatchSampler(keys, options.dataset_repeat, {VIDEO: options.batch_size,
                                                                          IMAGE: image_batch},
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
        optimizer = adamw(optimizer_groups(module.named_parameters(), options.learning_rate, options.loraplus_lr_ratio),
                          options.learning_rate, options.weight_decay,
                          deepspeed=accelerator.state.deepspeed_plugin is not None)

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
            print(f"[rank {rank}] note: gradient accumulation is {accumulation} (from the DeepSpeed config), not "
                  f"--gradient_accumulation_steps {options.gradient_accumulation_steps}", file=sys.stderr)
            plan = dataclasses.replace(plan, gradient_accumulation=accumulation)
        steps_per_epoch, total_steps = steps_from_loader(len(loader), accumulation, options.num_epochs)
        if steps_per_epoch != plan.steps_per_epoch:
            print(f"[rank {rank}] note: the data loader gives {steps_per_epoch} steps/epoch, the plan said "
                  f"{plan.steps_per_epoch}; using the data loader's", file=sys.stderr)
        schedule = StepSchedule(total_steps, options.warmup_steps, options.lr_scheduler)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule.lr_factor)
        ema = LoraEma(unwrapped_model(accelerator, module), options.ema_decay, options.ema_warmup) \
            if options.ema_decay is not None else None
        checkpoints = Checkpoints(accelerator, module, scheduler, options, status, fingerprint=run_fingerprint(
            options, world_size=accelerator.num_processes, accumulation=accumulation, rows=dataset.rows,
            metadata_sha256=file_sha256(options.dataset_metadata_path), image_batch=image_batch,
            precision=accelerator.mixed_precision), sized_rows=dataset.sized_rows(), ema=ema, schedule=schedule)
        return Parts(options=options, status=status, accelerator=accelerator, module=module, optimizer=optimizer,
                     scheduler=scheduler, schedule=schedule, loader=loader, batches=batches, trainable=trainable, plan=plan,
                     steps_per_epoch=steps_per_epoch, checkpoints=checkpoints, ema=ema)

    def _start_reporting(self) -> ProgressLogger:
        """The progress logger and terminal printer, the status file's plan, and what rank 0 says before the first
        step (step plan, buckets, stages, precision, recompute and compile, the recipe)."""
        from diffsynth_mbc.training.options.run_record import write_run_options
        from diffsynth_mbc.training.reporting.eta import OverheadSchedule
        from diffsynth_mbc.training.reporting.progress import ProgressLogger
        from diffsynth_mbc.training.reporting.recipe import announce_recipe
        from diffsynth_mbc.training.reporting.terminal import TerminalProgress, launcher_streams

        parts, options, status = self.parts, self.options, self.status
        main = parts.accelerator.is_main_process
        line_stream, bar_stream = launcher_streams(os.environ) if main else (None, None)
        printer = TerminalProgress(enabled=main, print_every_s=options.print_every_s, stream=line_stream,
                                   bar_stream=bar_stream)
        logger = ProgressLogger(options.output_path, status, steps_per_epoch=parts.steps_per_epoch,
                                num_epochs=options.num_epochs, samples_per_step=options.batch_size,
                                start_step=self.position.step, printer=printer, total_steps=self.end_step,
                                overhead_schedule=OverheadSchedule.from_options(
                                    options, validation=self.validator is not None,
                                    samples=bool(options.sample_prompts)))
        status.update(plan=parts.plan.as_dict(), lr_scheduler=options.lr_scheduler,
                      max_grad_norm=options.max_grad_norm)
        if main:
            write_run_options(options)   # what reads the run afterwards measures with its settings (python -m ...sample)
            print(f"step plan: {parts.plan.describe()}", file=sys.stderr)
            if status.state.get("resumed_elsewhere"):   # the steps from the checkpoint on, counted for this run
                print(status.state["resumed_elsewhere"]["said"], file=sys.stderr)
            for line in parts.plan.describe_buckets() + parts.plan.describe_stages():
                print(line, file=sys.stderr)
            print(f"precision: {status.state.get('precision_reason')}; {status.state.get('fp32_residual_reason')}",
                  file=sys.stderr)
            print(f"{parts.model.blocks.describe()} ({status.state.get('gradient_checkpointing_reason')}; "
                  f"{status.state.get('compile_reason')})", file=sys.stderr)
        announce_recipe(options, status, main)   # what changes what is trained: the status file, and once here
        logger.track_catalogues(options, parts.plan, parts.accelerator.num_processes)
        return logger

    def _components(self) -> list[Component]:
        """The run's per-step features, in the order their hooks run (module docstring)."""
        from diffsynth_mbc.training.components.best_lora import BestLora
        from diffsynth_mbc.training.components.ema import EmaUpdates
        from diffsynth_mbc.training.components.guards import BadMediaGuard, NonFiniteGuard
        from diffsynth_mbc.training.components.lora_health import LoraHealth
        from diffsynth_mbc.training.components.progress import StepProgress
        from diffsynth_mbc.training.components.sample_clips import SampleClips
        from diffsynth_mbc.training.components.schedules import CheckpointSchedule, StepLoraFiles, StopRequests
        from diffsynth_mbc.training.components.stages import ResolutionStages
        from diffsynth_mbc.training.evaluation.sample_clips import make_sampler
        from diffsynth_mbc.training.plan.evaluation_cost import health_cadence

        parts, options, status, logger = self.parts, self.options, self.status, self.logger
        accelerator, main = parts.accelerator, parts.accelerator.is_main_process
        self.stop_requests = StopRequests(self.signals)   # the recipe asks it how a stop ends (outcome)
        stages = ResolutionStages(parts.plan, parts.schedule, parts.batches, self.epoch_steps.first_step,
                                  accelerator.gradient_accumulation_steps, status, logger.printer) \
            if parts.plan.stages else None
        components = [
            EmaUpdates(parts.ema, status, main) if parts.ema is not None else None,
            NonFiniteGuard(options.max_nonfinite_steps, accelerator.mixed_precision, status,
                           fp32_residual=bool(status.state.get("fp32_residual")),
                           largest_residual=parts.model.blocks.take_largest_residual),
            StepProgress(logger, accelerator),
            BestLora(options, status, self.write_lora, main, stages.ends if stages else (),
                     [row["size"] for row in stages.rows] if stages else ()) if self.validator else None,
            LoraHealth(parts.model.pipe.dit.blocks, status, logger.printer, every=health_cadence(options),
                       total_steps=self.end_step, warmup_steps=options.warmup_steps,
                       read_grads=accelerator.state.deepspeed_plugin is None, accelerator=accelerator,
                       trainable=parts.trainable),
            stages,
            BadMediaGuard(options.max_bad_media_fraction, status, accelerator),
            SampleClips(make_sampler(options, status, accelerator, parts.module, parts.ema), logger,
                        first_step=self.position.step) if options.sample_prompts else None,
            self.stop_requests,
            CheckpointSchedule(options.checkpoint_steps, options.checkpoint_minutes),
            StepLoraFiles(options.save_steps),
        ]
        return [component for component in components if component is not None]

    def _load_component_states(self, saved: dict[str, dict], vanished: list[dict[str, dict]]) -> None:
        """A resumed run's components take their checkpoint's state (and files) back; on rank 0 after a resume on
        fewer processes, the per-rank ones take over the states of the ranks that are gone."""
        if not self.options.resume:
            return
        folder = self.parts.checkpoints.root / self.position.checkpoint
        for component in self.components:
            if saved.get(component.name) is not None:
                component.load_state_dict(saved[component.name])
            for states in vanished if component.per_rank else ():
                if states.get(component.name) is not None:
                    component.take_over(states[component.name])
            component.load_files(folder, self.position.step)

    def _step_parts(self, dataset) -> "StepParts":
        from diffsynth_mbc.training.step.block_runner import CompileTimer
        from diffsynth_mbc.training.step.caption_dropout import CaptionDropout

        parts = self.parts
        rank = parts.accelerator.process_index
        loss_of = functools.partial(forward, parts.module, parts.accelerator, self.status)
        injected = injected_nonfinite_steps(os.environ, rank)
        if injected:   # a test's fault: this rank's loss is NaN at these steps
            def loss_of(batch, plain=loss_of):
                loss = plain(batch)
                return loss * float("nan") if self.position.step + 1 in injected else loss
        return StepParts(captions=CaptionDropout.from_options(self.options, rank, dataset, self.status),
                         compile_timer=CompileTimer(enabled=parts.accelerator.is_main_process
                                                    and parts.model.blocks.compiled),
                         loss_of=loss_of)

    # -----------------------------------------------------------------------------------------
    # train

    def train(self) -> None:
        """Every remaining epoch, then ``finish`` (unless a stop request ended the run), then ``cleanup``. A run that
        fails with a broken LoRA says what the components add (what became of ``lora-best``)."""
        from diffsynth_mbc.training.components.guards import NonFiniteError
        from diffsynth_mbc.training.components.lora_health import UnhealthyRunError

        try:
            decision = run_hook(self.components, "at_start", self.context())
            if decision.stop is None:
                decision = self.train_epochs()
            run_hook(self.components, "after_training", self.context(samples_seen=self.position.samples_seen))
            if decision.stop is not Stop.REQUESTED:
                self.finish(decision.stop)
            else:   # every rank stopped at the same step; none tears down the process group under another's collective
                wait_for_everyone(self.parts.accelerator, self.status, "ranks to stop")
        except (NonFiniteError, UnhealthyRunError) as error:
            notes = [note for component in self.components if (note := component.failure_note(error))]
            if not notes:
                raise
            raise type(error)(". ".join([str(error).rstrip("."), *notes])) from None
        self.cleanup()

    def context(self, **fields) -> StepContext:
        return StepContext(step=self.position.step, epoch=self.position.epoch, total_steps=self.end_step, **fields)

    def train_epochs(self) -> Decision:
        self.logger.on_train_begin()
        self.signals.graceful = True
        for epoch in range(self.position.epoch, self.options.num_epochs):
            decision = self.train_epoch(epoch)
            # a stop request or an early stop ends the run here, after the epoch's file when its last step was the
            # epoch's (a resume starts at the next epoch: the file would never be written)
            if decision.stop is None or self.position.epoch != epoch:
                self.write_lora(epoch_file_name(epoch, self.options.num_epochs))
                self.logger.on_epoch_end(save_epoch_file=False)
            if decision.stop is Stop.REQUESTED:   # its checkpoint is saved: the status says how the run stopped
                status, phase = self.stop_requests.outcome(self.position.step)
                self.status.set_status(status, phase=phase)
            if decision.stop is not None:
                return decision
        return CONTINUE

    def train_epoch(self, epoch: int) -> Decision:
        import torch

        parts, position, step_parts = self.parts, self.position, self.step_parts
        self.logger.on_epoch_begin(epoch)
        parts.loader.set_epoch(epoch)
        parts.batches.set_epoch(epoch)
        skip = position.batches_in_epoch if epoch == position.epoch else 0
        position.epoch, position.batches_in_epoch = epoch, skip
        # Resuming mid-epoch: skip the batches already trained on without decoding them.
        epoch_batches = parts.accelerator.skip_first_batches(parts.loader, skip) if skip else parts.loader
        losses, samples, tokens, bad, drawn, rows = [], 0, 0, [], [], []
        draws = parts.model.draws   # each sample's timestep and loss, for the history
        for batch in iterate_waiting_at_start(epoch_batches, self.status):
            bad_here = [record for sample in batch for record in sample.pop("skipped", ())]
            rows += [sample["row"] - 1 for sample in batch]   # 0-based rows of the run's metadata
            if not losses:
                step_parts.compile_timer.step_started()
            tokens += sum(sample_tokens(sample) for sample in batch)
            step_parts.captions.apply(batch, epoch, position.batches_in_epoch)
            self.choose_modes(batch, epoch)
            self.logger.count_catalogues(batch)   # several catalogues: each one's samples this epoch
            micro = forward_backward(parts, batch, losses, step_parts.loss_of, self.on_gradients)
            losses.append(micro.loss.detach())
            drawn += draws.take(with_shapes=True)
            bad += bad_here
            samples += len(batch) + len(bad_here)   # the bad media replaced by other rows count as seen
            position.batches_in_epoch += 1
            if not micro.step_done:
                continue
            step_parts.compile_timer.step_finished()
            result = StepResult(loss=torch.stack(losses).mean().item(), lr=micro.lr, grad_norm=micro.grad_norm,
                                skipped=micro.skipped, samples=samples, tokens=tokens, bad_media=bad, draws=drawn,
                                rows=rows)
            decision = self.after_optimizer_step(result)
            losses, samples, tokens, bad, drawn, rows = [], 0, 0, [], [], []
            if decision.stop is not None:
                return decision
        return CONTINUE

    def choose_modes(self, batch: list[dict], epoch: int) -> None:
        """Each sample's training mode (t2i / i2v / t2v, ``training/step/objective.py``), from its place in the
        run."""
        from diffsynth_mbc.training.step.micro_batch import latent_frames
        from diffsynth_mbc.training.step.objective import training_mode

        options, rank = self.options, self.parts.accelerator.process_index
        for place, sample in enumerate(batch):
            sample["mode"] = training_mode(options.objective, options.i2v_probability, latent_frames(sample) == 1,
                                           options.seed, rank, epoch, self.position.batches_in_epoch, place)

    def on_gradients(self, grad_norm, max_norm: float) -> None:
        for component in self.components:
            component.on_gradients(self.position.step + 1, grad_norm, max_norm)

    def after_optimizer_step(self, result: StepResult) -> Decision:
        """What follows every optimizer step, in the order of the module docstring."""
        position = self.position
        position.step += 1
        position.samples_seen += result.samples
        if position.batches_in_epoch >= len(self.parts.loader):
            position.epoch, position.batches_in_epoch, position.epoch_before = position.epoch + 1, 0, []
        agreed = agree(self.parts.accelerator, [component.votes(result) for component in self.components],
                       self.status)
        context = self.context(result=result, agreed=agreed)
        decision = run_hook(self.components, "after_step", context)
        if self.validator and self.validator.due(position.step):
            decision |= self.validate(context)
        if decision.stop is Stop.REQUESTED:
            self.save_checkpoint()
            return decision
        if decision.checkpoint:
            self.save_checkpoint()
        if decision.lora_file:
            self.write_lora(decision.lora_file)
        return decision

    def validate(self, context: StepContext) -> Decision:
        """The validation of this step: measured (every rank), the components' ``after_validation``, its record."""
        with self.logger.overhead("validation"):
            validation = self.validator.measure(context.step)
        if validation is None:
            return CONTINUE
        context.validation = validation
        decision = run_hook(self.components, "after_validation", context)
        self.validator.write(validation)
        self.logger.on_validation(self.parts.accelerator)
        return decision

    def save_checkpoint(self) -> None:
        self.logger.timed("checkpoint", self.parts.checkpoints.save, self.position, self.components)

    def write_lora(self, file_name: str, step: int | None = None) -> None:
        """A LoRA file in the output folder (every rank calls it), timed apart from the steps."""
        self.logger.timed("lora", self.parts.checkpoints.save_lora, file_name,
                          self.position.step if step is None else step)

    # -----------------------------------------------------------------------------------------
    # finish and cleanup

    def finish(self, stop: Stop | None) -> None:
        """The end of the run (its planned total, or ``--early_stop``'s): the last validation, the components' end
        (the best LoRA's last word, the LoRA's health, the last sample clips), the LoRA file and the last checkpoint
        (an early stop's always, as a stop request's)."""
        options, position = self.options, self.position
        context = self.context(stop=stop)
        if self.validator and not self.validator.due(position.step):
            self.validate(context)
        run_hook(self.components, "at_end", context)
        self.write_lora(FINAL_LORA)
        scheduled = bool(options.checkpoint_steps or options.checkpoint_minutes)
        if (scheduled or stop is Stop.EARLY) and self.parts.checkpoints.last_step != position.step:
            self.save_checkpoint()
        wait_for_everyone(self.parts.accelerator, self.status, "ranks to finish")
        self.logger.on_training_end()

    def cleanup(self) -> None:
        from diffsynth_mbc.lifecycle.run_lock import follow_run_log, launcher_gone

        if launcher_gone():   # a rank that stopped on another rank's word has not followed the log yet
            follow_run_log()
        self.logger.print_summary()   # once: after finish() it was printed already; after a stop, here
        self.parts.accelerator.end_training()


@dataclass(frozen=True)
class StepParts:
    """What the recipe's step loop uses besides the parts."""
    captions: object        # --caption_dropout (training/step/caption_dropout.py)
    compile_timer: object   # says the first (compiling) steps' time (training/step/block_runner.py)
    loss_of: object         # batch -> loss (the module's forward; a test's injected NaN where asked)
