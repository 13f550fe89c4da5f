"""``--init_lora FILE``: a new run whose LoRA starts from a file's weights, with a fresh optimizer at step 0.

Not a resume: ``--resume`` goes on with a run (its weights, optimizer moments, schedule, step and data position);
``--init_lora`` starts another run from a LoRA, e.g. one trained earlier on other data, one exported for ComfyUI,
or one DiffSynth's own trainer wrote. The two are refused together.

The file may hold any layout ``lora_format`` reads: ours (``diffusion_model.<module>`` or ``<module>`` keys with
alpha/rank folded into ``lora_B``; older files and checkpoints' raw PEFT tensors with ``lora_rank``/``lora_alpha``
metadata), ComfyUI's (``lora_up``/``lora_down`` or ``lora_B``/``lora_A``, with or without per-module ``.alpha``)
and DiffSynth's (``<module>.lora_A.default.weight``, applied at scale 1 by its loader). The run starts from the
change the file makes to the DiT when loaded: ``scale_file * B @ A``, where ``scale_file`` is 1 for a folded
file or one without an alpha, ``alpha / rank`` for ``.alpha`` keys or raw tensors with ``lora_alpha`` metadata.
Training applies ``(lora_alpha / lora_rank) * B @ A``, so ``B`` is set to ``B_file * scale_file / scale_run``.

A file whose rank, stated alpha or modules differ from this run's is refused, naming the first keys and the
flag to change. The checks (``starting_pairs``) import no torch; ``load_init_lora`` copies into the module.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

from diffsynth_mbc.errors import OptionsError
from diffsynth_mbc.run_layout import BEST_LORA, LORA_FILE
from diffsynth_mbc.training.lora.file_format import (COMFYUI_PREFIX, LoraFormatError, check_pairs, describe_nonfinite,
                                                     lora_pairs, nonfinite_tensors, split_lora_key, training_scale)

FLAG = "--init_lora"
SHOWN = 3   # module names quoted in an error


class InitLoraError(OptionsError):
    """A LoRA that cannot start this run; the message names the file, the first keys and the flag to change."""


# Keys of a DoRA file: ComfyUI's dora_scale, peft's magnitude vector.
DORA_KEY_ENDINGS = (".dora_scale", ".lora_magnitude_vector.default.weight", ".lora_magnitude_vector.weight")


def _replaced_by_the_run(name: str) -> bool:
    """A file the run writes into --output_path (``lora``, ``epoch-N`` or ``step-N``; not ``lora-best``, not an EMA
    twin): an --init_lora file of that name there would be replaced by this run's own."""
    found = LORA_FILE.match(name)
    return bool(found) and not found["ema"] and name != BEST_LORA


def check_init_lora_option(options: dict) -> None:
    """Pure checks of ``--init_lora`` among the options (called by ``options.validate``)."""
    source = options.get("init_lora")
    if source in (None, ""):
        return
    if options.get("resume"):   # a resume continues its checkpoint: the file is not read (said at start)
        return
    path = Path(str(source))
    if not path.exists():
        raise InitLoraError(f"{FLAG} {source}: no such file (give a LoRA .safetensors file or a checkpoint folder)")
    output = Path(str(options.get("output_path") or "."))
    if path.is_file() and _replaced_by_the_run(path.name) and path.resolve().parent == output.resolve():
        raise InitLoraError(f"{FLAG} {source} is in --output_path {output}, where this run writes its own "
                            f"{path.name}; copy it elsewhere or choose another --output_path")


def describe_layout(tensors: dict, facts: dict) -> str:
    """Which layout the file holds, in words (for the status and the log line)."""
    keys = sorted(tensors)
    folded = str(facts.get("lora_scale_folded", "")).lower() == "true"
    if folded:
        where = "ComfyUI keys" if keys and keys[0].startswith(COMFYUI_PREFIX) else "DiffSynth keys"
        return f"this trainer's file ({where}, alpha/rank folded in)"
    if any(key.startswith(("pipe.dit.", "module.pipe.dit.")) for key in keys):
        return "a training checkpoint's raw tensors"
    if any(key.endswith(".alpha") for key in keys):
        return "ComfyUI/kohya layout with per-module alpha"
    if keys and keys[0].startswith(COMFYUI_PREFIX):
        return "ComfyUI layout (no alpha: scale 1)"
    if facts.get("lora_alpha") not in (None, ""):
        return "this trainer's raw tensors (alpha/rank from its metadata)"
    return "DiffSynth layout (scale 1)"


def _number(value) -> float | None:
    try:
        number = float(value)
    except (TypeError, ValueError):
        return None
    return number if number > 0 else None


def _first(names) -> str:
    names = sorted(names)
    more = f", and {len(names) - SHOWN} more" if len(names) > SHOWN else ""
    return ", ".join(names[:SHOWN]) + more


def _block_free(module: str) -> str:
    """``blocks.3.self_attn.q`` -> ``self_attn.q``: a name --lora_target_modules accepts for every block."""
    return re.sub(r"^blocks\.\d+\.", "", module)


def _suggested_targets(modules, facts: dict) -> str:
    stated = facts.get("lora_target_modules")
    if stated:
        return str(stated)
    return ",".join(dict.fromkeys(_block_free(module) for module in sorted(modules, key=_module_order)))


def _module_order(module: str):
    return [int(part) if part.isdigit() else part for part in module.split(".")]


def _file_scale_and_alpha(pairs: dict, alphas: dict, facts: dict, rank: int, where: str) -> tuple[dict, float | None]:
    """Per module, the scale the file's loaders apply to ``B @ A``; and the alpha the file states (None: none)."""
    folded = str(facts.get("lora_scale_folded", "")).lower() == "true"
    stated = _number(facts.get("lora_alpha"))
    if alphas:
        if folded:
            raise InitLoraError(f"{where}: its metadata says alpha/rank is folded in, yet it has .alpha keys "
                                f"({min(alphas)}.alpha, ...); it cannot say which strength is meant")
        values = sorted(set(alphas.values()))
        if len(values) > 1 or set(alphas) != set(pairs):
            unlike = sorted(m for m in pairs if alphas.get(m) != alphas.get(min(pairs)))
            raise InitLoraError(f"{where}: its .alpha keys differ between modules or are missing ({min(pairs)}: "
                                f"{alphas.get(min(pairs))}, {unlike[0]}: {alphas.get(unlike[0])}); one run trains "
                                "one --lora_alpha")
        return {module: values[0] / rank for module in pairs}, values[0]
    if folded:
        return {module: 1.0 for module in pairs}, stated
    if stated is not None:   # raw PEFT tensors of ours (older files, accelerate's model.safetensors)
        return {module: stated / rank for module in pairs}, stated
    return {module: 1.0 for module in pairs}, None


def starting_pairs(tensors: dict, facts: dict, *, expected: dict[str, dict], rank: int, alpha: float | None,
                   targets: str, source: str = FLAG) -> tuple[dict[str, dict], dict]:
    """The LoRA training starts from: ``{module: {"A": tensor, "B": tensor}}`` as training holds them (no scale in
    B), and what was found (layout, stated alpha, scale). ``expected`` is ``{module: {"A": shape, "B": shape}}``
    of this run's LoRA. InitLoraError naming the first keys and the flag to change when they do not match."""
    where = f"{FLAG} {source}"
    magnitudes = sorted(key for key in tensors if key.endswith(DORA_KEY_ENDINGS))
    if magnitudes:   # a DoRA's magnitudes have no place in the pairs below: starting without them would drop them
        raise InitLoraError(f"{where}: it is a DoRA ({magnitudes[0]} and {len(magnitudes) - 1} more magnitude keys); "
                            f"{FLAG} starts from plain LoRA files only, so its magnitudes would be lost: continue "
                            "that run with --resume, or start from a plain LoRA")
    try:
        pairs, alphas = lora_pairs(tensors)
        check_pairs(pairs)
    except LoraFormatError as exc:
        raise InitLoraError(f"{where}: {exc}") from None
    broken = nonfinite_tensors(tensors)
    if broken:
        raise InitLoraError(f"{where}: {describe_nonfinite(broken, len(tensors))}; it cannot start a run")
    ranks = {}
    for module, pair in pairs.items():
        ranks.setdefault(int(pair["A"].shape[0]), []).append(module)
    if len(ranks) > 1:
        (low, at_low), (high, at_high) = sorted(ranks.items())[0], sorted(ranks.items())[-1]
        raise InitLoraError(f"{where}: its modules have different ranks ({min(at_low)}: {low}, {min(at_high)}: "
                            f"{high}); one run trains one --lora_rank")
    file_rank = next(iter(ranks))
    if file_rank != rank:
        first = min(pairs, key=_module_order)
        raise InitLoraError(f"{where}: its LoRA is rank {file_rank} ({first}.lora_A: {tuple(pairs[first]['A'].shape)}"
                            f"), this run's is {rank}: set --lora_rank {file_rank}")
    scales, file_alpha = _file_scale_and_alpha(pairs, alphas, facts, file_rank, where)
    run_alpha = float(alpha if alpha is not None else rank)
    if file_alpha is not None and file_alpha != run_alpha:
        raise InitLoraError(f"{where}: it was trained with alpha {file_alpha:g}, this run's --lora_alpha is "
                            f"{run_alpha:g}: set --lora_alpha {file_alpha:g} (the file's alpha/rank "
                            f"{file_alpha / file_rank:g} is what its updates were scaled by)")
    missing, extra = sorted(set(expected) - set(pairs), key=_module_order), sorted(set(pairs) - set(expected),
                                                                                   key=_module_order)
    if missing or extra:
        parts = ([f"has no weights for {len(missing)} of this run's modules ({_first(missing)})"] if missing else []) \
            + ([f"has weights for {len(extra)} modules this run does not train ({_first(extra)})"] if extra else [])
        raise InitLoraError(f"{where}: it {' and '.join(parts)}; this run's --lora_target_modules is {targets}: set "
                            f"--lora_target_modules {_suggested_targets(pairs, facts)}")
    for module in sorted(pairs, key=_module_order):
        got = {part: tuple(pairs[module][part].shape) for part in ("A", "B")}
        want = {part: tuple(expected[module][part]) for part in ("A", "B")}
        if got != want:
            raise InitLoraError(f"{where}: {module}: lora_A {got['A']}, lora_B {got['B']}, but this model's LoRA "
                                f"there is lora_A {want['A']}, lora_B {want['B']}: the file is for another model")
    factor = training_scale(rank, alpha)
    start = {module: {"A": pair["A"], "B": pair["B"], "B_factor": scales[module] / factor}
             for module, pair in pairs.items()}
    unfolded = sorted({round(value["B_factor"], 12) for value in start.values()})
    found = {"layout": describe_layout(tensors, facts), "alpha": file_alpha, "rank": file_rank,
             "modules": len(pairs), "b_factor": unfolded[0] if len(unfolded) == 1 else unfolded}
    return start, found


def expected_shapes(named_parameters) -> dict[str, dict]:
    """``{module: {"A": shape, "B": shape}}`` of the LoRA parameters among (name, parameter) pairs."""
    expected: dict[str, dict] = {}
    for name, parameter in named_parameters:
        if ".lora_A." in name or ".lora_B." in name:
            module, part = split_lora_key(name)
            expected.setdefault(module, {})[part] = tuple(parameter.shape)
    return expected


def load_init_lora(module, source, *, rank: int | None = None, alpha: float | None = None,
                   targets: str | None = None) -> dict:
    """Set the LoRA weights of ``module`` (a ``WanTI2VLoraModule``, before ``accelerator.prepare``) from ``source``.

    Rank, alpha and targets default to the module's own LoRA configuration. Returns what was found (layout, rank,
    alpha, modules, the factor applied to lora_B). The weights keep their dtype (fp32 master weights)."""
    from diffsynth_mbc.training.lora.read import LoraReadError, read_lora

    dit = module.pipe.dit
    config = getattr(dit, "peft_config", {}).get("default")
    rank = rank if rank is not None else int(config.r)
    alpha = alpha if alpha is not None else (float(config.lora_alpha) if config is not None else None)
    targets = targets if targets is not None else ",".join(sorted(getattr(config, "target_modules", ()) or ()))
    try:
        tensors, facts, read_from = read_lora(source)
    except LoraReadError as exc:
        raise InitLoraError(f"{FLAG}: {exc}") from None
    named = lora_parameters(dit)
    start, found = starting_pairs(tensors, facts, expected=expected_shapes(named.items()), rank=rank, alpha=alpha,
                                  targets=targets, source=str(read_from))
    copy_pairs(named, start)
    return {"file": str(read_from), **found}


def lora_parameters(dit) -> dict:
    """{name: parameter} of every lora_A and lora_B weight of the DiT."""
    return {name: parameter for name, parameter in dit.named_parameters() if ".lora_A." in name or ".lora_B." in name}


def copy_pairs(named: dict, start: dict) -> None:
    """Each LoRA parameter of ``named`` set from ``starting_pairs``' pairs (lora_B times its factor, in fp64 first),
    in the parameter's own dtype and device."""
    import torch

    with torch.no_grad():
        for name, parameter in named.items():
            module_name, part = split_lora_key(name)
            pair = start[module_name]
            value = pair[part]
            if part == "B" and pair["B_factor"] != 1.0:
                value = value.to(torch.float64) * pair["B_factor"]
            parameter.copy_(value.to(device=parameter.device, dtype=parameter.dtype))


def start_from_lora(module, options, status=None) -> dict | None:
    """The training's hook: with ``--init_lora``, load it into the fresh LoRA and say so in the status and log.

    A ``--resume`` goes on with its checkpoint's weights: an ``init_lora`` (typically a preset's, carried into the
    resume command) does not apply to it, and rank 0 says so once."""
    if not options.init_lora:
        return None
    if options.resume:
        if status is None or status.state.get("rank") == 0:
            print(f"note: {FLAG} {options.init_lora} is not applied: --resume {options.resume} continues its "
                  f"checkpoint's weights, optimizer and step ({FLAG} starts new runs only)", file=sys.stderr)
        return None
    if status is not None:
        status.update(phase=f"loading the LoRA to start from ({options.init_lora})")
    found = load_init_lora(module, options.init_lora, rank=options.lora_rank, alpha=options.lora_alpha,
                           targets=options.lora_target_modules.text)
    if status is not None:
        status.update(init_lora=found, phase=f"LoRA weights from {found['file']} ({found['layout']}); fresh optimizer "
                                            "at step 0")
        if status.state.get("rank") == 0:
            print(f"init_lora: {found['modules']} LoRA modules from {found['file']} ({found['layout']}, rank "
                  f"{found['rank']}, lora_B x {found['b_factor']}); fresh optimizer at step 0", file=sys.stderr)
    return found
