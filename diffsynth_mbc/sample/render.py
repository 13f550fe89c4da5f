"""The models of a sweep, loaded once per invocation, and each LoRA file's weights swapped in without reloading them.

The pipeline is the training's (the demo's seeded tiny model, or the release from ``--model_dir``/``--model_id``, in
the dtype the run's precision gives, its residual stream in fp32 where the run's ``--fp32_residual`` chooses it),
wrapped in the training's LoRA module (``lora_module``: the run's options with the file's rank, alpha, targets and
variant); a file's weights load into its LoRA (or DoRA) layers (``training/lora/load_file.py``). Clips come
from the training's own sampler (``sample_clips.generate_clip``), at a strength by ``lora_strength`` (0: the base model,
bit for bit). The validation is the training's ``Validator`` on the same module: the LoRA as loaded, and the base with
the LoRA off.
"""

from __future__ import annotations

import contextlib
import copy
import sys
from pathlib import Path

from diffsynth_mbc.run_files import check_status_fields
from diffsynth_mbc.sample_prompts import SamplePrompt
from diffsynth_mbc.training.lora.load_file import LoraFileError, load_lora_file, lora_settings, misfit


class SweepStatus:
    """What the training's validator tells its status writer, for a command without one: the phase, and waits in a
    collective (nothing to keep fresh: no monitor reads a sweep)."""

    def __init__(self):
        self.state: dict = {}

    def update(self, **fields) -> None:
        check_status_fields(fields)   # the training's status fields, as its writer checks them
        self.state.update(fields)

    def waiting(self, _what: str):
        return contextlib.nullcontext()


def rendering_settings(options, accelerator) -> dict:
    """What renders a clip besides its prompt, file and strength: the model (the demo's, built from its seed, or the
    release's folder or id), the precision and the device."""
    folder = str(Path(options.model_dir).resolve()) if options.model_dir else None
    model = {"demo_seed": options.seed} if options.demo else {"model_dir": folder, "model_id": options.model_id}
    return {"model": model, "precision": accelerator.mixed_precision, "device": accelerator.device.type}


def fitting_settings(files: list, demo: bool, model: str) -> dict[str, dict]:
    """{path: ``lora_settings``} of every file, once each has been checked against the model's layers (their widths
    from its config, on the meta device: no weights): LoraFileError naming the first file that does not fit, before
    the model loads."""
    import torch
    from diffsynth.models.wan_video_dit import WanModel

    from diffsynth_mbc.models.pipeline import TI2V_5B_DIT, TINY_DIT

    with torch.device("meta"):
        dit = WanModel(**(TINY_DIT if demo else TI2V_5B_DIT))
    layers = {name: (layer.in_features, layer.out_features) if isinstance(layer, torch.nn.Linear) else None
              for name, layer in dit.named_modules() if name}
    found = {}
    for item in files:
        settings = lora_settings(item.path)
        problem = misfit(settings, layers, model)
        if problem:
            raise LoraFileError(problem)
        found[item.path] = settings
    return found


class Renderer:
    def __init__(self, options, accelerator, known: dict[str, dict] | None = None):
        self.options, self.accelerator = options, accelerator
        self.known = known or {}   # path -> lora_settings, read when the files were checked (fitting_settings)
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
        found = self.known.get(path) or lora_settings(path)
        settings = (found["rank"], found["alpha"], found["targets"], found["variant"])
        if settings != self.settings:
            self.module = self._build(path, *settings)
            self.settings = settings
        try:
            load_lora_file(self.module, path)
        except LoraFileError as exc:
            raise LoraFileError(str(exc) if path in str(exc) else f"{path}: {exc}") from None
        self.file = path

    def _build(self, path: str, rank: int, alpha: float | None, targets: str, variant: str):
        import torch

        from diffsynth_mbc.gpu import torch_dtype
        from diffsynth_mbc.models.pipeline import build_demo_pipeline, load_pipeline
        from diffsynth_mbc.training.lora.module import lora_module
        from diffsynth_mbc.training.plan.residual_policy import decide_fp32_residual

        options, device = self.options, str(self.accelerator.device)
        self.module = None   # the previous model's memory first
        if options.demo:
            pipe = build_demo_pipeline(device=device, torch_dtype=torch.float32, seed=options.seed)
        else:
            pipe = load_pipeline(options.model_dir, options.model_id, device=device,
                                 torch_dtype=torch_dtype(self.accelerator.mixed_precision))
        try:
            module = lora_module(pipe, options.replace(lora_rank=rank, lora_alpha=alpha, lora_target_modules=targets,
                                                       lora_variant=variant, use_gradient_checkpointing=False),
                                 fp32_residual=decide_fp32_residual(options.fp32_residual,
                                                                    self.accelerator.mixed_precision).on)
        except ValueError as exc:   # peft refusing the file's targets on this model
            raise LoraFileError(f"the LoRA of {path} cannot be put on the model ({exc})") from None
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
        by_quantile, by_mode, samples = validator.measure_losses()
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
