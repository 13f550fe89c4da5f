"""A rank's stop signals, each in a process of its own: the scheduler's warning (SIGUSR1) and, in a job of
launchers/train.sbatch, its SIGTERM end the run `preempted`; the warning lets loading finish (the first step's
checkpoint is what a requeued job goes on from); a data-loader worker outlives the scheduler's signals."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest

from diffsynth_mbc import environment

RANK = """
import json, os, signal, sys, time
from diffsynth_mbc.lifecycle.signals import StopSignals

signals = StopSignals(on_stuck=lambda sig: None, grace_s=10.0, hard_grace_s=60.0,
                      scheduler_job=sys.argv[2] == "job").install()
signals.graceful = sys.argv[3] == "training"
interrupted = False
try:
    os.kill(os.getpid(), getattr(signal, sys.argv[1]))
    signals.requested.wait(60)   # the signal thread took it (on a busy machine, not at once)
    # then loading (or a step) goes on: for as long as an interruption may take to come where one is expected,
    # else for a second (one that waits for the step comes after grace_s). Neither grace runs out here: each is
    # long, so that a process the machine holds back for a while still ends as it would
    deadline = time.monotonic() + float(sys.argv[4])
    while time.monotonic() < deadline:
        time.sleep(0.01)
except KeyboardInterrupt:
    interrupted = True
print(json.dumps({"requested": signals.requested.is_set(), "preempted": signals.preempted,
                  "status": signals.stop_status, "interrupted": interrupted, "why": signals.describe()}))
signals.finished()
"""


def rank_stop(sig: str, job: bool, phase: str, interrupted: bool = False, background: bool = False) -> dict:
    """How a rank ends ``sig`` in ``phase``; ``interrupted``: a stop at once is expected (waited for up to 60 s);
    ``background``: started as a script starts a command in the background (``cmd &``: SIGINT ignored)."""
    ignore_sigint = (lambda: signal.signal(signal.SIGINT, signal.SIG_IGN)) if background else None
    result = subprocess.run([sys.executable, "-c", RANK, sig, "job" if job else "-", phase,
                             "60" if interrupted else "1"], capture_output=True, text=True, timeout=120,
                            preexec_fn=ignore_sigint)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


@pytest.mark.parametrize("phase", ["loading", "training"])
def test_the_schedulers_warning_is_a_preemption_that_lets_loading_finish(phase):
    stop = rank_stop("SIGUSR1", job=False, phase=phase)   # anywhere: nothing else sends it
    assert stop == {"requested": True, "preempted": True, "status": "preempted", "interrupted": False,
                    "why": "SIGUSR1: the scheduler's warning before the job's end"}


@pytest.mark.parametrize("background", [False, True])
def test_a_sigterm_is_the_schedulers_in_its_job_only(background):
    """During loading it stops at once, as ever: in a rank started in the background too (a batch script's
    ``srun ... &``), where it waited out the hard grace and was killed, as SIGINT, ignored, interrupted nothing."""
    in_job = rank_stop("SIGTERM", job=True, phase="loading", interrupted=True, background=background)
    assert in_job == {"requested": True, "preempted": True, "status": "preempted", "interrupted": True,
                      "why": "SIGTERM from the scheduler"}
    assert rank_stop("SIGTERM", job=True, phase="training")["status"] == "preempted"
    alone = rank_stop("SIGTERM", job=False, phase="training")
    assert alone["status"] == "stopped" and not alone["preempted"] and alone["why"] == "SIGTERM"
    assert rank_stop("SIGINT", job=True, phase="training")["status"] == "stopped"   # a person's Ctrl-C


WORKER = """
import os, signal, sys, time
from diffsynth_mbc.lifecycle.signals import RANK_SIGNALS, unblock_in_child

signal.pthread_sigmask(signal.SIG_BLOCK, RANK_SIGNALS)   # as a rank's worker inherits its mask
unblock_in_child()
os.kill(os.getpid(), getattr(signal, sys.argv[1]))
time.sleep(0.2)
print("alive")
"""


@pytest.mark.parametrize("sig,job,survives", [("SIGUSR1", False, True), ("SIGTERM", True, True),
                                              ("SIGTERM", False, False)])
def test_a_data_loader_worker_outlives_the_schedulers_signals_only(sig, job, survives):
    """Every process of a SLURM job gets the scheduler's signals: a worker that died of them would fail its rank's
    next batch instead of the rank finishing its step and checkpointing."""
    env = {**os.environ, environment.SLURM_JOB: "1234"} if job else \
        {key: value for key, value in os.environ.items() if key != environment.SLURM_JOB}
    result = subprocess.run([sys.executable, "-c", WORKER, sig], capture_output=True, text=True, timeout=60, env=env)
    if survives:
        assert result.returncode == 0 and result.stdout.strip() == "alive", result.stderr
    else:
        assert result.returncode == -signal.SIGTERM


RANK_WITH_WORKER = """
import multiprocessing, os, signal, sys, time
from diffsynth_mbc.lifecycle.signals import unblock_in_child

def work():
    unblock_in_child()
    time.sleep(120)

worker = multiprocessing.Process(target=work, daemon=True)
worker.start()
time.sleep(0.5)
print(worker.pid, flush=True)
os.kill(os.getpid(), signal.SIGKILL)   # the rank killed (KillWait's end, a crash): nothing of it cleans up
"""


def test_a_data_loader_worker_that_outlives_sigterm_still_ends_with_its_rank():
    """A worker ignoring the scheduler's SIGTERM, its rank killed: it used to stay, blocked, its parent pid 1."""
    import psutil

    result = subprocess.run([sys.executable, "-c", RANK_WITH_WORKER], capture_output=True, text=True, timeout=60,
                            env={**os.environ, environment.SLURM_JOB: "1234"})
    assert result.returncode == -signal.SIGKILL, result.stderr
    worker = psutil.Process(int(result.stdout.split()[0]))
    try:
        worker.wait(timeout=10)
    except psutil.NoSuchProcess:
        pass
    except psutil.TimeoutExpired:
        worker.kill()
        raise AssertionError("the worker outlived its rank") from None
