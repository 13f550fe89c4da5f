"""The frame options through the launcher on 2 CPU ranks (DDP, gloo): a random window per epoch, resampled."""

import subprocess

import pytest

from e2e_helpers import REPO, isolated_env, read_history, read_status

pytestmark = pytest.mark.slow


def test_random_window_at_a_source_fps_trains_two_epochs_on_two_ranks(tmp_path):
    env = isolated_env(tmp_path, OMP_NUM_THREADS=1)
    result = subprocess.run(["bash", str(REPO / "launchers" / "train_test.sh"), "--demo", "--skip_doctor",
                             "--frame_sampling", "random_window", "--source_fps", "6", "--short_clips", "loop",
                             "--num_frames", "5", "--num_epochs", "2", "--dataset_repeat", "1"],
                            cwd=tmp_path, env=env, capture_output=True, text=True, timeout=400)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-4000:]
    log, = (tmp_path / "runs" / "demo" / "lora").glob("train-*.log")   # the launcher's command is in the run's log
    run_line, = [line for line in log.read_text().splitlines() if line.startswith("run run-")]
    assert "--frame_sampling random_window --source_fps 6 --short_clips loop" in run_line, run_line
    log_dir = tmp_path / "runs" / "demo" / "training_logs"
    for rank in (0, 1):
        state = read_status(log_dir, rank)
        assert state["status"] == "finished" and state["step"] == state["total_steps"] > 0
        assert state.get("skipped_samples", 0) == 0
        assert [line["step"] for line in read_history(log_dir, rank)] == list(range(1, state["total_steps"] + 1))
    assert (tmp_path / "runs" / "demo" / "lora" / "lora.safetensors").stat().st_size > 0
