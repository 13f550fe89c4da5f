"""A LoRA or DoRA file into a ``WanTI2VLoraModule`` built for it, exactly: what ``python -m diffsynth_mbc.sample``
renders each of a run's files with, swapping one file's weights for the next without reloading the base model.

The file's pairs are read as ``--init_lora`` reads them (``init_from_file.starting_pairs``: ComfyUI's and DiffSynth's
layouts, alpha/rank folded or not, shapes checked against the module). A DoRA file's magnitudes become the DoRA
layer's magnitude vector: ComfyUI's ``dora_scale`` is ``m ||W|| / ||W + s B A||`` (``file_format``), so
``m = dora_scale ||W + s B A|| / ||W||`` with ``W`` the layer's base weight, in fp64; peft's own magnitude vector is
taken as it is. ``misfit`` says before the model loads why a file cannot be put on it (another model's layers or
shapes, metadata that disagrees with the weights), naming the file. torch is imported inside the functions.
"""

from __future__ import annotations

from diffsynth_mbc.training.lora.file_format import LoraFormatError, split_magnitudes
from diffsynth_mbc.training.lora.init_from_file import (InitLoraError, _module_order, copy_pairs, expected_shapes,
                                                        lora_parameters, starting_pairs)
from diffsynth_mbc.training.lora.read import LoraReadError, alpha_of, rank_of, read_lora


class LoraFileError(ValueError):
    """A LoRA file that cannot be rendered with, the file named."""


def lora_settings(path) -> dict:
    """What a module must be built with to hold the file at ``path``: rank, alpha, target modules and variant (the
    file's metadata; the targets and variant from its keys, the alpha from its ``.alpha`` keys, when the metadata
    has none), and the shapes of its pairs ({module: (lora_A shape, lora_B shape)}) and its ``.alpha`` values."""
    tensors, facts, read_from = _read(path)
    rest, magnitudes = split_magnitudes(tensors)
    from diffsynth_mbc.training.lora.file_format import check_pairs, lora_pairs

    try:
        pairs, alphas = lora_pairs(rest)
        check_pairs(pairs)
    except LoraFormatError as exc:
        raise LoraFileError(f"{read_from}: {exc}") from None
    targets = facts.get("lora_target_modules") or ",".join(sorted({_target_of(module) for module in pairs}))
    try:
        rank = rank_of(facts, read_from) if facts.get("lora_rank") else int(next(iter(pairs.values()))["A"].shape[0])
        alpha = alpha_of(facts, read_from)
        check_pairs(pairs, rank)
    except LoraReadError as exc:
        raise LoraFileError(str(exc)) from None
    except LoraFormatError as exc:
        raise LoraFileError(f"{read_from}: {exc}") from None
    if alpha is None and len(set(alphas.values())) == 1:   # ComfyUI's and kohya's files say it per module
        alpha = next(iter(alphas.values()))
    shapes = {module: (tuple(pair["A"].shape), tuple(pair["B"].shape)) for module, pair in pairs.items()}
    return {"rank": rank, "alpha": alpha, "targets": targets, "variant": "dora" if magnitudes else "lora",
            "file": str(read_from), "shapes": shapes, "alphas": alphas}


def misfit(settings: dict, layers: dict[str, tuple[int, int] | None], model: str) -> str | None:
    """Why a file's LoRA (``lora_settings``) cannot be put on the model whose modules are ``layers`` ({name: (in,
    out) of a linear layer, None for any other module}), the file named; None when it fits. Checked before the model
    loads (the module's shapes come from the model's config)."""
    file, shapes = settings["file"], settings["shapes"]
    foreign = sorted((module for module in shapes if not layers.get(module)), key=_module_order)
    if foreign:
        more = f" and {len(foreign) - 1} more" if len(foreign) > 1 else ""
        return f"{file}: it has LoRA weights for {foreign[0]}{more}, which {model} has no linear layer for: it is " \
               "a LoRA for another model"
    for module in sorted(shapes, key=_module_order):
        (rank, width), (height, _) = shapes[module]
        width_in, width_out = layers[module]
        if (width, height) != (width_in, width_out):
            return (f"{file}: {module}: lora_A {shapes[module][0]}, lora_B {shapes[module][1]}, but {model}'s layer "
                    f"there takes {width_in} and gives {width_out} (lora_A ({rank}, {width_in}), lora_B ({width_out}, "
                    f"{rank})): it is a LoRA for another model")
    targets = [name for name in settings["targets"].split(",") if name]
    covered = {name for name in layers if any(name == target or name.endswith("." + target) for target in targets)}
    if covered != set(shapes):
        odd = sorted(covered ^ set(shapes), key=_module_order)[0]
        said = "has no weights for" if odd in covered else "has weights for"
        return (f"{file}: its lora_target_modules ({settings['targets']}) and its weights disagree: it {said} "
                f"{odd}{'' if layers.get(odd) else ', not a linear layer of ' + model}")
    stated = sorted(set(settings["alphas"].values()))
    if len(stated) > 1 or (stated and settings["alpha"] is not None and stated[0] != settings["alpha"]):
        return (f"{file}: its alphas disagree (metadata lora_alpha {settings['alpha']}, .alpha keys "
                f"{', '.join(f'{value:g}' for value in stated)}): it cannot say at which strength it renders")
    return None


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
