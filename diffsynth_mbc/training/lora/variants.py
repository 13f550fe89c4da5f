"""DoRA (``--lora_variant dora``) and LoRA+ (``--loraplus_lr_ratio R``): how the adapter is built and how its
optimizer groups are made. Both default to off, and then nothing here changes what a run does.

DoRA (peft's ``use_dora``) gives every targeted Linear a trainable magnitude per output row beside the low-rank
direction: ``W' = m * (W + s B A) / ||W + s B A||_row``. peft sets ``m`` from the base weight in the base
dtype (bf16 on a GPU) while its forward divides by a norm taken in the LoRA weights' dtype (fp32 here): the two
differ in the last bf16 digit, so the untrained DoRA would not be the base model. ``add_dora`` sets ``m`` again
from the fp32 norm, so at step 0 the model is the base model, as plain LoRA's zero ``B`` makes it.

LoRA+ puts the ``lora_B`` matrices in a second optimizer group at ``R`` times the learning rate; the scheduler
scales both groups by the same factor. Without it the optimizer gets one plain list of parameters, as before.
torch is imported inside the functions that need it.
"""

from __future__ import annotations

from diffsynth_mbc.errors import OptionsError

B_GROUP = "lora_B"          # the ``lora_part`` of LoRA+'s fast group (kept in the optimizer's saved state)


def add_dora(model, target_modules: list[str], lora_rank: int, lora_alpha: float | None, upcast_dtype=None):
    """peft's DoRA adapter injected into ``model`` (as DiffSynth injects LoRA), trainable weights in
    ``upcast_dtype``, magnitudes set from the fp32 row norms of the base weights."""
    import torch
    from peft import LoraConfig, inject_adapter_in_model
    from peft.tuners.lora.layer import Linear as LoraLinear

    config = LoraConfig(r=lora_rank, lora_alpha=lora_rank if lora_alpha is None else lora_alpha,
                        target_modules=target_modules, use_dora=True)
    model = inject_adapter_in_model(config, model)
    if upcast_dtype is not None:
        for parameter in model.parameters():
            if parameter.requires_grad:
                parameter.data = parameter.to(upcast_dtype)
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, LoraLinear):
                for name, magnitude in module.lora_magnitude_vector.items():
                    weight = module.get_base_layer().weight
                    magnitude.weight.copy_(torch.linalg.norm(weight.to(magnitude.weight.dtype), dim=1))
    return model


def optimizer_groups(named_parameters, learning_rate: float, ratio: float | None):
    """What AdamW is given: the trainable parameters as one list, or with LoRA+ two groups (``lora_B`` at
    ``learning_rate * ratio``, the rest at ``learning_rate``), each saying which it is."""
    named = [(name, parameter) for name, parameter in named_parameters if parameter.requires_grad]
    if ratio is None:
        return [parameter for _, parameter in named]
    fast = [parameter for name, parameter in named if ".lora_B." in name]
    if not fast:
        raise OptionsError("--loraplus_lr_ratio: the model has no lora_B weights to give the faster learning rate")
    rest = [parameter for name, parameter in named if ".lora_B." not in name]
    return [{"params": rest, "lr": learning_rate, "lora_part": "rest"},
            {"params": fast, "lr": learning_rate * ratio, "lora_part": B_GROUP}]


def group_lr_ratio(group: dict, options) -> float:
    """The factor on --learning_rate this run gives an optimizer group (LoRA+'s ratio for its lora_B group)."""
    ratio = options.loraplus_lr_ratio
    return float(ratio) if ratio is not None and group.get("lora_part") == B_GROUP else 1.0


def check_adapter_shape(saved: dict, current: dict) -> None:
    """Settings whose change makes a checkpoint unloadable (other trainable tensors, other optimizer groups):
    refused even under --force_resume, naming the flag. ``saved``/``current``: checkpoint fingerprints."""
    for key, why in (("lora_variant", "DoRA trains a magnitude per row that plain LoRA has not"),
                     ("loraplus_lr_ratio", "LoRA+ keeps lora_B in an optimizer group of its own")):
        if key not in saved:
            continue
        before, now = saved.get(key), current.get(key)
        if key == "loraplus_lr_ratio":
            before, now = before is not None, now is not None
        if before != now:
            raise OptionsError(f"--{key}: the checkpoint was trained with {saved.get(key)!r}, this run asks for "
                               f"{current.get(key)!r}; {why}, so its saved state cannot be resumed that way, not "
                               "even with --force_resume. Resume with the checkpoint's value (LoRA+ ratios may "
                               "differ under --force_resume), or start a new run")


def dora_norm_ratios(dit) -> dict | None:
    """{module: ||W||_row / ||W + s B A||_row} (fp32, on the CPU) for every DoRA layer of ``dit``, what a file's
    ComfyUI ``dora_scale`` needs (see lora_format); None without DoRA layers. Computed where the weights are,
    one layer at a time, the norms as the DoRA forward takes them (in the LoRA weights' dtype)."""
    import torch
    from peft.tuners.lora.layer import Linear as LoraLinear

    ratios = {}
    with torch.no_grad():
        for name, module in dit.named_modules():
            if not isinstance(module, LoraLinear) or not module.lora_magnitude_vector:
                continue
            for adapter in module.lora_magnitude_vector:
                down, up = module.lora_A[adapter].weight, module.lora_B[adapter].weight
                weight = module.get_base_layer().weight.to(down.dtype)
                merged = weight + module.scaling[adapter] * (up @ down)
                ratio = torch.linalg.norm(weight, dim=1) / torch.linalg.norm(merged, dim=1)
                ratios[name] = ratio.float().cpu()
    return ratios or None
