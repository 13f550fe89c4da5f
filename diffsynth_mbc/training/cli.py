"""LoRA fine-tuning of Wan2.2-TI2V-5B through DiffSynth's own pipeline, loss and LoRA injection.

Started by ``accelerate launch`` (DDP, DeepSpeed ZeRO-2 and several nodes come from accelerate's
config), e.g. ``bash launchers/train_test.sh``. Every rank writes ``LOG_DIR/training_gpu{rank}.json``
from its first instant (status ``starting``), then ``loading``, ``training`` and finally
``finished``, ``failed`` (with the error), ``stopped`` or ``preempted`` (the scheduler ended the job:
``diffsynth_mbc.lifecycle.signals``).

Started by a launcher, each rank holds the run's folder locks itself and stops as on SIGTERM when its
launcher dies; started without one, the ranks take the locks themselves (``diffsynth_mbc.lifecycle.run_lock``).

Exit codes: 0 finished, or stopped (or preempted) cleanly by Ctrl-C/SIGTERM/the scheduler's SIGUSR1 (the step
finished and a checkpoint was saved), or a resume of a run that has ended (nothing to train: nothing written); 1
failed; 2 bad options, model files or checkpoint; 75 the folders belong to another run;
130/143 stopped by a signal before training began, or by a second signal.
"""

from __future__ import annotations

import os
import sys
import time
import traceback

from diffsynth_mbc import run_files
from diffsynth_mbc import environment
from diffsynth_mbc.errors import OptionsError
from diffsynth_mbc.data.media.media_probe import quiet_pil_pixel_warnings
from diffsynth_mbc.gpu import UnsupportedGpuError
from diffsynth_mbc.lifecycle.run_lock import (RunLockError, follow_run_log, hold_run_locks, lock_without_launcher,
                                              release, watch_launcher)
from diffsynth_mbc.lifecycle.signals import StopSignals, end_workers_in_job
from diffsynth_mbc.models.model_files import ModelFileError
from diffsynth_mbc.run_files import rank_from_environment
from diffsynth_mbc.sample_prompts import run_sample_prompts
from diffsynth_mbc.training.checkpoints.folder import resumed_run_id
from diffsynth_mbc.training.checkpoints.resume import ended_run_note, refuse_early
from diffsynth_mbc.training.checkpoints.space import CheckpointWriteError
from diffsynth_mbc.training.components.lora_health import UnhealthyRunError
from diffsynth_mbc.training.options import check_run_id, resolve_options
from diffsynth_mbc.training.reporting.status_writer import RankStatusWriter
from diffsynth_mbc.training.components.guards import NonFiniteError, TooMuchBadMedia


def default_run_id() -> str:
    """Same on every rank of one launch: the launcher exports MBC_RUN_ID; else derived from the rendezvous."""
    if os.environ.get(environment.RUN_ID):
        check_run_id(os.environ[environment.RUN_ID], f"{environment.RUN_ID} (environment)")
        return os.environ[environment.RUN_ID]
    return f"run-{os.environ.get('MASTER_PORT', '0')}-{time.strftime('%Y%m%d-%H%M')}"


def main(argv: list[str] | None = None) -> int:
    rank, local_rank, world_size = rank_from_environment()
    quiet_pil_pixel_warnings()   # a large image would warn at every decode; the converter's --probe says it once
    try:
        options = resolve_options(argv)
        # A resumed run goes on under its own run id (history, elapsed time and trackers continue).
        run_id = (options.run_id or resumed_run_id(options.resume, options.checkpoint_dir)
                  or default_run_id())
        check_run_id(run_id, "the run id")
    except OptionsError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    ended = ended_resume(options, run_id, rank, world_size)   # before the locks: it writes nothing at all
    if ended is not None:
        return ended
    try:   # before any file is written: the folders may be another run's
        unlaunched = take_run_locks(options, run_id, local_rank)
    except RunLockError as exc:
        print(f"[rank {rank}] error: {exc}", file=sys.stderr)
        return 75
    try:
        return train_under_lock(options, run_id, rank, local_rank, world_size)
    finally:
        release(unlaunched)


def ended_resume(options, run_id: str, rank: int, world_size: int) -> int | None:
    """The exit code of a ``--resume`` of a run that has ended (0, rank 0 saying there is nothing to train; 2 when
    refused as under the locks), taking no lock and writing nothing; None for every other run."""
    if not options.resume:
        return None
    try:
        said = ended_run_note(options, run_id, world_size, report=note_on(rank))
    except OptionsError as exc:
        return refuse(rank, str(exc))
    if not said:
        return None
    if rank == 0:
        print(said, file=sys.stderr)
    return 0


# A launcher stops every rank once one ends with an error: the other ranks give rank 0 this long to say why first.
REFUSAL_SAID_BY_RANK_0_S = 10.0


def refuse(rank: int, message: str) -> int:
    """Exit code 2 for a refusal every rank makes from the same files, said once: by rank 0. A rank that ended first
    would have the launcher (accelerate's agent) stop rank 0 before it said why, so the other ranks wait; one still
    running then (rank 0 did not refuse: its node's files differ) says it itself."""
    if rank != 0:
        time.sleep(REFUSAL_SAID_BY_RANK_0_S)
    print(f"{f'[rank {rank}] ' if rank else ''}error: {message}", file=sys.stderr)
    return 2


def note_on(rank: int):
    """Where the refusals' notes go: rank 0's stderr; the other ranks say nothing."""
    return (lambda message: print(f"note: {message}", file=sys.stderr)) if rank == 0 else None


def take_run_locks(options, run_id: str, local_rank: int) -> list[int]:
    """The launcher's locks (``MBC_RUN_LOCKS``), or, started without a launcher, the folders' locks taken here
    (returned, to release when the training ends in a process that goes on)."""
    if environment.RUN_LOCKS in os.environ:
        hold_run_locks()
        return []
    machine_rank = int(os.environ.get("GROUP_RANK") or 0)
    return lock_without_launcher([options.output_path, options.log_dir, options.checkpoint_dir], run_id,
                                 local_rank, machine_rank)


def train_under_lock(options, run_id: str, rank: int, local_rank: int, world_size: int) -> int:
    try:   # before any file is written: a refusal leaves the folders as they were
        refuse_early(options, run_id, world_size, report=note_on(rank))
        if options.sample_prompts:   # every entry checked before the model loads
            run_sample_prompts(options)
    except OptionsError as exc:
        return refuse(rank, str(exc))
    status = RankStatusWriter(options.log_dir, run_id, rank, local_rank, world_size,
                              keep_old_histories=options.keep_old_histories,
                              min_interval_s=options.status_interval_s, continue_history=bool(options.resume))
    status.update(launch_id=os.environ.get(environment.RUN_ID))   # the launch that started this process
    signals = StopSignals(grace_s=options.stop_grace_s, scheduler_job=bool(os.environ.get(environment.SLURM_JOB)),
                          on_stuck=lambda sig: status.set_status(
                              signals.stop_status, phase=f"{signals.stop_status} by signal {sig} while in: "
                                                         f"{status.state['phase']}"))
    signals.install()
    watch = watch_launcher(lambda reason: (follow_run_log(), signals.request(reason)))
    try:
        from diffsynth_mbc.training.recipe import train

        train(options, status, signals)
        return 0
    except KeyboardInterrupt:
        by = signals.describe() if signals.requested.is_set() else "SIGINT"
        ended = signals.stop_status if signals.requested.is_set() else run_files.STATUS_STOPPED
        status.set_status(ended, phase=f"{ended} by {by} during: {status.state['phase']}")
        print(f"[rank {rank}] {ended}", file=sys.stderr)
        return signals.exit_code
    except (ModelFileError, OptionsError, UnsupportedGpuError) as exc:
        status.fail(exc)
        print(f"[rank {rank}] error: {exc}", file=sys.stderr)
        return 2
    except (NonFiniteError, TooMuchBadMedia, CheckpointWriteError, UnhealthyRunError) as exc:
        status.fail(exc)
        print(f"[rank {rank}] failed: {exc}", file=sys.stderr)
        return 1
    except BaseException as exc:  # noqa: BLE001 - recorded, then reported as failure
        status.fail(exc)
        traceback.print_exc()
        print(f"[rank {rank}] failed: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    finally:
        if watch:
            watch.stop()
        end_workers_in_job()
        signals.finished()
        status.close()
