"""A LoRA or DoRA file into a ``WanTI2VLoraModule`` built for it, exactly: what ``python -m diffsynth_mbc.sample``
renders each of a run's files with, swapping one file's weights for the next without reloading the base model.

The file's pairs are read as ``--init_lora`` reads them (``init_from_file.starting_pairs``: ComfyUI's and DiffSynth's
layouts, alpha/rank folded or not, shapes checked against the module). A DoRA file's magnitudes become the DoRA
layer's magnitude vector: ComfyUI's ``dora_scale`` is ``m ||W|| / ||W + s B A||`` (``file_format``), so
``m = dora_scale ||W + s B A|| / ||W||`` with ``W`` the layer's base weight, in fp64; peft's own magnitude vector is
taken as it is. torch is imported inside the functions.
"""

from __future__ import annotations

from diffsynth_mbc.training.lora.file_format import LoraFormatError, split_magnitudes
from diffsynth_mbc.training.lora.init_from_file import (InitLoraError, copy_pairs, expected_shapes, lora_parameters,
                                                        starting_pairs)
from diffsynth_mbc.training.lora.read import LoraReadError, alpha_of, rank_of, read_lora


class LoraFileError(ValueError):
    """A LoRA file that cannot be rendered with, the file named."""


def lora_settings(path) -> dict:
    """What a module must be built with to hold the file at ``path``: rank, alpha, target modules and variant (the
    file's metadata; the targets and variant from its keys when the metadata has none)."""
    tensors, facts, read_from = _read(path)
    rest, magnitudes = split_magnitudes(tensors)
    from diffsynth_mbc.training.lora.file_format import lora_pairs

    try:
        pairs, _ = lora_pairs(rest)
    except LoraFormatError as exc:
        raise LoraFileError(f"{read_from}: {exc}") from None
    targets = facts.get("lora_target_modules") or ",".join(sorted({_target_of(module) for module in pairs}))
    try:
        rank = rank_of(facts, read_from) if facts.get("lora_rank") else int(next(iter(pairs.values()))["A"].shape[0])
        alpha = alpha_of(facts, read_from)
    except LoraReadError as exc:
        raise LoraFileError(str(exc)) from None
    return {"rank": rank, "alpha": alpha, "targets": targets, "variant": "dora" if magnitudes else "lora",
            "file": str(read_from)}


def _target_of(module: str) -> str:
    """The ``--lora_target_modules`` name of a module: ``blocks.0.self_attn.q`` -> ``q``, ``blocks.3.ffn.0`` ->
    ``ffn.0``."""
    parts = module.split(".")
    return ".".join(parts[-2:]) if len(parts) > 1 and parts[-1].isdigit() else parts[-1]


def load_lora_file(module, path) -> dict:
    """Set every LoRA (and DoRA magnitude) parameter of ``module``'s DiT from the file at ``path``."""
    import torch

    tensors, facts, read_from = _read(path)
    rest, magnitudes = split_magnitudes(tensors)
    dit = module.pipe.dit
    config = dit.peft_config["default"]
    named = lora_parameters(dit)
    try:
        start, found = starting_pairs(rest, facts, expected=expected_shapes(named.items()), rank=int(config.r),
                                      alpha=float(config.lora_alpha), targets=",".join(sorted(config.target_modules)),
                                      source=str(read_from))
    except InitLoraError as exc:
        raise LoraFileError(str(exc).replace("--init_lora ", "", 1)) from None
    copy_pairs(named, start)
    layers = {name: layer for name, layer in dit.named_modules() if hasattr(layer, "lora_magnitude_vector")}
    with torch.no_grad():
        for module_name, (magnitude, kind) in magnitudes.items():
            layer = layers.get(module_name)
            if layer is None or "default" not in layer.lora_magnitude_vector:
                raise LoraFileError(f"{read_from}: {module_name} has a DoRA magnitude, but the model built for it has "
                                    "no DoRA layer there")
            vector = layer.lora_magnitude_vector["default"].weight
            value = magnitude.reshape(-1).to(torch.float64)
            if kind == "dora_scale":
                value = value * _norm_ratio(layer)
            vector.copy_(value.to(device=vector.device, dtype=vector.dtype))
    return {"file": str(read_from), **found, "dora": bool(magnitudes)}


def _norm_ratio(layer):
    """``||W + s B A||_row / ||W||_row`` of a DoRA layer as its parameters now hold it, in fp64."""
    import torch

    base = layer.get_base_layer().weight.to(torch.float64)
    delta = (layer.lora_B["default"].weight.to(torch.float64) @ layer.lora_A["default"].weight.to(torch.float64)
             ) * layer.scaling["default"]
    return torch.linalg.vector_norm(base + delta, dim=1) / torch.linalg.vector_norm(base, dim=1)


def _read(path):
    try:
        return read_lora(path)
    except LoraReadError as exc:
        raise LoraFileError(str(exc)) from None
