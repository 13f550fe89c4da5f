"""One micro-batch of the training loop: forward (falling back once from compiled blocks that fail to compile),
backward, and at the end of an optimizer step the agreed skip-or-step: clipping, the optimizer's and the learning
rate schedule's step."""

from __future__ import annotations

from dataclasses import dataclass

from diffsynth_mbc import environment
from diffsynth_mbc.training.distributed.accelerator import unwrapped_model
from diffsynth_mbc.training.distributed.collectives import all_reduce_sum


def latent_frames(sample: dict) -> int:
    """Latent frames of one sample (a cache entry's, or a decoded clip's: 4 frames each after the first)."""
    if "input_latents" in sample:
        return int(sample["input_latents"].shape[-3])
    return (len(sample["video"]) - 1) // 4 + 1


def pixel_shape(latents) -> list[int]:
    """[frames, height, width] in pixels of a latent [..., F, H, W] (Wan2.2 VAE: 4 frames per latent frame after
    the first, 16x16 pixels per cell): the shape a sample trains at, for the history's ``shapes``."""
    frames, height, width = (int(side) for side in latents.shape[-3:])
    return [(frames - 1) * 4 + 1, height * 16, width * 16]


def sample_tokens(sample: dict) -> int:
    """DiT tokens of one sample: latent frames x (height / 32) x (width / 32) (VAE 4x16x16, patch 1x2x2)."""
    if "input_latents" in sample:
        height, width = sample["input_latents"].shape[-2:]
        return int(latent_frames(sample) * (height // 2) * (width // 2))
    width, height = sample["video"][0].size
    return latent_frames(sample) * (height // 32) * (width // 32)


def forward(module, accelerator, status, batch):
    """The module's loss on ``batch``. While the first compiled steps run, a compile error (torch's dynamo or
    inductor) turns compiling off, said once, and the batch runs uncompiled."""
    blocks = unwrapped_model(accelerator, module).blocks
    if not blocks.compiled:
        return module(batch)
    try:
        return module(batch)
    except Exception as exc:  # noqa: BLE001 - only compile errors are handled; anything else is raised again
        if not type(exc).__module__.startswith(("torch._dynamo", "torch._inductor")):
            raise
        blocks.give_up_compiling(exc)
        status.update(compile=False, compile_reason=f"compiling failed: {type(exc).__name__}")
        return module(batch)


@dataclass(frozen=True)
class MicroBatch:
    loss: object                 # the micro-batch's loss (a 0-dim tensor)
    step_done: bool = False      # the last micro-batch of an optimizer step: the rest is that step's
    grad_norm: float | None = None
    skipped: bool = False        # non-finite on some rank: the update was skipped on every rank
    lr: float | None = None      # the learning rate the step trained at (before the schedule moved on)


def forward_backward(parts, batch, earlier_losses: list, loss_of, on_gradients) -> MicroBatch:
    """One micro-batch; at the last of an optimizer step also the step itself, unless it is non-finite.

    ``loss_of(batch)``: the forward. A step is skipped on every rank alike when any rank's loss in it is inf/NaN (one
    small all-reduce) or the averaged gradients' norm is. Under fp16 the loss scaler's own step still runs: it skips
    the update itself and lowers the scale. Under DeepSpeed the engine has already stepped inside ``backward``; its
    fp16 scaler skips overflowed steps. ``on_gradients(grad_norm, max_norm)`` is told the clipped gradients' norm
    while they are there. The learning-rate schedule steps after every optimizer step, skipped or not.
    """
    import math

    import torch

    accelerator, options, optimizer = parts.accelerator, parts.options, parts.optimizer
    with accelerator.accumulate(parts.module):
        loss = loss_of(batch)
        accelerator.backward(loss)
        if not accelerator.sync_gradients:
            return MicroBatch(loss)
        losses = torch.stack([*earlier_losses, loss.detach()])
        local_bad = torch.tensor([0 if bool(torch.isfinite(losses).all()) else 1], device=accelerator.device)
        any_bad = int(all_reduce_sum(accelerator, local_bad, parts.status, "ranks in all-reduce (non-finite check)")
                      .item()) > 0
        max_norm = options.max_grad_norm if options.max_grad_norm > 0 else math.inf   # inf: measure only
        grad_norm = accelerator.clip_grad_norm_(parts.trainable, max_norm)
        grad_norm = None if grad_norm is None else float(grad_norm)
        on_gradients(grad_norm, max_norm)
        skipped = any_bad or (grad_norm is not None and not math.isfinite(grad_norm))
        if not skipped or accelerator.scaler is not None:
            optimizer.step()
        optimizer.zero_grad()
    lr = optimizer.param_groups[0]["lr"]
    parts.scheduler.step()
    return MicroBatch(loss, step_done=True, grad_norm=grad_norm, skipped=skipped, lr=lr)


def injected_nonfinite_steps(environ, rank: int) -> frozenset[int]:
    """Fault injection for tests: ``MBC_FAULT_NONFINITE_LOSS=RANK:STEP,STEP,...`` makes that rank's loss NaN
    at those optimizer steps (1-based), to show the non-finite guard on a real run. Unset in normal use."""
    value = environ.get(environment.FAULT_NONFINITE_LOSS, "")
    if not value:
        return frozenset()
    who, _, steps = value.partition(":")
    if int(who) != rank:
        return frozenset()
    return frozenset(int(step) for step in steps.split(",") if step.strip())
