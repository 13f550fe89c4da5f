"""The non-finite step guard (pure), and the fp16 loss-scaling behaviour it relies on."""

from __future__ import annotations

import math

import pytest

from diffsynth_mbc.training.step.guards import NonFiniteError, NonFiniteGuard, injected_steps


def test_non_finite_steps_are_counted_and_a_finite_one_resets_the_run():
    guard = NonFiniteGuard(max_in_a_row=3, precision="bf16")
    assert guard.check(1, 0.5, 1.0) is False
    assert guard.check(2, math.nan, 1.0) is True and guard.check(3, 0.4, math.inf) is True
    assert guard.status_fields() == {"nonfinite_steps": 2, "nonfinite_in_a_row": 2}
    assert guard.check(4, 0.4, 0.9) is False and guard.in_a_row == 0 and guard.total == 2
    assert guard.check(5, 0.4, 0.9, skipped=True) is True   # another rank's loss was the bad one


def test_too_many_in_a_row_stop_the_run_naming_the_steps_the_precision_and_the_remedy():
    guard = NonFiniteGuard(max_in_a_row=3, precision="fp16")
    guard.check(7, math.nan, None)
    guard.check(8, math.nan, None)
    with pytest.raises(NonFiniteError) as caught:
        guard.check(9, math.nan, None)
    message = str(caught.value)
    assert message.startswith("steps 7-9: 3 optimizer steps in a row had a non-finite loss")
    assert "under fp16" in message and "--max_nonfinite_steps 3" in message
    assert "--mixed_precision bf16" in message and "--resume latest" in message


def test_fault_injection_only_for_the_rank_named():
    assert injected_steps({"MBC_FAULT_NONFINITE_LOSS": "1:3,4"}, 1) == {3, 4}
    assert injected_steps({"MBC_FAULT_NONFINITE_LOSS": "1:3,4"}, 0) == frozenset()
    assert injected_steps({}, 0) == frozenset()


def test_fp16_loss_scaling_skips_an_overflowed_step_and_lowers_the_scale():
    """What fp16 training relies on, with torch's own GradScaler (on the CPU: accelerate does not use one
    there, so the training refuses fp16 on the CPU and this is tested directly). The LoRA parameters stay
    fp32; an overflowed step leaves them unchanged, halves the scale, and the guard counts it; the next
    finite step updates them."""
    import torch

    lora = torch.nn.Parameter(torch.ones(4, dtype=torch.float32))
    optimizer = torch.optim.AdamW([lora], lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 16)
    guard = NonFiniteGuard(max_in_a_row=20, precision="fp16")
    for step, factor in ((1, float("inf")), (2, 1.0)):
        before = lora.detach().clone()
        scale = scaler.get_scale()
        loss = (lora * factor).sum()
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        grad_norm = float(torch.nn.utils.clip_grad_norm_([lora], max_norm=1.0))
        scaler.step(optimizer)   # skips the update itself when the gradients are not finite
        scaler.update()
        optimizer.zero_grad()
        skipped = guard.check(step, float(loss.detach()), grad_norm)
        if step == 1:
            assert skipped and torch.equal(lora, before) and scaler.get_scale() == scale / 2
        else:
            assert not skipped and not torch.equal(lora, before) and lora.dtype == torch.float32
    assert guard.total == 1


def test_stop_signal_handling_gives_the_signals_back_when_the_run_is_over():
    """main() called in-process (a notebook, a test) must not leave SIGTERM blocked for what the process starts
    next: a launcher started from there would never receive its stop."""
    import subprocess
    import sys

    code = ("import signal\nfrom diffsynth_mbc.lifecycle.signals import StopSignals\n"
            "s = StopSignals(on_stuck=lambda sig: None).install()\n"
            "assert signal.SIGTERM in signal.pthread_sigmask(signal.SIG_BLOCK, [])\n"
            "s.finished()\n"
            "print(signal.SIGTERM in signal.pthread_sigmask(signal.SIG_BLOCK, []))\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.stdout.strip() == "False", result.stderr


def test_under_fp16_non_finite_forwards_name_the_fp32_residual_stream_and_the_largest_residual_seen():
    off = NonFiniteGuard(max_in_a_row=2, precision="fp16", fp32_residual=False)
    off.note_residual(40000.0)
    off.note_residual(math.inf)     # the stream overflowed
    off.note_residual(12.0)         # an overflow is kept for good
    assert off.largest_residual == math.inf and off.residual_fields() == {"largest_residual": "inf"}
    off.check(3, math.nan, None)
    with pytest.raises(NonFiniteError) as caught:
        off.check(4, math.nan, None)
    message = str(caught.value)
    assert "residual stream is fp16 here (--fp32_residual off; the largest residual magnitude seen: inf" in message
    assert "--fp32_residual on keeps the time embedding, modulation and residual stream in fp32" in message
    assert message.index("--fp32_residual on") < message.index("--mixed_precision bf16")   # tried first

    on = NonFiniteGuard(max_in_a_row=1, precision="fp16", fp32_residual=True)
    on.note_residual(70000.0)
    on.note_residual(30000.0)
    assert on.residual_fields() == {"largest_residual": 70000.0}
    with pytest.raises(NonFiniteError) as caught:
        on.check(9, math.nan, None)
    assert ("residual stream is fp32 already (--fp32_residual on; the largest residual magnitude seen: 70,000, "
            "fp16's limit is 65,504), so a block's own attention or FFN output passed 65,504") in str(caught.value)
    bf16 = NonFiniteGuard(max_in_a_row=1, precision="bf16")
    with pytest.raises(NonFiniteError) as caught:
        bf16.check(1, math.nan, None)
    assert "--fp32_residual" not in str(caught.value)
    assert NonFiniteGuard(max_in_a_row=1, precision="fp16").residual_fields() == {}
