"""LoRA health on 2 real CPU ranks (DDP, gloo): records at step 0, every --health_steps and at the end, one finite
norm per DiT block, 0 at step 0 and growing after; a run at a learning rate of 1e-12 is flagged still."""

from __future__ import annotations

import math

import pytest

from diffsynth_mbc.data.demo import prepare
from diffsynth_mbc.models.pipeline import build_demo_pipeline
from e2e_helpers import demo_flags, read_health, read_status
from forked_ranks import run_training

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """{"trains": 2 epochs, records every 4 steps (6 steps); "still": 1 epoch at lr 1e-12, every step (3 steps)}:
    (log folder, the ranks' output)."""
    root = tmp_path_factory.mktemp("health")
    prepare(root / "demo", num_videos=3, num_images=2)
    out = {}
    for name, overrides in (("trains", {"health_steps": 4}),
                            ("still", {"health_steps": 1, "num_epochs": 1, "learning_rate": 1e-12}),
                            ("explodes", {"health_steps": 1, "num_epochs": 3, "learning_rate": 1e3, "warmup_steps": 0,
                                          "max_nonfinite_steps": 100})):
        flags = demo_flags(root / "demo", root / name, checkpoint_steps=100, **overrides)
        result = run_training(root / name, flags, timeout=540, OMP_NUM_THREADS=1)
        assert result.returncode == (1 if name == "explodes" else 0), result.stdout[-3000:] + result.stderr[-3000:]
        out[name] = (root / name / "logs", result.stdout + result.stderr)
    return out


def test_a_run_whose_last_record_flags_a_broken_lora_fails_and_publishes_no_lora(runs):
    """At a learning rate of 1e3 the loss goes non-finite: the run used to end "finished", exit 0, publishing a LoRA
    7e10 times the base weights. Every rank now fails at the end, naming the flag and what to do."""
    logs, output = runs["explodes"]
    last = read_health(logs, 0)[-1]
    assert "nonfinite" in [flag["flag"] for flag in last["flags"]], last
    for rank in (0, 1):
        state = read_status(logs, rank)
        assert state["status"] == "failed" and state["error"]["type"] == "UnhealthyRunError"
        assert f"LoRA health at step {last['step']}: nonfinite: " in state["error"]["message"]
        assert "lora.safetensors is not written" in state["error"]["message"]
        assert "--learning_rate" in state["error"]["message"]
        assert "What to do: " in state["error"]["message"]
    assert not (logs.parent / "lora" / "lora.safetensors").exists() and not list(logs.parent.rglob("lora.safetensors"))
    assert "the run ended with a broken LoRA" in output


def test_records_at_step_0_every_n_steps_and_the_end_one_finite_norm_per_block(runs):
    logs, _ = runs["trains"]
    blocks = len(build_demo_pipeline(load_encoders=False).dit.blocks)
    state = read_status(logs, 0)
    assert state["status"] == "finished" and state["step"] == state["total_steps"] == 6
    records = read_health(logs, 0)
    assert [record["step"] for record in records] == [0, 4, 6]
    for record in records:
        assert len(record["update_norm_by_block"]) == blocks
        assert all(isinstance(value, float) and math.isfinite(value) for value in record["update_norm_by_block"])
        assert record["flags"] == [] and record["seconds"] >= 0
    first, middle, last = (record["update_norm_by_block"] for record in records)
    assert first == [0.0] * blocks
    assert all(value > 0 for value in middle) and sum(last) > sum(middle)
    # the gradients of the step that recorded, per block, before clipping; none at step 0 (no step yet)
    assert records[0]["grad_norm_by_block"] is None
    for record in records[1:]:
        assert len(record["grad_norm_by_block"]) == blocks and all(value > 0 for value in record["grad_norm_by_block"])
    # DDP: every rank holds the same LoRA and the same averaged gradients, so the same record
    for mine, theirs in zip(records, read_health(logs, 1)):
        assert theirs["update_norm_by_block"] == pytest.approx(mine["update_norm_by_block"], rel=1e-4)
    assert state["health"]["step"] == 6 and state["health"]["flags"] == []
    assert state["health"]["max_update_norm"] == max(last)


def test_a_run_at_a_learning_rate_of_1e_12_is_flagged_still(runs):
    logs, output = runs["still"]
    records = read_health(logs, 0)
    assert [record["step"] for record in records] == [0, 1, 2, 3]
    # after the demo's 2 warm-up steps the LoRA has not moved
    assert [[flag["flag"] for flag in record["flags"]] for record in records] == [[], [], [], ["still"]]
    assert max(records[-1]["update_norm_by_block"]) < 1e-6
    state = read_status(logs, 0)
    assert [flag["flag"] for flag in state["health"]["flags"]] == ["still"]
    assert "--learning_rate" in state["health"]["flags"][0]["do"]
    assert output.count("LoRA health at step 3: still:") == 1   # rank 0 says it, once
