"""A training started without the launcher takes the run's lock itself: refused on a folder another run holds, the
ranks of one start share it. Real processes and flock, no training."""

from __future__ import annotations

import subprocess
import sys

import pytest

from diffsynth_mbc.lifecycle.run_lock import RunLockError, lock_without_launcher, read_record, release, write_record
from diffsynth_mbc.lifecycle.stop_command import lock_holders

RANK = """
import sys, time
from diffsynth_mbc.lifecycle.run_lock import lock_without_launcher
held = lock_without_launcher([sys.argv[1]], "run-new", int(sys.argv[2]), wait_s=30)
print("locked", flush=True)
time.sleep(float(sys.argv[3]))
"""


@pytest.fixture
def live_run(tmp_path):
    """A launched run's process holding the folder's lock shared, as launcher and ranks hold it."""
    folder = tmp_path / "lora"
    folder.mkdir()
    lock = folder / ".train.lock"
    lock.touch()
    write_record(lock, 1, "run-live")
    # "locked" once flock has the lock: having the file open (what lock_holders sees) comes a moment earlier
    holder = subprocess.Popen(["bash", "-c", 'exec 3>>"$1"; flock -s 3; echo locked; exec sleep 120', "_", str(lock)],
                              stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline() == "locked\n"
    assert holder.pid in lock_holders(lock)
    yield folder
    holder.kill()
    holder.wait()


def test_a_folder_another_run_holds_is_refused_naming_it_and_its_record_is_left_alone(live_run):
    before = (live_run / ".train.pid").read_bytes()
    with pytest.raises(RunLockError, match="a training is already running on .*: run run-live"):
        lock_without_launcher([live_run], "run-new", local_rank=0)
    assert (live_run / ".train.pid").read_bytes() == before


@pytest.mark.slow
def test_the_ranks_of_one_start_share_the_lock_and_release_it_when_they_end(tmp_path):
    folder = tmp_path / "lora"
    ranks = [subprocess.Popen([sys.executable, "-c", RANK, str(folder), str(rank), "1.5"], stdout=subprocess.PIPE,
                              text=True) for rank in (1, 0)]   # rank 1 first: it waits for rank 0's record
    outputs = [rank.communicate(timeout=60)[0] for rank in ranks]
    assert outputs == ["locked\n", "locked\n"] and [rank.returncode for rank in ranks] == [0, 0]
    record = read_record(folder / ".train.lock")
    assert record["run_id"] == "run-new" and record["started_without_launcher"] == "true"
    held = lock_without_launcher([folder], "run-later", local_rank=0)   # free again once they ended
    release(held)


@pytest.mark.slow
def test_a_second_start_while_the_first_runs_is_refused(tmp_path):
    folder = tmp_path / "lora"
    first = subprocess.Popen([sys.executable, "-c", RANK, str(folder), "0", "30"], stdout=subprocess.PIPE, text=True)
    try:
        assert first.stdout.readline() == "locked\n"
        with pytest.raises(RunLockError, match="run run-new"):
            lock_without_launcher([folder], "run-other", local_rank=0)
    finally:
        first.kill()
        first.wait()
