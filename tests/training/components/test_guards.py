"""The guards (pure components): the non-finite step guard and the fp16 loss-scaling behaviour it relies on, the bad
media's count over all ranks, each rank's own kept in its checkpoint."""

from __future__ import annotations

import math

import pytest

from diffsynth_mbc.training.components.guards import BadMediaGuard, NonFiniteError, NonFiniteGuard, TooMuchBadMedia
from diffsynth_mbc.training.components.protocol import StepContext, StepResult
from diffsynth_mbc.training.reporting.status_writer import RankStatusWriter
from diffsynth_mbc.training.step.micro_batch import injected_nonfinite_steps


def step(number, skipped=False, loss=0.5, bad=(), samples=1):
    return StepContext(step=number, epoch=0, total_steps=100, agreed={"bad_media": len(bad), "samples": samples},
                       result=StepResult(loss=loss, lr=1e-4, grad_norm=1.0, skipped=skipped, samples=samples,
                                         tokens=1, bad_media=list(bad)))


def test_non_finite_steps_are_counted_and_a_finite_one_resets_the_run(tmp_path):
    guard = NonFiniteGuard(max_in_a_row=3, precision="bf16")
    assert guard.check(1, 0.5, 1.0) is False
    assert guard.check(2, math.nan, 1.0) is True and guard.check(3, 0.4, math.inf) is True
    assert guard.check(4, 0.4, 0.9) is False and guard.in_a_row == 0 and guard.total == 2
    assert guard.check(5, 0.4, 0.9, skipped=True) is True   # another rank's loss was the bad one
    status = RankStatusWriter(tmp_path, "run", 0, 0, 1, min_interval_s=0)
    component = NonFiniteGuard(max_in_a_row=3, precision="bf16", status=status)
    component.after_step(step(1))
    assert status.state.get("nonfinite_steps") is None   # said once there is one
    component.after_step(step(2, skipped=True))
    component.after_step(step(3, skipped=True))
    assert (status.state["nonfinite_steps"], status.state["nonfinite_in_a_row"]) == (2, 2)
    component.after_step(step(4))
    assert (status.state["nonfinite_steps"], status.state["nonfinite_in_a_row"]) == (2, 0)
    status.close()


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
    assert injected_nonfinite_steps({"MBC_FAULT_NONFINITE_LOSS": "1:3,4"}, 1) == {3, 4}
    assert injected_nonfinite_steps({"MBC_FAULT_NONFINITE_LOSS": "1:3,4"}, 0) == frozenset()
    assert injected_nonfinite_steps({}, 0) == frozenset()


def test_bad_media_are_counted_over_every_rank_and_each_rank_keeps_its_own(tmp_path):
    status = RankStatusWriter(tmp_path, "run", 0, 0, 1, min_interval_s=0)
    guard = BadMediaGuard(max_fraction=0.5, status=status)
    bad = [{"row": row, "file": f"m/{row}.mp4", "reason": f"row {row} cannot be decoded"} for row in range(1, 8)]
    assert guard.votes(step(1, bad=bad[:2], samples=4).result) == {"bad_media": 2, "samples": 4}
    guard.after_step(step(1, bad=bad[:2], samples=4))
    guard.after_step(step(2, bad=bad[2:7], samples=8))
    assert guard.skipped_samples == 7 and guard.recent_skips == bad[2:7]   # the newest five
    assert status.state["skipped_samples"] == 7 and status.state["skip_reasons"] == bad[2:7]
    resumed = BadMediaGuard(max_fraction=0.5, status=status)
    resumed.load_state_dict(guard.state_dict())
    assert (resumed.skipped_samples, resumed.recent_skips) == (7, bad[2:7])
    assert resumed.bad_total == 0   # the fraction counts what this process saw
    with pytest.raises(TooMuchBadMedia, match="11 of 12 samples so far could not be decoded"):
        guard.account(4, 0)
    status.close()


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


def test_missing_files_that_alone_would_stop_the_run_refuse_it_before_it_starts():
    """One missing row of 28 at repeat 3 is 3.6% of every epoch: the run trained 36 steps, then failed with
    TooMuchBadMedia (4.7% > 1%)."""
    from diffsynth_mbc.training.components.guards import missing_media_refusal

    draws = [3] * 28
    refusal = missing_media_refusal([(9, "media/image_002.png")], draws, 28 * 3 * 4, 0.01)
    assert refusal.startswith("1 of 28 metadata rows' files are not found (row 9: media/image_002.png): 3 of each "
                              "epoch's 84 samples (3.6%), past --max_bad_media_fraction 0.01, so the run would "
                              "replace about 12 of the 336 samples it has still to draw and stop part-way.")
    assert refusal.endswith("or raise --max_bad_media_fraction to 0.0358")
    # the run goes on where it would not stop: too few bad samples to come, a limit above the share, none missing
    assert missing_media_refusal([(9, "media/image_002.png")], draws, 28 * 3 * 3, 0.01) is None
    assert missing_media_refusal([(9, "media/image_002.png")], draws, 28 * 3 * 40, 0.0358) is None
    assert missing_media_refusal([], draws, 28 * 3 * 40, 0.01) is None
    many = missing_media_refusal([(row, f"media/{row}.png") for row in range(1, 9)], [1] * 20, 200, 0.01)
    assert "8 of 20 metadata rows' files are not found (row 1: media/1.png; row 2" in many
    assert "row 5: media/5.png; and 3 more)" in many


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
