"""The LoRA health flags (training/evaluation/health_flags.py) on crafted histories: each flag raised and not."""

from __future__ import annotations

import math

import pytest

from diffsynth_mbc.training.evaluation import health_flags as hf
from diffsynth_mbc.training.evaluation.health_flags import health_flags, summary


def health(step, updates, grads=None):
    return {"kind": "lora_health", "step": step, "update_norm_by_block": list(updates),
            "grad_norm_by_block": None if grads is None else list(grads)}


def steps(losses, grad_norms=None, start=1, nonfinite=()):
    grad_norms = grad_norms or [1.0] * len(losses)
    return [{"step": start + i, "loss": loss, "grad_norm": norm, **({"nonfinite": True} if start + i in nonfinite
                                                                    else {})}
            for i, (loss, norm) in enumerate(zip(losses, grad_norms))]


def names(flags):
    return [item["flag"] for item in flags]


def healthy_records(until=30, every=10):
    """Updates that grow about linearly with the steps, from 0 at step 0."""
    return [health(step, [1e-3 * step, 2e-3 * step]) for step in range(0, until + 1, every)]


def test_a_healthy_run_has_no_flags():
    assert health_flags(healthy_records(), steps([1.0 - 0.01 * i for i in range(30)]), [], warmup_steps=5) == []


def test_every_flag_says_what_it_saw_and_what_to_do():
    flags = health_flags([health(0, [0, 0]), health(10, [1e-9, 1e-9])], steps([1.0] * 10), [], warmup_steps=0)
    assert names(flags) == ["still"]
    assert flags[0]["step"] == 10 and "1e-09" in flags[0]["what"] and "--learning_rate" in flags[0]["do"]
    assert set(hf.WHAT_TO_DO) == set(hf.FLAGS)


def test_still_after_the_warm_up_only():
    records = [health(0, [0, 0]), health(10, [1e-8, 3e-7])]
    assert names(health_flags(records, [], [], warmup_steps=0)) == ["still"]
    assert health_flags(records, [], [], warmup_steps=10) == []        # still in the warm-up
    assert health_flags(records[:1], [], [], warmup_steps=0) == []     # step 0 alone: nothing to compare
    moving = [health(0, [0, 0]), health(10, [1e-8, 2 * hf.STILL_MAX_UPDATE])]
    assert health_flags(moving, [], [], warmup_steps=0) == []


def test_still_measures_from_the_first_record_so_an_init_lora_that_does_not_move_is_still():
    records = [health(0, [0.3, 0.2]), health(10, [0.3, 0.2 + 1e-9])]
    assert names(health_flags(records, [], [], warmup_steps=0)) == ["still"]
    assert health_flags([health(0, [0.3, 0.2]), health(10, [0.31, 0.2])], [], [], warmup_steps=0) == []


def test_exploding_when_a_block_grows_by_orders_of_magnitude():
    records = [health(0, [0, 0]), health(10, [1e-3, 1e-3]), health(20, [2e-3, 1e-3 * hf.EXPLODE_GROWTH])]
    flags = health_flags(records, [], [], warmup_steps=0)
    assert names(flags) == ["exploding"] and "block 1" in flags[0]["what"]
    records[-1] = health(20, [2e-3, 2e-3])
    assert health_flags(records, [], [], warmup_steps=0) == []
    # From the warm-up's tiny first update, growth is expected: not flagged.
    records = [health(0, [0, 0]), health(10, [1e-6, 1e-6]), health(20, [1e-3, 1e-3])]
    assert health_flags(records, [], [], warmup_steps=10) == []


def test_exploding_when_the_gradient_norm_spikes_repeatedly():
    norms = [1.0] * 100
    for at in (40, 60, 80):
        norms[at] = 20.0
    records = [health(0, [0, 0]), health(100, [0.1, 0.1])]
    flags = health_flags(records, steps([1.0] * 100, norms), [], warmup_steps=0)
    assert names(flags) == ["exploding"] and "3 gradient-norm spikes" in flags[0]["what"]
    norms[80] = 5.0   # two spikes only
    assert health_flags(records, steps([1.0] * 100, norms), [], warmup_steps=0) == []
    norms[80] = 20.0   # three spikes (steps 41, 61, 81), the first older than the window
    assert hf.grad_spikes(steps([1.0] * 100, norms), 100 + hf.SPIKE_WINDOW - 50) == [61, 81]


def test_nonfinite_steps_since_the_previous_record_and_norms_that_are_not_finite():
    records = [health(0, [0, 0]), health(10, [0.1, 0.1], [1.0, 1.0])]
    history = steps([1.0] * 10, nonfinite={4, 5})
    flags = health_flags(records, history, [], warmup_steps=0)
    assert names(flags) == ["nonfinite"] and "2 step(s)" in flags[0]["what"] and "already guarded" in flags[0]["do"]
    assert health_flags(records, steps([1.0] * 10), [], warmup_steps=0) == []
    history = steps([1.0, math.nan] + [1.0] * 8)   # a NaN loss read back from the history
    assert names(health_flags(records, history, [], warmup_steps=0)) == ["nonfinite"]
    records[-1] = health(10, [0.1, None], [1.0, 1.0])   # a norm written as null: it was not finite
    assert names(health_flags(records, steps([1.0] * 10), [], warmup_steps=0)) == ["nonfinite"]
    records[-1] = health(10, [0.1, 0.1], None)   # gradient norms not measured (ZeRO-2): not a flag
    assert health_flags(records, steps([1.0] * 10), [], warmup_steps=0) == []


def val(step, loss, base=None):
    return {"kind": "val", "step": step, "val_loss": loss, **({} if base is None else {"val_loss_base": base})}


def test_overfitting_when_the_gain_over_the_base_shrinks_while_the_training_loss_falls():
    falling = steps([1.0 - 0.002 * i for i in range(300)])
    vals = [val(100, 0.50, 0.60), val(200, 0.53, 0.60), val(300, 0.56, 0.60)]   # gain 0.10, 0.07, 0.04
    records = [health(0, [0, 0]), health(300, [0.3, 0.3])]
    flags = health_flags(records, falling, vals, warmup_steps=0)
    assert names(flags) == ["overfitting"] and "0.1 -> 0.04" in flags[0]["what"]
    assert "--save_steps" in flags[0]["do"]
    # the training loss not falling: not overfitting (the whole run got worse)
    assert health_flags(records, steps([1.0] * 300), vals, warmup_steps=0) == []
    # the gain growing again at the last validation
    growing = vals[:2] + [val(300, 0.52, 0.60)]
    assert health_flags(records, falling, growing, warmup_steps=0) == []
    # fewer validations with a base-model loss than the rule reads
    assert health_flags(records, falling, [val(100, 0.5), *vals[1:]], warmup_steps=0) == []
    # a validation's own training-loss average (taken when it was made) wins over the steps kept
    kept = [{**v, "train_loss_avg": avg} for v, avg in zip(vals, (0.5, 0.6, 0.7))]
    assert health_flags(records, falling, kept, warmup_steps=0) == []


def test_the_summary_holds_the_largest_update_and_gradient_with_their_blocks_and_the_flags():
    record = {**health(20, [0.1, 0.3, None], [2.0, 1.0, 0.5]), "flags": [{"flag": "still"}], "seconds": 0.01}
    assert summary(record) == {"step": 20, "max_update_norm": 0.3, "max_update_block": 1, "max_grad_norm": 2.0,
                               "max_grad_block": 0, "flags": [{"flag": "still"}], "seconds": 0.01}
    assert summary(health(0, [0.0]))["max_grad_norm"] is None


@pytest.mark.parametrize("name", ["STILL_MAX_UPDATE", "EXPLODE_GROWTH", "SPIKE_FACTOR", "SPIKE_BASELINE",
                                  "SPIKE_WINDOW", "SPIKES_TO_FLAG", "OVERFIT_VALIDATIONS", "LOSS_AVERAGE_STEPS"])
def test_every_threshold_is_documented(name):
    from pathlib import Path

    docs = (Path(__file__).resolve().parents[3] / "docs" / "training.md").read_text()
    assert name in docs
