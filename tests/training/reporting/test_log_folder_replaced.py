"""The log folder deleted and recreated mid-run (real files, a real flock): the rank notices, its history goes
on in the new folder with every line so far, the run's lock is held there again, and it says so."""

import fcntl
import io
import json
import shutil
import subprocess
import time

import pytest

from diffsynth_mbc import run_files
from diffsynth_mbc.training.reporting.status_writer import RankStatusWriter


class FakeClock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


def steps_in(log_dir):
    return [json.loads(line)["step"] for line in run_files.history_path(log_dir, 0).read_text().splitlines()]


def exclusively_lockable(path) -> bool:
    """What a second launcher asks (flock -n on a file description of its own)."""
    with open(path, "a") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        fcntl.flock(handle, fcntl.LOCK_UN)
        return True


@pytest.fixture
def launcher_lock(tmp_path):
    """The log folder's lock as the launcher holds it: an exclusive flock, by another process (the ranks of a
    launch do not inherit its descriptor)."""
    log_dir = tmp_path / "logs"
    log_dir.mkdir()
    holder = subprocess.Popen(["flock", "-n", str(log_dir / ".train.lock"), "sleep", "120"])
    try:
        deadline = time.monotonic() + 30
        while exclusively_lockable(log_dir / ".train.lock"):
            assert holder.poll() is None and time.monotonic() < deadline, "flock never took the lock"
            time.sleep(0.05)
        yield log_dir
    finally:
        holder.kill()
        holder.wait()


def test_a_deleted_and_recreated_log_folder_gets_the_history_and_the_lock_again(launcher_lock):
    log_dir, clock, report = launcher_lock, FakeClock(), io.StringIO()
    writer = RankStatusWriter(log_dir, "run", 0, 0, 1, min_interval_s=5, monotonic=clock, wall_clock=clock,
                              stream=report)
    writer.set_status("training", phase="training epoch 1/1")
    for step in (1, 2, 3):
        writer.append_history({"step": step})
    shutil.rmtree(log_dir)                  # rm -rf of the log folder while the run goes on
    writer.append_history({"step": 4})
    clock.now += 6
    writer.update(step=4)                   # the next status write
    writer.append_history({"step": 5})
    assert steps_in(log_dir) == [1, 2, 3, 4, 5]
    assert json.loads(run_files.status_path(log_dir, 0).read_text())["step"] == 4
    assert not exclusively_lockable(log_dir / ".train.lock")   # a second launch is refused again
    assert "was deleted or replaced during the run" in report.getvalue()
    assert ".train.lock is held again" in report.getvalue()
    writer.close()


def test_a_folder_recreated_by_someone_else_is_noticed_at_the_next_status_write(launcher_lock):
    log_dir, clock, report = launcher_lock, FakeClock(), io.StringIO()
    writer = RankStatusWriter(log_dir, "run", 0, 0, 1, min_interval_s=5, monotonic=clock, wall_clock=clock,
                              stream=report)
    writer.set_status("training", phase="training epoch 1/1")
    writer.append_history({"step": 1})
    shutil.rmtree(log_dir)
    log_dir.mkdir()                          # rm -rf logs && mkdir logs
    clock.now += 6
    writer.update(step=1)
    assert steps_in(log_dir) == [1]          # the history is there at once, not only at the next step
    assert not exclusively_lockable(log_dir / ".train.lock")
    writer.append_history({"step": 2})
    writer.close()
    assert steps_in(log_dir) == [1, 2]
    assert report.getvalue().count("was deleted or replaced during the run") == 1


def test_a_deleted_history_file_is_started_again_with_what_it_held(tmp_path):
    report = io.StringIO()
    writer = RankStatusWriter(tmp_path, "run", 0, 0, 1, stream=report)
    writer.append_history({"step": 1})
    run_files.history_path(tmp_path, 0).unlink()
    writer.append_history({"step": 2})
    writer.close()
    assert steps_in(tmp_path) == [1, 2]
    assert "history" in report.getvalue() and "was deleted during the run" in report.getvalue()
