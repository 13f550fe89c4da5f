"""Real 2-rank CPU runs with a NaN loss injected on one rank: the step is skipped on both and counted; a run of
them stops the training with the message."""

from __future__ import annotations


import pytest
from safetensors.torch import load_file

from diffsynth_mbc.data.demo import prepare
from e2e_helpers import REPO, read_history, read_status
from forked_ranks import run_training

pytestmark = pytest.mark.slow


def run_demo(tmp_path, inject: str, *flags):
    root = tmp_path / "demo"
    prepare(root, num_videos=3, num_images=2)
    flags = ["--config", str(REPO / "configs" / "train_demo.yaml"),
                                 "--dataset_base_path", str(root / "catalog"),
                                 "--dataset_metadata_path", str(root / "metadata" / "metadata.csv"),
                                 "--output_path", str(root / "lora"), "--log_dir", str(root / "logs"),
                                 "--gradient_accumulation_steps", "1", "--num_epochs", "1",
                                 # 5 steps per rank: the plan these checks are written for
                                 "--dataset_repeat", "2", "--image_batch_size", "1", *flags]
    result = run_training(tmp_path, flags, timeout=300, OMP_NUM_THREADS=1, MBC_FAULT_NONFINITE_LOSS=inject)
    return root, result


def test_a_nan_loss_on_one_rank_is_skipped_on_both_and_counted(tmp_path):
    root, result = run_demo(tmp_path, "1:2,3")   # rank 1's loss is NaN at steps 2 and 3 of 5
    assert result.returncode == 0, result.stderr[-3000:]
    for rank in (0, 1):
        state = read_status(root / "logs", rank)
        assert state["status"] == "finished" and state["step"] == 5
        assert state["nonfinite_steps"] == 2 and state["nonfinite_in_a_row"] == 0
        records = {r["step"]: r for r in read_history(root / "logs", rank)}
        assert [s for s, r in records.items() if r.get("nonfinite")] == [2, 3]
    lora = load_file(root / "lora" / "lora.safetensors")
    assert lora and all(bool(t.isfinite().all()) for t in lora.values())   # nothing NaN reached the weights


def test_a_run_of_non_finite_steps_fails_with_the_step_the_precision_and_the_remedy(tmp_path):
    root, result = run_demo(tmp_path, "0:2,3,4", "--max_nonfinite_steps", "3")
    assert result.returncode != 0
    for rank in (0, 1):
        state = read_status(root / "logs", rank)
        assert state["status"] == "failed" and state["error"]["type"] == "NonFiniteError"
        message = state["error"]["message"]
        assert message.startswith("steps 2-4: 3 optimizer steps in a row had a non-finite")
        assert "under fp32" in message and "--resume latest" in message
    assert "failed: steps 2-4: 3 optimizer steps in a row" in result.stderr
    assert not (root / "lora" / "lora.safetensors").exists()
