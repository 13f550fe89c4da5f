"""`launchers/train_test.sh --demo --cached`: the latent cache is built on 2 CPU ranks, then the DiT alone trains from it."""

import json
import subprocess

import pytest

from e2e_helpers import REPO, isolated_env, read_history, read_status

pytestmark = pytest.mark.slow


def test_cached_launch_encodes_once_then_trains_the_dit_only(tmp_path):
    env = isolated_env(tmp_path, OMP_NUM_THREADS=1)
    # Training flags go through the launcher: a timestep scheme inside a boundary (index 200: level 952.4 of 1000).
    result = subprocess.run(["bash", str(REPO / "launchers" / "train_test.sh"), "--demo", "--cached",
                             "--timestep_sampling", "shift", "--timestep_shift", "3", "--min_timestep_boundary", "0.2"],
                            cwd=tmp_path, env=env, capture_output=True, text=True, timeout=400)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-4000:]
    cache = tmp_path / "runs" / "demo" / "latent_cache"
    summary = json.loads((cache / "summary.json").read_text())
    assert summary["written"] + summary["skipped"] == 11 and summary["failed"] == 0
    assert "--cache runs/demo/latent_cache" in output
    log_dir = tmp_path / "runs" / "demo" / "training_logs"
    for rank in (0, 1):
        state = read_status(log_dir, rank)
        assert state["status"] == "finished" and state["step"] == state["total_steps"] == 12
        assert [line["step"] for line in read_history(log_dir, rank)] == list(range(1, 13))
        timesteps = [t for line in read_history(log_dir, rank) for t in line["timesteps"]]
        assert len(timesteps) >= 12 and all(0 <= t <= 952.39 for t in timesteps), timesteps
    assert (tmp_path / "runs" / "demo" / "lora" / "lora.safetensors").stat().st_size > 0


def test_a_cache_folder_given_with_cached_reaches_the_training_once(tmp_path):
    """`--cached --cache DIR` builds the cache in DIR; the printed command used to carry `--cache DIR` twice."""
    env = isolated_env(tmp_path, OMP_NUM_THREADS=1)
    result = subprocess.run(["bash", str(REPO / "launchers" / "train_test.sh"), "--demo", "--cached", "--skip_doctor",
                             "--cache", "runs/my_cache", "--num_epochs", "1"], cwd=tmp_path,
                            env=env, capture_output=True, text=True, timeout=400)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-4000:]
    run_line, = [line for line in output.splitlines() if line.startswith("run run-")]
    assert run_line.count("--cache") == 1 and "--cache runs/my_cache " in run_line, run_line
    assert json.loads((tmp_path / "runs" / "my_cache" / "summary.json").read_text())["failed"] == 0
    assert not (tmp_path / "runs" / "demo" / "latent_cache").exists()
