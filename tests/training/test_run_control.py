"""stop.sh signals only the run's own processes: never through a lock that is not a regular file, never a
process that merely holds the lock file open. Real processes and signals, no training."""

from __future__ import annotations

import subprocess
import time

import pytest

from diffsynth_mbc.training.run_control import lock_holders
from e2e_helpers import REPO, isolated_env

STOP = str(REPO / "launchers" / "stop.sh")


def stop(work, folder, *args):
    return subprocess.run(["bash", STOP, str(folder), "--grace", "2", *args], cwd=work, env=isolated_env(work),
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
