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
