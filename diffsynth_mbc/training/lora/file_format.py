"""LoRA file layouts: what training holds, and files that DiffSynth and ComfyUI load at the trained strength.

Training holds PEFT's tensors, e.g. ``blocks.0.self_attn.q.lora_A.default.weight`` (or with the
``pipe.dit.`` prefix inside an accelerate checkpoint), and applies ``(alpha / rank) * B @ A``.
Neither consumer applies that scale the way training does:

- DiffSynth 1.1.8's ``GeneralLoRALoader`` reads ``lora_A``/``lora_B`` pairs, drops a leading
  ``diffusion_model.`` and ``.default``-style segments, ignores ``.alpha`` keys and merges ``B @ A``
  at scale 1;
- ComfyUI maps ``diffusion_model.<module>`` to the DiT's ``<module>.weight`` and takes
  ``<x>.lora_B.weight`` / ``<x>.lora_A.weight`` (or ``lora_up``/``lora_down``), scaling by
  ``<x>.alpha / rank`` only when an ``.alpha`` key exists, else by 1; releases before 2025 do not
  know the ``.default`` segment and report "lora key not loaded".

So the files we write fold ``alpha / rank`` into ``lora_B`` and carry no ``.alpha`` keys: both loaders
then apply exactly what training applied.

DoRA (``--lora_variant dora``) trains ``W' = m * (W + s B A) / ||W + s B A||_row`` with a magnitude ``m`` per
output row (peft's ``<module>.lora_magnitude_vector.default.weight``, shape ``(out,)``). ComfyUI reads a
magnitude as ``<x>.dora_scale``; one of shape ``(out, 1)`` it applies on the output axis, dividing by the row
norms of the *base* weight: ``(W + B A) * dora_scale / ||W||_row``. So the file's ``dora_scale`` is
``m * ||W||_row / ||W + s B A||_row``, computed where the base weights are (``dora_ratios``: module -> the
ratio of the two norms), and ComfyUI then rebuilds exactly the trained weight. DiffSynth's loader reads no
magnitude (it loads a DoRA file as a plain LoRA, wrong, without an error), so DoRA files are written in the ``comfyui``
layout only; for DiffSynth, ``export --format merged`` writes the DiT's weights with the DoRA merged in
(``lora_merge``).

``comfyui`` layout: ``diffusion_model.<module>.lora_A.weight``; ``diffsynth`` layout:
``<module>.lora_A.weight``. Both load in DiffSynth (plain LoRA; a DoRA's ``dora_scale`` is ignored there). No torch
import: tensors are only multiplied.
"""

from __future__ import annotations

import re

from diffsynth_mbc.training.components.guards import NonFiniteError
from diffsynth_mbc.values import positive_number

FORMATS = ("comfyui", "diffsynth")
COMFYUI_PREFIX = "diffusion_model."
_PREFIXES = ("pipe.dit.", "module.pipe.dit.", COMFYUI_PREFIX, "dit.")
_LORA_KEY = re.compile(r"^(?P<module>.+)\.(?P<part>lora_A|lora_B|lora_down|lora_up)(?:\.[A-Za-z_]\w*)?\.weight$")
_ALPHA_KEY = re.compile(r"^(?P<module>.+)\.alpha$")
_MAGNITUDE_KEY = re.compile(r"^(?P<module>.+)\.(?:(?P<peft>lora_magnitude_vector)(?:\.[A-Za-z_]\w*)?\.weight"
                            r"|dora_scale)$")


class LoraFormatError(ValueError):
    """A file or tensor set that is not a LoRA we can convert; the message names the key."""


class NonFiniteLoraError(NonFiniteError):
    """A LoRA about to be written holds NaN or infinite values; the message names the tensors."""


def nonfinite_tensors(tensors: dict) -> list[str]:
    """``name (N NaN, M inf of T)`` for every tensor holding a NaN or infinite value, in key order."""
    found = []
    for name in sorted(tensors):
        tensor = tensors[name]
        if bool(tensor.isfinite().all()):
            continue
        nan = int(tensor.isnan().sum())
        found.append(f"{name} ({nan} NaN, {int((~tensor.isfinite()).sum()) - nan} inf of {tensor.numel()})")
    return found


def describe_nonfinite(found: list[str], total: int, shown: int = 5) -> str:
    """``3 of 40 tensors hold NaN or infinite values: a (...), b (...), ...``."""
    more = f", and {len(found) - shown} more" if len(found) > shown else ""
    return f"{len(found)} of {total} LoRA tensors hold NaN or infinite values: {', '.join(found[:shown])}{more}"


def _without_prefix(key: str) -> str:
    """A key relative to the DiT: the first of the known wrapper prefixes it starts with removed."""
    for prefix in _PREFIXES:
        if key.startswith(prefix):
            return key[len(prefix):]
    return key


def split_lora_key(key: str) -> tuple[str, str]:
    """(DiT module name, 'A' or 'B') of one LoRA tensor key in any of the layouts above."""
    key = _without_prefix(key)
    match = _LORA_KEY.match(key)
    if not match:
        raise LoraFormatError(f"not a LoRA weight key: {key!r}")
    part = match.group("part")
    return match.group("module"), "A" if part in ("lora_A", "lora_down") else "B"


def _alpha_value(key: str, value) -> float:
    """A per-module ``.alpha``: one finite number above 0."""
    shown = value.tolist() if hasattr(value, "tolist") else value
    number = positive_number(value, text=True)
    if number is None:
        raise LoraFormatError(f"{key}: an alpha must be one finite number above 0, got {shown!r}")
    return number


def lora_pairs(tensors: dict) -> tuple[dict[str, dict], dict[str, float]]:
    """{module: {"A": tensor, "B": tensor}} and any per-module ``.alpha`` values found."""
    pairs: dict[str, dict] = {}
    alphas: dict[str, float] = {}
    for key, tensor in tensors.items():
        alpha = _ALPHA_KEY.match(key)
        if alpha:
            module = _without_prefix(alpha.group("module"))
            alphas[module] = _alpha_value(key, tensor)
            continue
        module, part = split_lora_key(key)
        if part in pairs.setdefault(module, {}):
            raise LoraFormatError(f"two lora_{part} tensors for module {module!r} (key {key!r})")
        pairs[module][part] = tensor
    for module in sorted(set(alphas) - set(pairs)):
        raise LoraFormatError(f"{module}.alpha has no lora_A/lora_B pair")
    for module, pair in pairs.items():
        if set(pair) != {"A", "B"}:
            raise LoraFormatError(f"module {module!r} has lora_{''.join(pair)} but not both lora_A and lora_B")
    return pairs, alphas


def check_pairs(pairs: dict[str, dict], rank: int | None = None) -> None:
    """Every pair is two floating-point matrices of one rank, ``rank`` when given; LoraFormatError naming the module
    (and the dtype) if not."""
    if not pairs:
        raise LoraFormatError("no LoRA tensors (lora_A/lora_B pairs) in it")
    for module in sorted(pairs):
        down, up = pairs[module]["A"], pairs[module]["B"]
        for part, tensor in (("lora_A", down), ("lora_B", up)):
            if not tensor.is_floating_point():   # int8 weights would start a run (or load) as rounded integers
                raise LoraFormatError(f"module {module!r}: {part} holds {str(tensor.dtype).replace('torch.', '')} "
                                      "values; a LoRA's weights are floating point (float32, bfloat16, float16), "
                                      "and these would be read as whole numbers (most of them 0)")
        shapes = f"lora_A {tuple(down.shape)}, lora_B {tuple(up.shape)}"
        if len(down.shape) != 2 or len(up.shape) != 2:
            raise LoraFormatError(f"module {module!r}: {shapes}; both must be matrices")
        if down.shape[0] != up.shape[1]:
            raise LoraFormatError(f"module {module!r}: {shapes}: lora_A is of rank {down.shape[0]} but lora_B of "
                                  f"rank {up.shape[1]}")
        if rank is not None and down.shape[0] != rank:
            raise LoraFormatError(f"module {module!r}: {shapes}: rank {down.shape[0]}, but the file says lora_rank "
                                  f"{rank}")


def split_magnitudes(tensors: dict) -> tuple[dict, dict[str, tuple]]:
    """(the other tensors, {module: (magnitude, "peft" or "dora_scale")}): DoRA's magnitudes set apart."""
    rest, magnitudes = {}, {}
    for key, tensor in tensors.items():
        match = _MAGNITUDE_KEY.match(_without_prefix(key))
        if not match:
            rest[key] = tensor
            continue
        module = match.group("module")
        if module in magnitudes:
            raise LoraFormatError(f"two DoRA magnitudes for module {module!r} (key {key!r})")
        magnitudes[module] = (tensor, "peft" if match.group("peft") else "dora_scale")
    return rest, magnitudes


def _dora_scales(magnitudes: dict, pairs: dict, target: str, factors: dict, dora_ratios: dict | None) -> dict:
    """{module: ComfyUI's ``dora_scale`` (out, 1)} for every DoRA magnitude; LoraFormatError when it cannot be made."""
    if magnitudes and target != "comfyui":
        raise LoraFormatError(f"a DoRA LoRA ({len(magnitudes)} magnitudes, e.g. {min(magnitudes)}) cannot be written "
                              f"in the {target} layout: DiffSynth's LoRA loader reads no DoRA magnitude and would load "
                              "it wrong, without an error; for DiffSynth, export with --format merged --model_dir "
                              "MODEL_DIR (the DiT's weights with the DoRA merged in), for ComfyUI the comfyui layout")
    scales = {}
    for module in sorted(magnitudes):
        magnitude, kind = magnitudes[module]
        if module not in pairs:
            raise LoraFormatError(f"{module}: a DoRA magnitude without its lora_A/lora_B pair")
        out_features = pairs[module]["B"].shape[0]
        if magnitude.numel() != out_features:
            raise LoraFormatError(f"{module}: DoRA magnitude of {magnitude.numel()} values for a layer of "
                                  f"{out_features} outputs")
        if kind == "dora_scale":
            if factors[module] != 1.0:
                raise LoraFormatError(f"{module}.dora_scale: a DoRA file must already have its scale folded in "
                                      "(written by this trainer); its lora_B cannot be rescaled")
            scales[module] = magnitude.reshape(out_features, 1)
            continue
        if not dora_ratios or module not in dora_ratios:
            raise LoraFormatError(f"{module}: a DoRA magnitude (lora_magnitude_vector) becomes ComfyUI's dora_scale "
                                  "only with the base model's weights at hand; export the run's own LoRA file or "
                                  "checkpoint folder, which hold it converted")
        ratio = dora_ratios[module].to(magnitude.dtype).reshape(out_features)
        scales[module] = (magnitude.reshape(out_features) * ratio).reshape(out_features, 1)
    return scales


def convert(tensors: dict, target: str, scale: float = 1.0, dora_ratios: dict | None = None) -> dict:
    """Tensors in the ``target`` layout, with ``scale`` (alpha / rank, when not yet applied) folded into B.

    Per-module ``.alpha`` keys in the input are folded as well (alpha / that module's rank). DoRA magnitudes
    become ComfyUI's ``dora_scale`` (see the module's docstring; ``dora_ratios`` from
    ``lora_variants.dora_norm_ratios``); a file's own ``dora_scale`` is kept as it is.
    """
    if target not in FORMATS:
        raise LoraFormatError(f"unknown LoRA format {target!r}; choose one of {', '.join(FORMATS)}")
    tensors, magnitudes = split_magnitudes(tensors)
    pairs, alphas = lora_pairs(tensors)
    prefix = COMFYUI_PREFIX if target == "comfyui" else ""
    factors = {module: scale * (alphas[module] / pairs[module]["A"].shape[0] if module in alphas else 1.0)
               for module in pairs}
    dora_scales = _dora_scales(magnitudes, pairs, target, factors, dora_ratios)
    out = {}
    for module in sorted(pairs):
        down, up = pairs[module]["A"], pairs[module]["B"]
        factor = factors[module]
        out[f"{prefix}{module}.lora_A.weight"] = down.contiguous()
        out[f"{prefix}{module}.lora_B.weight"] = (up * factor).contiguous() if factor != 1.0 else up.contiguous()
        if module in dora_scales:
            out[f"{prefix}{module}.dora_scale"] = dora_scales[module].contiguous()
    return out


def training_scale(rank: int, alpha: float | None) -> float:
    """The scale PEFT applies during training: alpha / rank (alpha defaults to the rank)."""
    return float(alpha if alpha is not None else rank) / float(rank)


def file_metadata(*, rank: int, alpha: float | None, targets: str, base_model: str, step: int | None,
                  run_id: str | None, layout: str, variant: str = "lora") -> dict:
    """safetensors metadata (strings only) saying what the file is and that the scale is already folded in."""
    return {"format": "pt", "lora_layout": layout, "lora_scale_folded": "true", "lora_rank": str(rank),
            "lora_alpha": str(alpha if alpha is not None else rank), "lora_target_modules": targets,
            "base_model": base_model, "step": "" if step is None else str(step), "run_id": run_id or "",
            "lora_variant": variant}


KOHYA_PREFIX = "ss_"            # the training facts kohya's sd-scripts write, which LoRA browsers and UIs read
OWN_TRAINING_KEYS = ("recipe", "plan")   # the project's own, as JSON
PLAN_FACTS = ("rows", "images", "repeat", "world_size", "batch_size", "image_batch_size", "gradient_accumulation",
              "effective_batch", "samples_per_epoch", "batches_per_epoch", "steps_per_epoch", "num_epochs",
              "total_steps")


def training_metadata(options, plan: dict | None, step: int | None) -> dict:
    """What trained a LoRA file, so that a file found later is judged without its run folder (strings only):
    kohya-style ``ss_*`` keys (rank and alpha, targets, learning rate and schedule, epochs and steps, the samples
    of an epoch, the final resolution, buckets, seed) beside the project's own ``recipe`` (``recipe_of``: what
    each sample trains, the LoRA, the schedule, the catalogues) and ``plan`` (rows, repeats, GPUs, batches, steps
    per epoch and in all, each --resolution_stages stage's size and steps), JSON. ``plan``: the step plan as the
    status file holds it (``StepPlan.as_dict``); None leaves its figures out."""
    import json
    import math

    from diffsynth_mbc.training.reporting.recipe import recipe_of

    plan = plan or {}
    per_epoch, total = plan.get("steps_per_epoch"), plan.get("total_steps")
    alpha = options.lora_rank if options.lora_alpha is None else options.lora_alpha
    kohya = {
        "network_module": f"diffsynth_mbc.{options.lora_variant}", "network_dim": options.lora_rank,
        "network_alpha": alpha, "network_args": json.dumps({"target_modules": options.lora_target_modules.text,
                                                            "variant": options.lora_variant}),
        "learning_rate": options.learning_rate, "lr_scheduler": options.lr_scheduler,
        "lr_warmup_steps": options.warmup_steps, "num_epochs": options.num_epochs,
        "epoch": math.ceil(step / per_epoch) if step is not None and per_epoch else None,   # from 1; 0: none yet
        "steps": step, "max_train_steps": total, "num_train_images": plan.get("samples_per_epoch"),
        "num_batches_per_epoch": plan.get("batches_per_epoch"), "batch_size_per_device": options.batch_size,
        "gradient_accumulation_steps": options.gradient_accumulation_steps,
        "total_batch_size": plan.get("effective_batch"), "resolution": f"({options.width}, {options.height})",
        "num_frames": options.num_frames, "enable_bucket": options.buckets == "aspect", "seed": options.seed,
        "mixed_precision": options.mixed_precision, "max_grad_norm": options.max_grad_norm,
        "caption_dropout_rate": options.caption_dropout,
    }
    facts = {key: plan[key] for key in PLAN_FACTS if key in plan}
    facts["size"] = f"{options.width}x{options.height}x{options.num_frames}"
    if plan.get("stages"):
        facts["stages"] = [{key: row.get(key) for key in ("size", "from_step", "to_step")} for row in plan["stages"]]
    if plan.get("datasets"):
        facts["datasets"] = [{key: row.get(key) for key in ("name", "rows", "repeat")} for row in plan["datasets"]]
    return {**{KOHYA_PREFIX + key: str(value) for key, value in kohya.items() if value is not None},
            "recipe": json.dumps(recipe_of(options)), "plan": json.dumps(facts)}


def training_keys(metadata: dict, lora: bool = True) -> dict:
    """The training facts of a file's metadata (``training_metadata``), to carry into a file made from it: all of
    them for a LoRA layout, the project's own for a merged file (it is no LoRA network: no ``ss_network_*``)."""
    return {key: value for key, value in metadata.items()
            if key in OWN_TRAINING_KEYS or (lora and key.startswith(KOHYA_PREFIX))}
