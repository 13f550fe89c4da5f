"""A run's processes through the real launcher (2 CPU ranks, gloo): the ranks hold the run's lock themselves,
stop cleanly when their launcher dies, and Ctrl-C or a failure ends with the run's own last word."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time

import pytest

from diffsynth_mbc.lifecycle.processes import alive, children, is_accelerate
from diffsynth_mbc.lifecycle.stop_command import lock_holders
from diffsynth_mbc.training.checkpoints.folder import complete_checkpoints
from e2e_helpers import REPO, isolated_env, read_status

pytestmark = pytest.mark.slow
LAUNCHER = str(REPO / "launchers" / "train_test.sh")


def start_launcher(work, *args, launcher=LAUNCHER):
    """The demo launcher in a process group of its own (as a shell starts a job), its output in a file."""
    out = open(work / "launcher-output.txt", "w")
    process = subprocess.Popen(["bash", launcher, "--demo", *args], cwd=work, env=isolated_env(work, OMP_NUM_THREADS=1),
                               stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    out.close()
    return process


def launcher_output(work) -> str:
    return (work / "launcher-output.txt").read_text()


def wait_until(condition, timeout, what, work=None):
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}" + (
            f": {launcher_output(work)[-3000:]}" if work else "")
        time.sleep(0.2)


def ranks_training(log_dir, min_step=1):
    def check():
        try:
            return all(read_status(log_dir, r)["status"] == "training" and (read_status(log_dir, r)["step"] or 0)
                       >= min_step for r in (0, 1))
        except (FileNotFoundError, json.JSONDecodeError):
            return False
    return check


def stop_tree(pid):
    """Cleanup after a failed assertion: the launcher's group, and the ranks (sessions of their own)."""
    for child in children(pid):
        stop_tree(child)
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def test_ranks_hold_the_lock_and_stop_cleanly_when_their_launcher_is_killed(tmp_path):
    launcher = start_launcher(tmp_path, "--num_epochs", "5000")
    log_dir, output = tmp_path / "runs/demo/training_logs", tmp_path / "runs/demo/lora"
    rank_pids = []
    try:
        wait_until(ranks_training(log_dir), 180, "both ranks training", tmp_path)
        rank_pids = [read_status(log_dir, rank)["pid"] for rank in (0, 1)]
        for folder in (output, log_dir, output / "checkpoints"):   # every folder's lock, held by the ranks too
            assert set(rank_pids) <= set(lock_holders(folder / ".train.lock")), folder
        accelerate = [pid for pid in children(launcher.pid) if is_accelerate(pid)]
        assert len(accelerate) == 1
        os.kill(launcher.pid, signal.SIGKILL)
        os.kill(accelerate[0], signal.SIGKILL)
        launcher.wait(timeout=30)
        # Orphaned, the ranks notice, finish their step, checkpoint and exit.
        wait_until(lambda: not any(alive(pid) for pid in rank_pids), 120, "the ranks to stop", tmp_path)
    finally:
        for pid in [launcher.pid] + rank_pids:
            if alive(pid):
                stop_tree(pid)
    states = [read_status(log_dir, rank) for rank in (0, 1)]
    assert all(state["status"] == "stopped" for state in states), states
    reasons = [state["phase"] for state in states]   # a rank may stop on the other's request, at the same step
    assert any(f"its launcher (pid {launcher.pid}) ended" in reason for reason in reasons), reasons
    assert all("launcher" in reason or "made on another rank" in reason for reason in reasons), reasons
    stopped_at = states[0]["step"]
    assert states[1]["step"] == stopped_at
    assert complete_checkpoints(output / "checkpoints")[-1][0] == stopped_at, "the stop saved a checkpoint"
    assert not lock_holders(output / ".train.lock"), "nothing of the run is left holding its lock"
    log, = output.glob("train-*.log")   # the ranks' last words went to the log once the launcher was gone
    assert f"stopped: {stopped_at}/" in log.read_text()


def test_ctrl_c_exits_0_with_the_summary_last_naming_the_checkpoint_and_the_resume_command(tmp_path):
    typed = os.path.relpath(LAUNCHER, tmp_path)   # launched from another folder than the project's
    launcher = start_launcher(tmp_path, "--num_epochs", "5000", launcher=typed)
    log_dir = tmp_path / "runs/demo/training_logs"
    try:
        wait_until(ranks_training(log_dir, min_step=2), 180, "both ranks training", tmp_path)
        os.killpg(launcher.pid, signal.SIGINT)   # what Ctrl-C in the launcher's terminal sends
        code = launcher.wait(timeout=180)
    finally:
        if launcher.poll() is None:
            stop_tree(launcher.pid)
    text = launcher_output(tmp_path)
    assert code == 0, text[-3000:]
    assert "Traceback" not in text and "SignalException" not in text, text[-3000:]
    summary = text[text.rindex("\nstopped: "):]
    assert "lora.safetensors" not in summary, summary      # a stopped run has not written it
    checkpoint = read_status(log_dir, 0)["last_checkpoint"]
    assert checkpoint and (tmp_path / checkpoint).is_dir()
    last = text.strip().splitlines()[-2:]
    assert last[0].startswith("stopped at step") and f"resume from {checkpoint}" in last[0], last
    # the launcher as typed: `bash launchers/train_test.sh` failed in the folder the run was started from
    assert last[1] == f"  resume: bash {typed} --demo --num_epochs 5000 --resume latest", last


def test_the_schedulers_warning_to_the_launcher_alone_ends_every_rank_preempted_after_a_checkpoint(tmp_path):
    """SIGUSR1 (train.sbatch's warning before the time limit) reaching only the launcher, as a scheduler that signals
    one process does: passed on to the ranks, never killing accelerate, which ignores it; exit 0, `preempted`."""
    launcher = start_launcher(tmp_path, "--num_epochs", "5000")
    log_dir = tmp_path / "runs/demo/training_logs"
    try:
        wait_until(ranks_training(log_dir, min_step=2), 180, "both ranks training", tmp_path)
        accelerate = [pid for pid in children(launcher.pid) if is_accelerate(pid)]
        os.kill(launcher.pid, signal.SIGUSR1)
        code = launcher.wait(timeout=180)
    finally:
        if launcher.poll() is None:
            stop_tree(launcher.pid)
    text = launcher_output(tmp_path)
    assert code == 0 and len(accelerate) == 1, text[-3000:]
    states = [read_status(log_dir, rank) for rank in (0, 1)]
    assert [state["status"] for state in states] == ["preempted", "preempted"], [s["phase"] for s in states]
    assert all("the scheduler's warning" in state["phase"] or "made on another rank" in state["phase"]
               for state in states), [state["phase"] for state in states]
    stopped_at = states[0]["step"]
    assert states[1]["step"] == stopped_at
    assert complete_checkpoints(tmp_path / "runs/demo/lora/checkpoints")[-1][0] == stopped_at
    last = text.strip().splitlines()[-2:]
    assert last[0].startswith(f"preempted at step {stopped_at}/") and "resume from" in last[0], last


def test_a_failed_run_ends_with_its_cause(tmp_path):
    from diffsynth_mbc.data.demo import prepare

    prepare(tmp_path / "broken", num_videos=6, num_images=5)
    media = tmp_path / "broken" / "catalog" / "media"
    for index in range(6):
        (media / f"video_{index:03d}.mp4").write_bytes(b"garbage" * 50)
    for image in media.glob("image_00[0-2].*"):
        image.write_bytes(b"not an image")
    launcher = start_launcher(tmp_path, "--skip_doctor", "--dataset_repeat", "3",
                              "--dataset_base_path", str(tmp_path / "broken" / "catalog"),
                              "--dataset_metadata_path", str(tmp_path / "broken" / "metadata" / "metadata.csv"))
    try:
        code = launcher.wait(timeout=240)
    finally:
        if launcher.poll() is None:
            stop_tree(launcher.pid)
    text = launcher_output(tmp_path)
    assert code != 0
    last = text.strip().splitlines()[-3:]   # the cause on the last screen, after torch's ChildFailedError
    assert any(line.startswith("failed: rank") and "TooMuchBadMedia" in line and "could not be decoded" in line
               for line in last), text[-3000:]
    assert last[-1].startswith("  log: ") and last[-1].endswith(".log")


def test_a_refusal_before_any_status_is_said_again_after_torchs_traceback(tmp_path):
    """A rank that refuses before writing a status file (a lock taken, files of another run) printed one error line,
    which torch's ChildFailedError then buried; the supervisor says it again, last."""
    import io
    import sys

    from diffsynth_mbc.lifecycle.supervisor import Supervisor

    script = ("import sys; print('[rank 0] error: the folder is held by run-old; give --output_path', file=sys.stderr);"
              "print('[rank 1] error: the folder is held by run-old; give --output_path', file=sys.stderr);"
              "[print(f'  File torch/distributed/run.py, line {n}') for n in range(45)]; sys.exit(1)")
    out = io.BytesIO()
    code = Supervisor([sys.executable, "-c", script], [], str(tmp_path), log_file=str(tmp_path / "run.log"),
                      out=out).run()
    lines = out.getvalue().decode().strip().splitlines()
    assert code == 1
    assert lines[-2:] == ["the run did not start: the folder is held by run-old; give --output_path",
                          f"  log: {tmp_path / 'run.log'}"]
