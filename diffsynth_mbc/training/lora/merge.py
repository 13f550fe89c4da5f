"""The DiT's weights with a LoRA or DoRA merged in: what ``python -m diffsynth_mbc.export --format merged`` writes.

DiffSynth 1.1.8's ``pipe.load_lora`` (``GeneralLoRALoader``) reads ``lora_A``/``lora_B`` pairs only: a DoRA file's
``dora_scale`` tensors are skipped without a word, so the DoRA loads as a plain LoRA, wrong (a third or more of the
change it makes to the DiT's output is missing or different, measured on the demo). What every loader reads is the
weights themselves: for each module the LoRA touches, the base weight ``W`` (from the release's DiT shards, or the
demo's seeded model) becomes

    plain LoRA:              W + B A                                 (alpha/rank folded into B)
    DoRA, ComfyUI's file:    (W + B A) * dora_scale / ||W||_row       (ComfyUI's rule; the file's dora_scale is
                                                                     m ||W|| / ||W + s B A||, see lora_format)
    DoRA, peft's magnitude:  m * (W + s B A) / ||W + s B A||_row      (what the DoRA layer computes)

computed in fp32 and stored in the base weight's dtype, keyed as DiffSynth's DiT names its weights
(``blocks.0.self_attn.q.weight``), so ``pipe.dit.load_state_dict(load_file(path), strict=False)`` loads it. Biases and
untouched modules are left out: they do not change.
"""

from __future__ import annotations

import glob
from pathlib import Path

from diffsynth_mbc.models.model_files import DIT_PATTERN, ModelFileError
from diffsynth_mbc.training.lora.file_format import LoraFormatError, convert, lora_pairs, split_magnitudes


def base_weights(modules, *, model_dir: str | Path | None = None, demo_seed: int | None = None) -> dict:
    """{module: its base ``weight``} for ``modules``, read from ``model_dir``'s DiT shards (only those tensors), or
    from the demo's tiny model built with ``demo_seed``. ModelFileError naming the folder, the shard or the key."""
    keys = {module: f"{module}.weight" for module in modules}
    if model_dir is None:
        from diffsynth_mbc.models.pipeline import build_demo_pipeline

        state = build_demo_pipeline(load_encoders=False, seed=demo_seed or 0).dit.state_dict()
        missing = [key for key in keys.values() if key not in state]
        if missing:
            raise ModelFileError(f"the demo's DiT (seed {demo_seed}) has no {missing[0]}: this LoRA is not for it")
        return {module: state[key] for module, key in keys.items()}
    return _weights_from_shards(Path(model_dir), keys)


def _weights_from_shards(model_dir: Path, keys: dict) -> dict:
    from safetensors import SafetensorError, safe_open

    if not model_dir.is_dir():
        raise ModelFileError(f"--model_dir {model_dir}: no such folder")
    shards = sorted(glob.glob(str(model_dir / DIT_PATTERN)))
    if not shards:
        raise ModelFileError(f"--model_dir {model_dir}: no DiT weights ({DIT_PATTERN}) in it")
    found, wanted = {}, {key: module for module, key in keys.items()}
    for shard in shards:
        try:
            with safe_open(shard, framework="pt") as handle:
                for key in set(handle.keys()) & set(wanted):
                    found[wanted[key]] = handle.get_tensor(key)
        except (SafetensorError, OSError) as exc:
            raise ModelFileError(f"{shard}: not a readable safetensors file ({exc}); re-download it") from None
    missing = sorted(key for key, module in wanted.items() if module not in found)
    if missing:
        raise ModelFileError(f"--model_dir {model_dir}: its DiT weights have no {missing[0]} ({len(missing)} of the "
                             f"LoRA's {len(keys)} modules missing): this LoRA is not for the model there")
    return found


def _magnitude(magnitudes: dict, module: str, out_features: int):
    magnitude, kind = magnitudes[module]
    if magnitude.numel() != out_features:
        raise LoraFormatError(f"{module}: DoRA magnitude of {magnitude.numel()} values for a layer of "
                              f"{out_features} outputs")
    if not magnitude.is_floating_point():
        raise LoraFormatError(f"{module}: its DoRA magnitude holds {magnitude.dtype} values, not floating point")
    return magnitude.float().reshape(out_features, 1), kind


def merged_weights(tensors: dict, scale: float, base: dict) -> dict:
    """{``<module>.weight``: the merged weight} for every module of the LoRA ``tensors`` (any layout ``lora_format``
    reads; ``scale``: alpha/rank when not yet folded into B), ``base`` holding each module's base weight."""
    rest, magnitudes = split_magnitudes(tensors)
    pairs, _ = lora_pairs(convert(rest, "diffsynth", scale=scale))   # B with every alpha folded in
    for module in sorted(set(magnitudes) - set(pairs)):
        raise LoraFormatError(f"{module}: a DoRA magnitude without its lora_A/lora_B pair")
    merged = {}
    for module in sorted(pairs):
        down, up = pairs[module]["A"].float(), pairs[module]["B"].float()
        weight = base[module]
        if tuple(weight.shape) != (up.shape[0], down.shape[1]):
            raise LoraFormatError(f"{module}: the LoRA changes a ({up.shape[0]}, {down.shape[1]}) weight, the base "
                                  f"model's is {tuple(weight.shape)}: the LoRA is for another model")
        original = weight.float()
        value = original + up @ down
        if module in magnitudes:
            magnitude, kind = _magnitude(magnitudes, module, up.shape[0])
            rows = original if kind == "dora_scale" else value   # ComfyUI's rule divides by the base's row norms
            value = value * (magnitude / rows.norm(dim=1, keepdim=True))
        merged[f"{module}.weight"] = value.to(weight.dtype).contiguous()
    return merged
