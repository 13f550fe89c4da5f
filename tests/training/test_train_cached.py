"""`launchers/train_test.sh --demo --cached`: the latent cache is built on 2 CPU ranks, then the DiT alone trains from it."""

import json
import subprocess

import pytest

from e2e_helpers import REPO, isolated_env, read_history, read_status

pytestmark = pytest.mark.slow


def test_cached_launch_encodes_once_then_trains_the_dit_only(tmp_path):
    """With a trigger word and caption dropout, which the cache command gets from the launcher too."""
    env = isolated_env(tmp_path, OMP_NUM_THREADS=1)
    result = subprocess.run(["bash", str(REPO / "launchers" / "train_test.sh"), "--demo", "--cached",
                             "--caption_prefix", "mbcstyle", "--caption_dropout", "0.5"], cwd=tmp_path,
                            env=env, capture_output=True, text=True, timeout=400)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-4000:]
    cache = tmp_path / "runs" / "demo" / "latent_cache"
    summary = json.loads((cache / "summary.json").read_text())
    assert summary["written"] + summary["skipped"] == 11 and summary["failed"] == 0
    assert "--cache runs/demo/latent_cache" in output
    index = json.loads((cache / "cache.json").read_text())
    assert index["settings"]["caption_prefix"] == "mbcstyle" and index["empty_prompt"]["text_tokens"] >= 1
    assert all(row["prompt"].startswith("mbcstyle ") for row in index["rows"])
    log_dir = tmp_path / "runs" / "demo" / "training_logs"
    for rank in (0, 1):
        state = read_status(log_dir, rank)
        assert state["status"] == "finished" and state["step"] == state["total_steps"] == 12
        assert [line["step"] for line in read_history(log_dir, rank)] == list(range(1, 13))
        assert 0 < state["captions_dropped"] < state["samples_seen"]   # some samples, not all, lost the caption
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
