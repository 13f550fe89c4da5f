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


def adamw(parameters, learning_rate: float, weight_decay: float, deepspeed: bool = False):
    """The training's AdamW: torch's fused kernel (one launch for every LoRA tensor, and the skip flag taken on the
    device: ``skips_on_the_device``), except under DeepSpeed, whose engine steps its own copy of the weights."""
    import torch

    return torch.optim.AdamW(parameters, lr=learning_rate, weight_decay=weight_decay, fused=not deepspeed or None)


def skips_on_the_device(optimizer) -> bool:
    """Whether ``optimizer`` (torch's, or accelerate's wrapper of it) can be told on the device to skip its update:
    the fused AdamW takes a ``found_inf`` flag tensor and leaves every weight and moment as it was where it is 1.
    Each group's own flag counts: a checkpoint's optimizer state brings its groups' (an older run's are not fused)."""
    inner = getattr(optimizer, "optimizer", optimizer)
    groups = getattr(inner, "param_groups", [])
    return (hasattr(inner, "_step_supports_amp_scaling") and bool(groups)
            and all(group.get("fused") for group in groups))


def forward_backward(parts, batch, earlier_losses: list, loss_of, on_gradients) -> MicroBatch:
    """One micro-batch; at the last of an optimizer step also the step itself, unless it is non-finite.

    ``loss_of(batch)``: the forward. A step is skipped on every rank alike when any rank's loss in it is inf/NaN (one
    small all-reduce) or the averaged gradients' norm is. Under fp16 the loss scaler's own step still runs: it skips
    the update itself and lowers the scale. Under DeepSpeed the engine has already stepped inside ``backward``; its
    fp16 scaler skips overflowed steps. ``on_gradients(grad_norm, max_norm)`` is told the clipped gradients' norm
    (a 0-dim tensor on the device: reading it waits for the GPU) while they are there. The learning-rate schedule
    steps after every optimizer step, skipped or not.

    The host does not wait for the GPU inside the step: the skip flag stays on the device and a fused AdamW takes it
    (``skips_on_the_device``); the flag and the norm are read once, after the optimizer's step is queued. Another
    optimizer (DeepSpeed's engine, a loss scaler's) is told on the host: the one read comes before its step.
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
        nonfinite = torch.isfinite(losses).all().logical_not().to(torch.int64).reshape(1)
        nonfinite = all_reduce_sum(accelerator, nonfinite, parts.status, "ranks in all-reduce (non-finite check)")
        max_norm = options.max_grad_norm if options.max_grad_norm > 0 else math.inf   # inf: measure only
        grad_norm = accelerator.clip_grad_norm_(parts.trainable, max_norm)
        on_gradients(grad_norm, max_norm)
        norm = torch.zeros(1, device=nonfinite.device) if grad_norm is None \
            else torch.as_tensor(grad_norm, device=nonfinite.device).detach().float().reshape(1)   # DeepSpeed's: a float
        skip = (nonfinite > 0) | norm.isfinite().logical_not()
        if accelerator.scaler is None and skips_on_the_device(optimizer):
            inner = getattr(optimizer, "optimizer", optimizer)
            inner.found_inf = skip.float().reshape(())
            try:
                optimizer.step()
            finally:
                del inner.found_inf
            skipped, grad_norm = read_step(skip, norm, grad_norm)
        else:
            skipped, grad_norm = read_step(skip, norm, grad_norm)
            if not skipped or accelerator.scaler is not None:
                optimizer.step()
        optimizer.zero_grad()
    lr = optimizer.param_groups[0]["lr"]
    parts.scheduler.step()
    return MicroBatch(loss, step_done=True, grad_norm=grad_norm, skipped=skipped, lr=lr)


def read_step(skip, norm, grad_norm) -> tuple[bool, float | None]:
    """The step's skip flag and gradient norm on the host, in one copy from the device."""
    import torch

    flag, value = torch.cat([skip.float(), norm]).tolist()
    return flag > 0, None if grad_norm is None else value


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
