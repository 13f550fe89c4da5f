"""stop.sh signals only the run's own processes: never through a lock that is not a regular file, never a
process that merely holds the lock file open. Real processes and signals, no training."""

from __future__ import annotations

import os
import signal
import subprocess
import time

import pytest

from diffsynth_mbc.training.processes import alive
from diffsynth_mbc.training.run_control import lock_holders
from e2e_helpers import REPO, isolated_env, read_status

STOP = str(REPO / "launchers" / "stop.sh")


def stop(work, folder, *args):
    return subprocess.run(["bash", STOP, str(folder), *(args or ("--grace", "2"))], cwd=work, env=isolated_env(work),
                          capture_output=True, text=True, timeout=60)


@pytest.fixture
def bystander(tmp_path):
    """An unrelated process holding a file open (as a database or an editor would)."""
    target = tmp_path / "elsewhere" / "data.db"
    target.parent.mkdir()
    target.write_text("precious\n")
    process = subprocess.Popen(["bash", "-c", 'exec 3<"$1"; exec sleep 120', "_", str(target)])
    deadline = time.monotonic() + 10
    while process.pid not in lock_holders(target):
        assert time.monotonic() < deadline
        time.sleep(0.05)
    yield target, process
    process.kill()
    process.wait()


def test_a_lock_that_is_a_symlink_is_refused_and_nothing_is_signalled(tmp_path, bystander):
    """A symlink to a file the test's own bystander holds: the same refusal protects whatever a link points at
    (a link to /dev/null once meant SIGTERM, then SIGKILL, to every process with /dev/null open)."""
    target, process = bystander
    run = tmp_path / "runs" / "x" / "lora"
    run.mkdir(parents=True)
    (run / ".train.lock").symlink_to(target)
    (run / ".train.pid").write_text(f"{process.pid}\nrun-x\n")
    result = stop(tmp_path, run)
    assert result.returncode == 2, result.stderr
    assert "refusing the lock" in result.stderr and "symbolic link" in result.stderr
    assert "stopped" not in result.stderr
    time.sleep(0.5)
    assert process.poll() is None, "the bystander was signalled"


def test_a_process_holding_the_lock_that_is_not_the_runs_is_left_alone(tmp_path, bystander):
    """Even with its pid in the record: a `sleep` is not a launcher, accelerate or rank."""
    target, process = bystander
    run = target.parent
    lock = run / ".train.lock"
    target.rename(lock)   # the bystander's open file is now, by name, the folder's lock
    (run / ".train.pid").write_text(f"{process.pid}\nrun-x\n")
    result = stop(tmp_path, run)
    assert result.returncode == 3, result.stderr
    assert f"{process.pid} hold(s) the lock but are not this run's" in result.stderr
    assert "no training is running" in result.stderr
    time.sleep(0.5)
    assert process.poll() is None, "the bystander was signalled"


@pytest.mark.slow
def test_stop_sh_kills_a_hung_rank_marks_it_failed_and_says_so(tmp_path):
    """A detached demo whose rank 1 hangs (SIGSTOP): the grace runs out, the ranks are killed, their status files
    say failed (not `training` forever), and stop.sh exits 1 naming what it killed."""
    launched = subprocess.run(["bash", str(REPO / "launchers" / "train_test.sh"), "--demo", "--detach",
                               "--num_epochs", "5000"], cwd=tmp_path, env=isolated_env(tmp_path, OMP_NUM_THREADS=1),
                              capture_output=True, text=True, timeout=120)
    assert launched.returncode == 0, launched.stderr
    log_dir, output = tmp_path / "runs/demo/training_logs", tmp_path / "runs/demo/lora"
    rank_pids = []
    try:
        deadline = time.monotonic() + 180
        while not rank_pids:
            assert time.monotonic() < deadline, "the ranks never started training"
            try:
                states = [read_status(log_dir, rank) for rank in (0, 1)]
                if all(s["status"] == "training" and (s["step"] or 0) >= 1 for s in states):
                    rank_pids = [s["pid"] for s in states]
            except (FileNotFoundError, ValueError):
                pass
            time.sleep(0.2)
        os.kill(rank_pids[1], signal.SIGSTOP)
        result = stop(tmp_path, output, "--grace", "5")
    finally:
        for pid in rank_pids:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
    assert result.returncode == 1, result.stderr
    assert "stopped\n" not in result.stderr
    assert f"SIGKILL to ranks {rank_pids[0]} {rank_pids[1]}" in result.stderr, result.stderr
    hung = read_status(log_dir, 1)
    assert hung["status"] == "failed" and hung["error"]["type"] == "RankDied", hung   # by the supervisor or stop.sh
    assert "rank 1: failed" in result.stderr
    assert not any(alive(pid) for pid in rank_pids)
    assert not lock_holders(output / ".train.lock"), "nothing of the run is left"
