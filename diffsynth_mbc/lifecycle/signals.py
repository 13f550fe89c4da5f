"""Ctrl-C, SIGTERM and SIGHUP, seen even while the main thread is stuck inside a collective or a C call.

A Python signal handler only runs when the main thread returns to the interpreter, which a rank
blocked in an NCCL/gloo all-reduce never does. So the stop signals (``STOP_SIGNALS``, the one table, which the
supervisor uses too) are blocked in the main thread and
received by a small thread with ``sigwait``:

- while ``graceful`` is off (loading models, preparing), the main thread is interrupted at once
  (KeyboardInterrupt);
- while ``graceful`` is on (the training loop), ``requested`` is set; the loop finishes its step,
  agrees with the other ranks, saves a checkpoint and stops. If that takes longer than
  ``grace_s``, the main thread is interrupted.

Either way, if the main thread has not finished ``hard_grace_s`` after being interrupted, the
thread calls ``on_stuck`` (which records the stop) and exits the process.

A repeated stop request is the same request: another SIGTERM (two ``stop.sh`` at once, a supervisor
passing on a stop while ``stop.sh`` sends its own) changes nothing, so the step still finishes and the
checkpoint is still written. Only a second SIGINT, a person's second Ctrl-C (the supervisor passes that
on as SIGINT), records the stop and exits at once.

``request(reason)`` asks for the same stop from inside the process (a rank whose launcher died): it
names the reason and sends the process SIGTERM, so every path above applies unchanged.

**Preemption.** ``PREEMPT_SIGNAL`` (SIGUSR1) is a scheduler's warning that the job ends soon (``launchers/train.sbatch``
asks SLURM for it N seconds before the time limit; every process of the job gets it): the same stop, which ends in
status ``preempted``, and, as the warning leaves time, one that waits for the first step when it comes during
loading, so the checkpoint a requeued job goes on from is always written. In a job of ``train.sbatch``
(``MBC_SLURM_JOB`` set) a SIGTERM is the scheduler's too (``scancel``, a preemption, the time limit): the same stop as
ever, ending ``preempted``. ``preempted`` says which; ``stop_status`` is the status either ends in.
"""

from __future__ import annotations

import _thread
import os
import signal
import threading
from typing import Callable

from diffsynth_mbc import environment, run_files
from diffsynth_mbc.lifecycle.processes import end_with_parent

# Each asks a run to stop as Ctrl-C does (finish the step, checkpoint, write 'stopped'): in the supervisor and in
# every rank. SIGHUP is the launcher's terminal closing.
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
NOW_SIGNAL = signal.SIGINT   # after a stop was requested: stop now (a person's second Ctrl-C)
# The scheduler's warning before the job's end (module docstring): the same stop, ending 'preempted'. Every process
# of a SLURM job step gets it: the ones that do not stop on it (the launcher's shell, accelerate, data-loader workers)
# ignore it.
PREEMPT_SIGNAL = signal.SIGUSR1
RANK_SIGNALS = STOP_SIGNALS + (PREEMPT_SIGNAL,)   # what a rank's signal thread waits for


class StopSignals:
    def __init__(self, on_stuck: Callable[[int], None], grace_s: float = 300.0, hard_grace_s: float = 15.0,
                 scheduler_job: bool = False):
        self.on_stuck = on_stuck
        self.grace_s = grace_s
        self.hard_grace_s = hard_grace_s
        self.scheduler_job = scheduler_job   # in a job of train.sbatch: a SIGTERM is the scheduler's
        self.graceful = False
        self.received: int | None = None
        self.reason: str | None = None
        self.requested = threading.Event()
        self.repeated = 0   # stop requests received again after the first (ignored)
        self._finished = threading.Event()

    def install(self) -> "StopSignals":
        """Call from the main thread before other threads start (they inherit the blocked mask). The preemption
        signal, ignored by the processes above the rank, is taken here again (blocked first, so none is lost)."""
        self._previous_mask = signal.pthread_sigmask(signal.SIG_BLOCK, RANK_SIGNALS)
        self._previous_preempt_action = signal.signal(PREEMPT_SIGNAL, signal.SIG_DFL)
        # The main thread is interrupted through Python's SIGINT handler (``_thread.interrupt_main``), which does
        # nothing while SIGINT is ignored: in a process a script started in the background (``cmd &``, as a batch
        # script starts its steps), which Python keeps. SIGINT itself is blocked here and waited for by the thread.
        self._previous_int_action = signal.signal(signal.SIGINT, signal.default_int_handler)
        threading.Thread(target=self._wait, name="stop-signals", daemon=True).start()
        return self

    def finished(self) -> None:
        """The main thread has recorded the outcome; no forced exit is needed. The signal mask is restored, so
        a process that goes on (``main`` called in-process) and the processes it starts receive signals again."""
        self._finished.set()
        if getattr(self, "_previous_mask", None) is not None:
            signal.signal(PREEMPT_SIGNAL, self._previous_preempt_action)
            signal.signal(signal.SIGINT, self._previous_int_action)
            signal.pthread_sigmask(signal.SIG_SETMASK, self._previous_mask)

    def request(self, reason: str) -> None:
        """Stop as on SIGTERM, for ``reason`` (shown in the status: "stopped ... (its launcher ... ended)")."""
        if not self.requested.is_set():
            self.reason = reason
            os.kill(os.getpid(), signal.SIGTERM)

    def describe(self) -> str:
        """What asked for the stop: the reason given to ``request``, else the signal (the scheduler's, said so),
        else another rank."""
        if self.reason:
            return self.reason
        if not self.received:
            return "made on another rank"
        name = signal.Signals(self.received).name
        if self.received == PREEMPT_SIGNAL:
            return f"{name}: the scheduler's warning before the job's end"
        return f"{name} from the scheduler" if self.preempted else name

    @property
    def preempted(self) -> bool:
        """The stop is the scheduler's (module docstring): the warning signal, or a SIGTERM in a scheduler's job."""
        return not self.reason and (self.received == PREEMPT_SIGNAL
                                    or (self.received == signal.SIGTERM and self.scheduler_job))

    @property
    def stop_status(self) -> str:
        return run_files.STATUS_PREEMPTED if self.preempted else run_files.STATUS_STOPPED

    @property
    def exit_code(self) -> int:
        return 128 + (self.received or signal.SIGINT)

    def _wait(self) -> None:
        self.received = signal.sigwait(RANK_SIGNALS)
        self.requested.set()
        threading.Thread(target=self._second_signal, name="stop-signals-second", daemon=True).start()
        # A warning leaves time: during loading too the stop waits for the first step (and its checkpoint).
        if (self.graceful or self.received == PREEMPT_SIGNAL) and self._finished.wait(self.grace_s):
            return
        _thread.interrupt_main(signal.SIGINT)
        if self._finished.wait(self.hard_grace_s):
            return
        self._give_up(self.received)

    def _second_signal(self) -> None:
        while signal.sigwait(RANK_SIGNALS) != NOW_SIGNAL:
            self.repeated += 1   # the same request again (the scheduler's SIGTERM after its warning too): goes on
        self._give_up(NOW_SIGNAL)

    def _give_up(self, received: int) -> None:
        try:
            self.on_stuck(received)
        finally:
            os._exit(128 + received)


def unblock_in_child(*_args) -> None:
    """worker_init_fn for data-loader workers: they must die on SIGTERM like any process, but for the scheduler's
    signals, which reach every process of a SLURM job: there the rank stops, and its workers end with it (a worker
    dying first would fail the rank's next batch instead of letting it finish its step and checkpoint). However
    their rank ends, they end with it."""
    end_with_parent(os.getppid())
    signal.signal(PREEMPT_SIGNAL, signal.SIG_IGN)
    if os.environ.get(environment.SLURM_JOB):
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, RANK_SIGNALS)


def end_workers_in_job() -> None:
    """In a scheduler's job the rank's data-loader workers outlive SIGTERM (``unblock_in_child``), which is what
    multiprocessing ends a process's workers with at its exit, before it waits for them: the rank ends them itself
    first, when its run is over (SIGKILL: a worker holds nothing to save)."""
    if not os.environ.get(environment.SLURM_JOB):
        return
    import multiprocessing

    workers = [child for child in multiprocessing.active_children() if child.daemon]
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)   # torch's handler would take their end for a failure
    for worker in workers:
        worker.kill()
    for worker in workers:
        worker.join(timeout=30)
