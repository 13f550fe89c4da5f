"""The models of a sweep, loaded once per invocation, and each LoRA file's weights swapped in without reloading them.

The pipeline is the training's (the demo's seeded tiny model, or the release from ``--model_dir``/``--model_id``, in
the dtype the run's precision gives, its residual stream in fp32 where the run's ``--fp32_residual`` chooses it),
wrapped in the training's ``WanTI2VLoraModule`` with the file's rank, alpha, targets and variant; a file's weights
load into its LoRA (or DoRA) layers (``training/lora/load_file.py``). Clips come
from the training's own sampler (``sample_clips.generate_clip``), at a strength by ``lora_strength`` (0: the base model,
bit for bit). The validation is the training's ``Validator`` on the same module: the LoRA as loaded, and the base with
the LoRA off.
"""

from __future__ import annotations

import contextlib
import copy
import os
import sys
from pathlib import Path

from diffsynth_mbc.sample_prompts import SamplePrompt
from diffsynth_mbc.training.lora.load_file import load_lora_file, lora_settings


class SweepStatus:
    """What the training's validator tells its status writer, for a command without one: the phase, and waits in a
    collective (nothing to keep fresh: no monitor reads a sweep)."""

    def __init__(self):
        self.state: dict = {}

    def update(self, **fields) -> None:
        self.state.update(fields)

    def waiting(self, _what: str):
        return contextlib.nullcontext()


def start_accelerator(options):
    """An ``Accelerator`` with the run's precision for this GPU (``gpu.resolve_precision``): one process, or each
    process of ``accelerate launch`` (gloo on CPUs)."""
    import torch
    from accelerate import Accelerator
    from accelerate.utils import InitProcessGroupKwargs

    from diffsynth_mbc.gpu import require_supported_gpu, resolve_precision

    require_supported_gpu()
    capability = tuple(torch.cuda.get_device_capability()) if torch.cuda.is_available() else None
    precision, _ = resolve_precision(options.mixed_precision, capability)
    handlers = []
    if int(os.environ.get("WORLD_SIZE", "1")) > 1 and not torch.cuda.is_available():
        os.environ.setdefault("ACCELERATE_USE_CPU", "1")
        handlers.append(InitProcessGroupKwargs(backend="gloo"))
    return Accelerator(mixed_precision=precision, kwargs_handlers=handlers)


class Renderer:
    def __init__(self, options, accelerator):
        self.options, self.accelerator = options, accelerator
        self.module = None
        self.settings: tuple | None = None   # (rank, alpha, targets, variant) the module was built for
        self.file: str | None = None
        self.texts: dict = {}   # (text, positive) -> its embedding: each prompt (and caption) encoded once

    @property
    def pipe(self):
        return self.module.pipe

    def use(self, path: str) -> None:
        """The LoRA file at ``path`` in the module (built again only for another rank, alpha, targets or variant)."""
        if self.file == path:
            return
        found = lora_settings(path)
        settings = (found["rank"], found["alpha"], found["targets"], found["variant"])
        if settings != self.settings:
            self.module = self._build(*settings)
            self.settings = settings
        load_lora_file(self.module, path)
        self.file = path

    def _build(self, rank: int, alpha: float | None, targets: str, variant: str):
        import torch

        from diffsynth_mbc.models.pipeline import build_demo_pipeline, load_pipeline
        from diffsynth_mbc.training.lora.module import WanTI2VLoraModule
        from diffsynth_mbc.training.plan.residual_policy import decide_fp32_residual

        options, device = self.options, str(self.accelerator.device)
        self.module = None   # the previous model's memory first
        if options.demo:
            pipe = build_demo_pipeline(device=device, torch_dtype=torch.float32, seed=options.seed)
        else:
            dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(self.accelerator.mixed_precision,
                                                                        torch.float32)
            pipe = load_pipeline(options.model_dir, options.model_id, device=device, torch_dtype=dtype)
        module = WanTI2VLoraModule(pipe, lora_target_modules=targets, lora_rank=rank, lora_alpha=alpha,
                                   use_gradient_checkpointing=False, lora_variant=variant,
                                   fp32_residual=decide_fp32_residual(options.fp32_residual,
                                                                      self.accelerator.mixed_precision).on)
        module.to(self.accelerator.device)
        module.eval()
        self._encode_once(pipe)
        return module

    def _encode_once(self, pipe) -> None:
        """The prompter's embeddings kept per text: every file renders the same prompts (and validates the same
        captions), and an embedding does not depend on the LoRA, which the text encoder does not have."""
        encode = pipe.prompter.encode_prompt
        texts = self.texts

        def encode_prompt(prompt, positive=True, device=None, **kwargs):
            key = (prompt, positive)
            if key not in texts:
                texts[key] = encode(prompt, positive=positive, device=device, **kwargs).detach()
            return texts[key].to(device=device or pipe.device)
        pipe.prompter.encode_prompt = encode_prompt   # an instance attribute over the class's method

    def render(self, prompt: SamplePrompt, strength: float, on_step=None) -> list:
        import torch

        from diffsynth_mbc.training.evaluation.sample_clips import generate_clip
        from diffsynth_mbc.training.lora.strength import lora_strength

        training_scheduler = copy.deepcopy(self.pipe.scheduler)   # generation re-times it; validation needs it
        try:
            with torch.no_grad(), lora_strength(self.pipe.dit, strength):
                return generate_clip(self.pipe, prompt, self.accelerator, on_step)
        finally:
            self.pipe.scheduler = training_scheduler

    def validator(self, options):
        """The training's validator over ``options``' validation set, attached to this module."""
        from diffsynth_mbc.training.evaluation.validation import Validator

        validator = Validator(options, SweepStatus())
        validator.attach(self.accelerator, self.module)
        return validator


def validation_of(validator, base: bool = False) -> dict:
    """The validation figures of the module as it is (``base``: with the LoRA off), as the run's records name them."""
    context = validator.module.lora_disabled() if base else contextlib.nullcontext()
    with context:
        by_quantile, by_mode, samples = validator.measure()
    if not samples:
        return {}
    return {"val_loss": sum(by_quantile.values()) / len(by_quantile), "val_loss_by_quantile": by_quantile,
            "val_loss_by_mode": by_mode, "val_samples": samples}


def say(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def relative(path: str | Path, folder: Path) -> str:
    try:
        return str(Path(path).resolve().relative_to(folder.resolve()))
    except ValueError:
        return str(path)
