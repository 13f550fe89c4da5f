"""A log folder that fills up and is freed again, on a real 64 KiB tmpfs (no patched functions): the history
keeps one whole record per line, the last status is written, and the launcher's dead-rank marking ends cleanly."""

import errno
import io
import json
import os
import socket
import subprocess
import sys

import pytest

from diffsynth_mbc import run_files
from diffsynth_mbc.training.reporting.status_writer import RankStatusWriter
from e2e_helpers import REPO


class FakeClock:
    """Only the clock is simulated (to pass the write back-off at once); the disk is real."""

    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


@pytest.fixture
def tiny_disk(tmp_path):
    folder = tmp_path / "tiny"
    folder.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(folder)],
                             capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a 64 KiB tmpfs here to fill a disk for real: {mounted.stderr.strip()}")
    try:
        yield folder
    finally:
        subprocess.run(["umount", str(folder)], check=True)


def fill(folder):
    """Write a filler file until the file system is full; returns its path."""
    filler = folder / "filler"
    with open(filler, "wb", buffering=0) as handle:
        for size in (4096, 512, 1):
            try:
                while True:
                    handle.write(b"x" * size)
            except OSError as exc:
                assert exc.errno == errno.ENOSPC
    return filler


def record(step):
    return {"step": step, "epoch": 0, "loss": 2.3182713901 + step / 1000, "lr": 1e-4, "step_time_s": 0.52,
            "time": 1700000000.0 + step}


def test_a_history_cut_by_a_full_disk_has_one_whole_record_per_line_once_freed(tiny_disk):
    clock, report = FakeClock(), io.StringIO()
    log_dir = tiny_disk / "logs"
    writer = RankStatusWriter(log_dir, "run", 0, 0, 1, min_interval_s=0, monotonic=clock, wall_clock=clock,
                              stream=report)
    writer.set_status("training")
    for step in range(1, 6):
        writer.append_history(record(step))
    filler = fill(tiny_disk)
    for step in range(6, 60):   # the history's last page fills, a line is cut half-way, the rest wait
        clock.now += 0.5
        writer.append_history(record(step))
    assert writer.write_failures >= 1 and "cannot write rank 0's history file" in report.getvalue()
    filler.unlink()
    clock.now += 120                               # past the back-off
    writer.append_history(record(60))
    writer.close()
    lines = run_files.history_path(log_dir, 0).read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == list(range(1, 61))


def test_a_history_left_with_a_torn_last_line_is_cut_back_before_appending(tmp_path):
    """A process killed in the middle of a line (or a truncation refused) leaves a torn tail: a resumed writer
    continues on a fresh line, never on the torn one."""
    log_dir = tmp_path / "logs"
    log_dir.mkdir()
    history = run_files.history_path(log_dir, 0)
    history.write_text(json.dumps(record(1)) + "\n" + json.dumps(record(2))[:25])
    writer = RankStatusWriter(log_dir, "run", 0, 0, 1, continue_history=True)
    writer.append_history(record(2))
    writer.close()
    assert [json.loads(line)["step"] for line in history.read_text().splitlines()] == [1, 2]


def test_the_last_status_is_written_when_the_log_folder_is_full(tiny_disk):
    log_dir = tiny_disk / "logs"
    writer = RankStatusWriter(log_dir, "run", 0, 0, 1, min_interval_s=0, stream=io.StringIO())
    writer.set_status("training", phase="training epoch 1/1", step=24)
    fill(tiny_disk)
    writer.set_status("finished", phase="finished", step=25)
    writer.close()
    state = json.loads(run_files.status_path(log_dir, 0).read_text())
    assert (state["status"], state["step"]) == ("finished", 25)


def test_dead_ranks_are_marked_on_a_full_log_folder_without_a_traceback(tiny_disk):
    log_dir = tiny_disk / "logs"
    log_dir.mkdir()
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    state = {field: None for field in run_files.STATUS_FIELDS}
    state.update(schema_version=1, run_id="run", rank=1, world_size=2, hostname=socket.gethostname(), pid=gone.pid,
                 status="training", phase="training epoch 1/1", step=24, updated_at=1700000000.0)
    path = run_files.status_path(log_dir, 1)
    path.write_text(json.dumps(state, indent=2) + "\n")
    fill(tiny_disk)
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    marking = subprocess.run([sys.executable, "-m", "diffsynth_mbc.stop", str(log_dir), "--mark-dead-ranks", "1"],
                             capture_output=True, text=True, env=env, timeout=60)
    assert marking.returncode == 0 and "Traceback" not in marking.stderr, marking.stderr
    marked = json.loads(path.read_text())
    assert marked["status"] == "failed" and marked["error"]["type"] == "RankDied"
