"""One micro-batch of the training loop: forward (falling back once from compiled blocks that fail to
compile), backward, and at the end of a step the agreed skip-or-step of the optimizer."""

from __future__ import annotations

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


def forward(run, batch):
    """The module's loss on ``batch``. While the first compiled steps run, a compile error (torch's dynamo or
    inductor) turns compiling off, said once, and the batch runs uncompiled."""
    blocks = unwrapped_model(run.accelerator, run.module).blocks
    if not blocks.compiled:
        return run.module(batch)
    try:
        return run.module(batch)
    except Exception as exc:  # noqa: BLE001 - only compile errors are handled; anything else is raised again
        if not type(exc).__module__.startswith(("torch._dynamo", "torch._inductor")):
            raise
        blocks.give_up_compiling(exc)
        run.status.update(compile=False, compile_reason=f"compiling failed: {type(exc).__name__}")
        return run.module(batch)


def forward_backward(run, batch, earlier_losses: list):
    """One micro-batch; at the last of a step also the optimizer step, unless the step is non-finite.

    Returns (loss, gradient norm or None, skipped). A step is skipped on every rank alike when any rank's
    loss in it is inf/NaN (one small all-reduce) or the averaged gradients' norm is. Under fp16 the loss
    scaler's own step still runs: it skips the update itself and lowers the scale. Under DeepSpeed the
    engine has already stepped inside ``backward``; its fp16 scaler skips overflowed steps.
    """
    import math

    import torch

    accelerator, options = run.accelerator, run.options
    with accelerator.accumulate(run.module):
        loss = forward(run, batch)
        if run.position.step + 1 in run.injected_nonfinite:
            loss = loss * float("nan")
        accelerator.backward(loss)
        if not accelerator.sync_gradients:
            return loss, None, False
        losses = torch.stack([*earlier_losses, loss.detach()])
        local_bad = torch.tensor([0 if bool(torch.isfinite(losses).all()) else 1], device=accelerator.device)
        any_bad = int(all_reduce_sum(accelerator, local_bad, run.status, "ranks in all-reduce (non-finite check)")
                      .item()) > 0
        max_norm = options.max_grad_norm if options.max_grad_norm > 0 else math.inf   # inf: measure only
        grad_norm = accelerator.clip_grad_norm_(run.trainable, max_norm)
        grad_norm = None if grad_norm is None else float(grad_norm)
        if run.health is not None:   # on a step that records the LoRA's health: its blocks' gradient norms
            run.health.read_gradients(run.position.step + 1, grad_norm, max_norm)
        skipped = any_bad or (grad_norm is not None and not math.isfinite(grad_norm))
        if not skipped or accelerator.scaler is not None:
            run.optimizer.step()
        run.optimizer.zero_grad()
    return loss, grad_norm, skipped
