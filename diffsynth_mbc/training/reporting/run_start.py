"""What a run sets up before its first step to report progress: the progress logger and terminal printer, the
status file's plan, the lines rank 0 prints (step plan, buckets, precision, recompute and compile), the recipe, and
the guards and checkpoint schedule the loop consults after each step."""

from __future__ import annotations

import os
import sys

from diffsynth_mbc.training.checkpoints.state import CheckpointSchedule
from diffsynth_mbc.training.distributed.accelerator import unwrapped_model
from diffsynth_mbc.training.options.run_record import write_run_options
from diffsynth_mbc.training.step.block_runner import CompileTimer
from diffsynth_mbc.training.step.guards import BadMediaGuard, NonFiniteGuard, injected_steps


def start_progress(run) -> None:
    """The ``Run``'s logger, compile timer, schedule and guards, and what rank 0 says before the first step."""
    from diffsynth_mbc.training.reporting.eta import OverheadSchedule
    from diffsynth_mbc.training.reporting.progress import ProgressLogger
    from diffsynth_mbc.training.reporting.recipe import announce_recipe
    from diffsynth_mbc.training.reporting.terminal import TerminalProgress, launcher_streams

    options, position = run.options, run.position
    main = run.accelerator.is_main_process
    line_stream, bar_stream = launcher_streams(os.environ) if main else (None, None)
    printer = TerminalProgress(enabled=main, print_every_s=options.print_every_s, stream=line_stream,
                               bar_stream=bar_stream)
    run.logger = ProgressLogger(options.output_path, run.status, steps_per_epoch=run.steps_per_epoch,
                                num_epochs=options.num_epochs, samples_per_step=options.batch_size,
                                start_step=position.step, printer=printer,
                                overhead_schedule=OverheadSchedule.from_options(
                                    options, validation=run.validator is not None, samples=run.sampler is not None))
    run.status.update(plan=run.plan.as_dict(), skipped_samples=position.skipped_samples,
                      skip_reasons=position.recent_skips, lr_scheduler=options.lr_scheduler,
                      max_grad_norm=options.max_grad_norm)
    blocks = unwrapped_model(run.accelerator, run.module).blocks
    run.compile_timer = CompileTimer(enabled=main and blocks.compiled)
    if main:
        write_run_options(options)   # what reads the run afterwards measures with its settings (python -m ...sample)
        print(f"step plan: {run.plan.describe()}", file=sys.stderr)
        for line in run.plan.describe_buckets() + run.plan.describe_stages():
            print(line, file=sys.stderr)
        print(f"precision: {run.status.state.get('precision_reason')}; {run.status.state.get('fp32_residual_reason')}",
              file=sys.stderr)
        print(f"{blocks.describe()} ({run.status.state.get('gradient_checkpointing_reason')}; "
              f"{run.status.state.get('compile_reason')})", file=sys.stderr)
    announce_recipe(options, run.status, main)   # what changes what is trained: the status file, and once here
    run.logger.track_catalogues(options, run.plan, run.accelerator.num_processes)
    run.schedule = CheckpointSchedule(options.checkpoint_steps, options.checkpoint_minutes)
    run.bad_media = BadMediaGuard(options.max_bad_media_fraction)
    run.nonfinite = NonFiniteGuard(options.max_nonfinite_steps, run.accelerator.mixed_precision,
                                   fp32_residual=bool(run.status.state.get("fp32_residual")))
    run.injected_nonfinite = injected_steps(os.environ, run.accelerator.process_index)
