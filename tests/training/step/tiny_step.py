"""The tiny training module the step tests run: DiffSynth's classes, random weights, a LoRA with a visible effect."""

import torch

from diffsynth_mbc.models.pipeline import build_demo_pipeline
from diffsynth_mbc.training.lora.module import WanTI2VLoraModule

SEED = 42


def make_module(dtype=torch.float32, **kwargs) -> WanTI2VLoraModule:
    pipe = build_demo_pipeline(device="cpu", torch_dtype=torch.float32, seed=SEED, load_encoders=False)
    pipe = pipe.to(dtype=dtype)
    pipe.torch_dtype = dtype
    torch.manual_seed(0)
    module = WanTI2VLoraModule(pipe, lora_rank=4, **kwargs)
    for name, param in module.named_parameters():   # B starts at zero: give the LoRA a visible effect
        if "lora_B" in name:
            torch.nn.init.normal_(param, std=0.02)
    return module


def scaled_step(loss, scaler, optimizer, trainable, guard, step: int) -> bool:
    """One fp16 optimizer step as accelerate takes it (the loss scaled, the fp32 gradients unscaled and clipped, the
    step skipped by the scaler where they overflowed) and the guard's verdict on it: True where it was skipped."""
    scaler.scale(loss).backward()
    scaler.unscale_(optimizer)
    grad_norm = float(torch.nn.utils.clip_grad_norm_(trainable, max_norm=1.0))
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad()
    return guard.check(step, float(loss.detach()), grad_norm)
