"""Running DiffSynth's own Wan pipeline units outside a training step: clip and prompt inputs, latents.

Shared by the latent cache (data) and the training module (training). Imports torch and diffsynth.
"""

from __future__ import annotations

import torch
from diffsynth.pipelines.wan_video_new import WanVideoPipeline, WanVideoUnit_PromptEmbedder


def unit_inputs(pipe: WanVideoPipeline, sample: dict, conditioned: bool = True, **scalars) -> tuple[dict, dict, dict]:
    """The (shared, positive, negative) inputs the pipeline units start from for one clip sample; ``conditioned``:
    on its first frame (TI2V), else no input image (text-to-video / text-to-image)."""
    video = sample["video"]
    height, width = video[0].size[1], video[0].size[0]
    shared = {
        "input_video": video, "input_image": video[0] if conditioned else None,
        "height": height, "width": width, "num_frames": len(video),
        "cfg_scale": 1, "cfg_merge": False, "tiled": False, "rand_device": pipe.device,
        **scalars,
    }
    return shared, {"prompt": sample["prompt"]}, {}


def run_units(pipe: WanVideoPipeline, shared: dict, positive: dict, negative: dict, units=None) -> dict:
    """Run DiffSynth's own units (all of ``pipe.units`` unless a subset is given) without gradients."""
    with torch.no_grad():
        for unit in pipe.units if units is None else units:
            shared, positive, negative = pipe.unit_runner(unit, pipe, shared, positive, negative)
    return {**shared, **positive}


def media_units(pipe: WanVideoPipeline) -> list:
    """The units that turn a clip into latents: every unit except the prompt encoder."""
    return [unit for unit in pipe.units if not isinstance(unit, WanVideoUnit_PromptEmbedder)]


def prompt_units(pipe: WanVideoPipeline) -> list:
    return [unit for unit in pipe.units if isinstance(unit, WanVideoUnit_PromptEmbedder)]


def pad_context(context: torch.Tensor, text_len: int) -> torch.Tensor:
    """Zeros after the real tokens up to ``text_len``: what WanPrompter.encode_prompt returns."""
    if context.dim() == 2:
        context = context.unsqueeze(0)
    tokens = context.shape[1]
    if tokens > text_len:
        raise ValueError(f"text embedding has {tokens} tokens, more than text_len {text_len}")
    padded = context.new_zeros((context.shape[0], text_len, context.shape[2]))
    padded[:, :tokens] = context
    return padded
