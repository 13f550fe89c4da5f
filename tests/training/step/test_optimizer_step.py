"""The optimizer step of ``forward_backward`` (training/step/micro_batch.py): the training's fused AdamW takes the
step's skip flag on the device, so a non-finite step leaves the LoRA and AdamW's state exactly as they were without the
host reading the flag first; an optimizer that cannot (an older checkpoint's groups, not fused) is told on the host,
with the same decision. Real DiffSynth DiT (tiny, random), real accelerate, one process on the CPU."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from diffsynth_mbc.training.step.batch_loss import rope_table
from diffsynth_mbc.training.step.micro_batch import adamw, forward_backward, skips_on_the_device
from tiny_step import make_module


class Steps:
    """A tiny LoRA module behind accelerate's prepare, stepped through ``forward_backward``; ``nan_at``: the steps
    (1-based) whose loss is NaN."""

    def __init__(self, fused: bool, nan_at=()):
        from accelerate import Accelerator

        torch.manual_seed(3)
        self.module = make_module()
        self.trainable = [p for p in self.module.parameters() if p.requires_grad]
        optimizer = adamw(self.trainable, 1e-2, 0.01) if fused else torch.optim.AdamW(self.trainable, lr=1e-2,
                                                                                       weight_decay=0.01)
        self.accelerator = Accelerator(cpu=True)
        module, optimizer = self.accelerator.prepare(self.module, optimizer)
        self.parts = SimpleNamespace(accelerator=self.accelerator, module=module, optimizer=optimizer, status=None,
                                     trainable=self.trainable, options=SimpleNamespace(max_grad_norm=1.0),
                                     scheduler=torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0))
        self.nan_at, self.step = set(nan_at), 0
        self.norms_seen = []

    def loss_of(self, _batch):
        generator = torch.Generator().manual_seed(self.step)
        x = torch.randn((4, self.trainable[0].shape[-1]), generator=generator)
        loss = sum((x @ p.reshape(-1, x.shape[-1]).T).square().mean() for p in self.trainable
                   if p.shape[-1] == x.shape[-1])
        return loss * math.nan if self.step in self.nan_at else loss

    def take(self):
        self.step += 1
        return forward_backward(self.parts, None, [], self.loss_of,
                                lambda grad_norm, max_norm: self.norms_seen.append(grad_norm))

    def state(self) -> list[torch.Tensor]:
        inner = self.parts.optimizer.optimizer
        return [p.detach().clone() for p in self.trainable] + [
            value.detach().clone() for p in self.trainable for value in inner.state[p].values()]


def same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


def test_the_training_adamw_takes_the_skip_flag_on_the_device():
    fused, plain = Steps(fused=True), Steps(fused=False)
    assert skips_on_the_device(fused.parts.optimizer) and not skips_on_the_device(plain.parts.optimizer)
    assert adamw(fused.trainable, 1e-3, 0.0, deepspeed=True).param_groups[0]["fused"] is None   # DeepSpeed's own


@pytest.mark.parametrize("fused", [True, False], ids=["flag on the device", "flag on the host"])
def test_a_non_finite_step_leaves_the_lora_and_adamw_as_they_were(fused):
    steps = Steps(fused=fused, nan_at={2})
    first = steps.take()
    assert not first.skipped and first.step_done and math.isfinite(first.grad_norm)
    before = steps.state()
    second = steps.take()
    assert second.skipped and not math.isfinite(second.grad_norm)
    assert same(steps.state(), before)   # weights, moments and AdamW's step count untouched
    assert not hasattr(steps.parts.optimizer.optimizer, "found_inf")   # the flag does not outlive its step
    third = steps.take()
    assert not third.skipped and not same(steps.state(), before)
    # what the components were told: the clipped-before norm as a device tensor, the value the step reports
    assert [float(norm) for norm in steps.norms_seen][::2] == [first.grad_norm, third.grad_norm]


def test_both_ways_take_the_same_steps():
    """A run with a skipped step in the middle: the fused AdamW (flag on the device) and torch's default AdamW (the
    host told) make the same decisions and end at the same LoRA (to AdamW's float rounding)."""
    runs = [Steps(fused=fused, nan_at={3}) for fused in (True, False)]
    decisions = [[steps.take().skipped for _ in range(5)] for steps in runs]
    assert decisions[0] == decisions[1] == [False, False, True, False, False]
    for a, b in zip(runs[0].trainable, runs[1].trainable):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)


def test_the_rotary_table_is_built_once_per_grid_as_diffsynth_builds_it():
    dit = make_module().pipe.dit
    f, h, w = 2, 3, 4
    expected = torch.cat([dit.freqs[0][:f].view(f, 1, 1, -1).expand(f, h, w, -1),
                          dit.freqs[1][:h].view(1, h, 1, -1).expand(f, h, w, -1),
                          dit.freqs[2][:w].view(1, 1, w, -1).expand(f, h, w, -1)], dim=-1).reshape(f * h * w, 1, -1)
    table = rope_table(dit, f, h, w, torch.device("cpu"))
    assert torch.equal(table, expected)
    assert rope_table(dit, f, h, w, torch.device("cpu")) is table   # a bucket's next step reuses it
    assert rope_table(dit, 1, h, w, torch.device("cpu")).shape[0] == h * w
