"""stop.sh signals only the run's own processes: never through a lock that is not a regular file, never a
process that merely holds the lock file open; a hung rank is told from the ones waiting for it, and stop.sh kills
it; overlapping stop requests lose nothing. Real processes and signals (detached demo runs for the last two)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from diffsynth_mbc.lifecycle.processes import alive
from diffsynth_mbc.lifecycle.stop_command import lock_holders
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


STALL_AFTER_S = 20.0   # well above a heartbeat starved for seconds on a loaded 2-core machine
POLL_S = 0.2           # how often the monitor is asked: each answer reads both ranks' files


def wait_while_ranks_live(condition, rank_pids, timeout_s, what, seen=lambda: ""):
    """``condition()``'s first true value, asked every ``POLL_S`` while every rank process exists."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = condition()
        if value:
            return value
        assert all(alive(pid) for pid in rank_pids), f"a rank ended before {what}"
        assert time.monotonic() < deadline, f"timed out waiting for {what}; last seen: {seen()}"
        time.sleep(POLL_S)


@pytest.mark.slow
def test_a_hung_rank_is_told_from_the_waiting_one_and_stop_sh_kills_it_marks_it_failed_and_says_so(tmp_path):
    """A detached demo (the launcher, accelerate launch, torchrun's agent and sessions: a stopped rank as users
    will meet it) whose rank 1 is stopped with SIGSTOP: only it goes stale and is called stalled, while rank 0,
    blocked in a collective, keeps its file fresh and says what it waits for; SIGCONT lets the run go on. Stopped
    again, stop.sh's grace runs out: the ranks are killed, their status files say failed (not `training` forever),
    and stop.sh exits 1 naming what it killed."""
    from diffsynth_mbc.monitor.state import MonitorState

    launched = subprocess.run(["bash", str(REPO / "launchers" / "train_test.sh"), "--demo", "--detach",
                               "--num_epochs", "5000", "--status_interval_s", "1"], cwd=tmp_path,
                              env=isolated_env(tmp_path, OMP_NUM_THREADS=1), capture_output=True, text=True,
                              timeout=120)
    assert launched.returncode == 0, launched.stderr
    log_dir, output = tmp_path / "runs/demo/training_logs", tmp_path / "runs/demo/lora"
    states = wait_for_steps(log_dir, 3)
    rank_pids = [s["pid"] for s in states]          # the ranks' pids, from their own status files
    try:
        os.kill(rank_pids[1], signal.SIGSTOP)
        monitor = MonitorState(log_dir, stall_after=STALL_AFTER_S, backfill=False)
        wait_while_ranks_live(lambda: monitor.refresh()["stalled_ranks"], rank_pids, 180,
                              "the monitor to see a stalled rank")
        last = {}

        def rank_1_alone_stalled_while_rank_0_waits():
            snap = last["snap"] = monitor.refresh()
            waiting = {r["rank"]: r["waiting_text"] for r in snap["ranks"]}
            return snap if snap["stalled_ranks"] == [1] and (waiting.get(0) or "").startswith("waiting for") else None

        # On a loaded machine one snapshot may catch rank 0 between two heartbeats; a healthy run shows this state
        # within a few of them, a run whose waiting rank wrote nothing never does.
        snap = wait_while_ranks_live(
            rank_1_alone_stalled_while_rank_0_waits, rank_pids, 120, "rank 1 alone stalled, rank 0 waiting",
            seen=lambda: (last["snap"]["stalled_ranks"], [(r["rank"], r.get("phase"), r.get("age_s"),
                          r["waiting_text"], r.get("step")) for r in last["snap"]["ranks"]]))
        ranks = {r["rank"]: r for r in snap["ranks"]}
        assert snap["status"] == "stalled" and snap["stalled_ranks"] == [1], (snap["notes"], {
            r: (v.get("phase"), v.get("age_s"), v.get("waiting_text"), v.get("step")) for r, v in ranks.items()})
        assert not ranks[0]["stalled"] and ranks[0]["age_s"] < STALL_AFTER_S
        assert ranks[0]["waiting_text"].startswith("waiting for ranks "), ranks[0]
        assert ranks[1]["waiting_text"] is None
        assert any(note.startswith("rank 1 silent (stalled) while rank 0 is waiting for") for note in snap["notes"])

        os.kill(rank_pids[1], signal.SIGCONT)
        wait_while_ranks_live(lambda: (lambda s: s["status"] == "training" and not s["stalled_ranks"]
                                       and all(r["waiting_text"] is None for r in s["ranks"]))(monitor.refresh()),
                              rank_pids, 180, "the run to go on after SIGCONT")

        os.kill(rank_pids[1], signal.SIGSTOP)
        result = stop(tmp_path, output, "--grace", "5")
    finally:
        for pid in rank_pids:
            if alive(pid):
                os.kill(pid, signal.SIGCONT)
                os.kill(pid, signal.SIGKILL)
    assert result.returncode == 1, result.stderr
    assert "stopped\n" not in result.stderr
    assert f"SIGKILL to ranks {rank_pids[0]} {rank_pids[1]}" in result.stderr, result.stderr
    hung = read_status(log_dir, 1)
    assert hung["status"] == "failed" and hung["error"]["type"] == "RankDied", hung   # by the supervisor or stop.sh
    assert "rank 1: failed" in result.stderr
    assert not any(alive(pid) for pid in rank_pids)
    assert not lock_holders(output / ".train.lock"), "nothing of the run is left"


@pytest.mark.slow
def test_one_run_per_folder_whatever_starts_it_and_stop_requests_that_overlap_lose_nothing(tmp_path):
    """A detached demo run, then what a user did to it:
    - stop.sh on a copy of the run's folder: the copied record names the live supervisor, but no process holds
      the copy's lock: "no training is running" (exit 3), the run goes on (it was stopped before);
    - a training started without the launcher on the same folders, with --start_over: refused (75) before it
      touches anything (it moved the run's checkpoints aside before);
    - two stop.sh at once: each rank gets SIGTERM twice, which is one request: both report the stop, the ranks
      finish the step and write the checkpoint (the second SIGTERM used to mean "exit now": the steps since
      the last checkpoint were lost while both said "stopped"); nothing of the run is left holding its lock;
    - stop.sh once more: "no training is running" (exit 3)."""
    env = isolated_env(tmp_path, OMP_NUM_THREADS=1)
    launched = subprocess.run(["bash", str(REPO / "launchers" / "train_test.sh"), "--demo", "--detach",
                               "--num_epochs", "5000", "--checkpoint_steps", "1000"], cwd=tmp_path, env=env,
                              capture_output=True, text=True, timeout=120)
    assert launched.returncode == 0, launched.stderr
    log_dir, output = tmp_path / "runs/demo/training_logs", tmp_path / "runs/demo/lora"
    states = wait_for_steps(log_dir, 2)
    run_id, pids = states[0]["run_id"], [s["pid"] for s in states]
    try:
        copy = tmp_path / "copy"
        subprocess.run(["cp", "-a", str(output), str(copy)], check=True)
        result = stop(tmp_path, copy)
        assert result.returncode == 3 and "no training is running" in result.stderr, result.stderr
        assert all(alive(pid) for pid in pids)

        checkpoints_before = sorted(p.name for p in (output / "checkpoints").iterdir())
        second = subprocess.run([sys.executable, "-m", "diffsynth_mbc.train", "--config",
                                 str(REPO / "configs" / "train_demo.yaml"), "--output_path", "runs/demo/lora",
                                 "--log_dir", "runs/demo/training_logs", "--start_over", "true"],
                                cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
        assert second.returncode == 75, second.stderr[-2000:]
        assert f"a training is already running on {output.resolve()}: run {run_id}" in second.stderr
        assert sorted(p.name for p in (output / "checkpoints").iterdir()) == checkpoints_before
        assert all(read_status(log_dir, rank)["run_id"] == run_id for rank in (0, 1))

        step_before = max(s["step"] for s in wait_for_steps(log_dir, 3))
        stops = [subprocess.Popen(["bash", STOP, str(output), "--grace", "120"], cwd=tmp_path, env=env,
                                  stderr=subprocess.PIPE, text=True) for _ in range(2)]
        results = [(process.wait(timeout=180), process.stderr.read()) for process in stops]
    finally:
        for pid in pids:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
    for code, said in results:
        assert code == 0, said
    final = [read_status(log_dir, rank) for rank in (0, 1)]
    assert [s["status"] for s in final] == ["stopped", "stopped"], final
    step = final[0]["step"]
    assert step >= step_before and final[0]["last_checkpoint"].endswith(f"checkpoints/step-{step:08d}")
    assert (output / "checkpoints" / f"step-{step:08d}" / "checkpoint.json").is_file()
    assert any(f"stopped at step {step}/" in said for _, said in results), results
    assert not lock_holders(output / ".train.lock"), "no process of the run is left"
    again = stop(tmp_path, output)
    assert again.returncode == 3 and "no training is running" in again.stderr, again.stderr


def wait_for_steps(log_dir, step: int, timeout_s: float = 180) -> list[dict]:
    deadline = time.monotonic() + timeout_s
    while True:
        assert time.monotonic() < deadline, f"the ranks never reached step {step}"
        try:
            states = [read_status(log_dir, rank) for rank in (0, 1)]
            if all(s["status"] == "training" and (s["step"] or 0) >= step for s in states):
                return states
        except (FileNotFoundError, ValueError):
            pass
        time.sleep(0.2)
