"""EMA of the LoRA weights (``--ema_decay D``): an fp32 shadow of the trainable parameters, moved towards them after
every optimizer step that was taken (a step skipped as non-finite is not averaged in).

Update ``n`` (counted from 0) uses the decay ``D``, or with ``--ema_warmup true`` (the default)
``min(D, (1 + n) / (10 + n))``: the shadow starts as a copy of the initial LoRA (whose B matrices are zero, so
it does nothing) and with a plain 0.999 would need thousands of steps to leave it; the warm-up lets it follow the
weights closely at first and average over more and more steps (0.1, 0.18, 0.25, ... up to D).

The shadow is saved in every checkpoint (``ema_state.safetensors``: the fp32 tensors and the update count), so a
resumed run continues it exactly, and written beside every LoRA file as ``<name>_ema.safetensors``
(``lora_ema.safetensors``, ``epoch-0_ema.safetensors``, ``step-N_ema.safetensors``) in the ``--lora_format``
layout. ``--validate_with ema|raw|both`` picks the weights validation and sample clips use: the EMA is copied
into the parameters for them and the raw weights copied back exactly afterwards.

DDP and DeepSpeed ZeRO-2 keep every parameter whole on every rank (ZeRO-2 shards gradients and optimizer state
only), so each rank reads the module's parameters after the step and holds the same shadow.

The option checks and the decay are pure (the file names are the run layout's); torch is imported inside the methods.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

from diffsynth_mbc.errors import OptionsError
from diffsynth_mbc.run_layout import EMA_STATE, ema_twin_name
from diffsynth_mbc.training.distributed.accelerator import unwrapped_model

WEIGHTS = ("raw", "ema", "both")
WARMUP_OFFSET = 10


def check_options(options: dict) -> None:
    """--validate_with ema or both needs --ema_decay (each one's range and choices are declared with the options);
    OptionsError naming the flags."""
    if options["validate_with"] != "raw" and options["ema_decay"] is None:
        raise OptionsError(f"--validate_with {options['validate_with']} needs --ema_decay (there is no EMA without it)")


def fingerprint(options) -> list | None:
    """What a resumed run must share with its checkpoint for the EMA to go on as it was."""
    return None if options.ema_decay is None else [options.ema_decay, bool(options.ema_warmup)]


def decay_at(decay: float, updates: int, warmup: bool) -> float:
    """The decay of the update after ``updates`` earlier ones."""
    if not warmup:
        return decay
    return min(decay, (1 + updates) / (WARMUP_OFFSET + updates))


def weights_for(validate_with: str, updates: int) -> list[str]:
    """Which weights to evaluate, in order; before the first update the EMA is the initial LoRA, not rendered twice."""
    if validate_with == "ema":
        return ["ema"]
    if validate_with == "both":
        return ["raw", "ema"] if updates else ["raw"]
    return ["raw"]


class LoraEma:
    """The fp32 shadow of ``module``'s trainable parameters (the unwrapped module: its parameters are the trained
    ones under DDP and DeepSpeed alike)."""

    def __init__(self, module, decay: float, warmup: bool = True):
        import torch

        self.decay, self.warmup = float(decay), bool(warmup)
        self.named = [(name, parameter) for name, parameter in module.named_parameters() if parameter.requires_grad]
        with torch.no_grad():
            self.shadow = [parameter.detach().to(torch.float32, copy=True) for _, parameter in self.named]
        self.updates = 0

    def after_step(self, skipped: bool) -> bool:
        """Move the shadow towards the weights after an optimizer step; a skipped (non-finite) step is left out."""
        import torch

        if skipped:
            return False
        weight = 1.0 - decay_at(self.decay, self.updates, self.warmup)
        with torch.no_grad():
            for average, (_, parameter) in zip(self.shadow, self.named):
                average.lerp_(parameter.detach().to(average.dtype), weight)
        self.updates += 1
        return True

    def reset(self) -> None:
        """Start again from the weights as they are (a resume from a checkpoint that holds no EMA)."""
        import torch

        with torch.no_grad():
            for average, (_, parameter) in zip(self.shadow, self.named):
                average.copy_(parameter.detach())
        self.updates = 0

    def tensors(self) -> dict:
        """Parameter name -> fp32 shadow tensor (the names of ``module.named_parameters()``)."""
        return {name: average for average, (name, _) in zip(self.shadow, self.named)}

    @contextlib.contextmanager
    def swapped_in(self):
        """The EMA in the parameters for the duration; the raw weights are copied back exactly, even on error."""
        import torch

        with torch.no_grad():
            raw = [parameter.detach().clone() for _, parameter in self.named]
            for average, (_, parameter) in zip(self.shadow, self.named):
                parameter.copy_(average)
        try:
            yield
        finally:
            with torch.no_grad():
                for saved, (_, parameter) in zip(raw, self.named):
                    parameter.copy_(saved)

    def weights(self, which: str):
        """A context with ``which`` ('raw' or 'ema') in the parameters."""
        return self.swapped_in() if which == "ema" else contextlib.nullcontext()

    # -- checkpoints ---------------------------------------------------------------------------
    def save_state(self, folder: Path) -> None:
        from diffsynth_mbc.atomic import atomic_save_safetensors

        tensors = {name: value.detach().to("cpu").contiguous() for name, value in self.tensors().items()}
        atomic_save_safetensors(Path(folder) / EMA_STATE, tensors, metadata={
            "format": "pt", "ema_updates": str(self.updates), "ema_decay": repr(self.decay),
            "ema_warmup": str(self.warmup).lower()})

    def load_state(self, folder: Path) -> bool:
        """The checkpoint's shadow and update count; False when the checkpoint holds none. A shadow that does not
        match this LoRA (other names or shapes) is refused, naming the file."""
        import torch
        from safetensors import safe_open

        path = Path(folder) / EMA_STATE
        if not path.is_file():
            return False
        with safe_open(str(path), framework="pt") as handle:
            metadata = handle.metadata() or {}
            saved = {key: handle.get_tensor(key) for key in handle.keys()}
        mine = self.tensors()
        wrong = sorted(set(saved) ^ set(mine)) or sorted(
            name for name in mine if tuple(saved[name].shape) != tuple(mine[name].shape))
        if wrong:
            raise OptionsError(f"{path}: the EMA does not match this run's LoRA (first differing tensor: {wrong[0]}); "
                               "resume with the checkpoint's LoRA settings")
        with torch.no_grad():
            for name, average in mine.items():
                average.copy_(saved[name])
        self.updates = int(metadata.get("ema_updates", "0"))
        return True


# ---------------------------------------------------------------------------------------------
# the LoRA files' EMA twins


def save_ema_lora(files, target: Path, step: int) -> None:
    """The EMA beside a LoRA file (``files``: the run's ``LoraFiles``), in the same layout; every rank calls it
    (the NaN check is collective), rank 0 writes."""
    ema_target = Path(target).with_name(ema_twin_name(Path(target).name))
    model = unwrapped_model(files.accelerator, files.module)
    tensors = {key: value.detach().to("cpu").contiguous()
               for key, value in model.lora_state_dict(files.ema.tensors()).items()}
    file_tensors = files.checked_file_tensors(tensors, ema_target, f"ranks saving {ema_target.name}")
    if files.accelerator.is_main_process:
        files.write_lora(ema_target, step, file_tensors)
