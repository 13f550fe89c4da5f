"""``python -m diffsynth_mbc.export LORA_OR_CHECKPOINT --format comfyui|diffsynth|merged --output FILE [--overwrite]``.

Converts a LoRA file written by any version of this trainer, or a checkpoint folder
(``CHECKPOINTS/step-00001234``), into a file that ComfyUI or DiffSynth loads at the strength it was
trained with (see ``lora_format``). ``merged`` (with ``--model_dir`` or ``--demo``) writes the DiT's weights with
the LoRA or DoRA merged in (``lora_merge``): DiffSynth's LoRA loader ignores a DoRA's ``dora_scale``, so that is
how a DoRA loads right there. The input is never modified; an existing output is replaced only
with ``--overwrite``; the output is written to a temp file and renamed. Exit codes: 0 written, 2 bad input or options (the message names the file).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from diffsynth_mbc.atomic import atomic_save_safetensors
from diffsynth_mbc.flags import FlagParser
from diffsynth_mbc.models.model_files import ModelFileError
from diffsynth_mbc.run_layout import CHECKPOINT_MANIFEST
from diffsynth_mbc.training.lora.file_format import (
    FORMATS,
    LoraFormatError,
    check_pairs,
    convert,
    describe_nonfinite,
    file_metadata,
    lora_pairs,
    nonfinite_tensors,
    split_magnitudes,
    training_keys,
    training_scale,
)
from diffsynth_mbc.training.lora.read import LoraReadError, alpha_of, file_metadata_of, rank_of, read_lora

BASE_MODEL = "Wan2.2-TI2V-5B"
MERGED = "merged"   # the DiT's weights with the LoRA merged in (lora_merge), beside the layouts of lora_format
ExportError = LoraReadError   # what export raises: an input or output it cannot use, with the file named
DORA_IN_DIFFSYNTH = ("DiffSynth's LoRA loader (pipe.load_lora) reads no DoRA magnitude: it loads a DoRA file without "
                     "an error but ignores its dora_scale tensors, so the DoRA comes out wrong there")


def _check_output(output: Path, read_from: Path, source: Path, overwrite: bool = False) -> None:
    """Never the input, never inside the checkpoint folder read from (its state files), never a folder; an existing
    file only with ``overwrite``."""
    target = output.resolve()
    if target == read_from.resolve():
        raise ExportError(f"{output}: the output would overwrite the input; choose another --output")
    folder = source if source.is_dir() else read_from.parent
    if (folder / CHECKPOINT_MANIFEST).is_file() and target.is_relative_to(folder.resolve()):
        raise ExportError(f"{output}: the output would be written inside the checkpoint folder {folder} (and could "
                          "replace its saved state); choose an --output outside it")
    if target.is_dir():
        raise ExportError(f"{output}: is a folder; give --output a file name")
    if output.exists() and not overwrite:
        raise ExportError(f"{output}: exists; nothing was written (pass --overwrite to replace it)")


def _scale_and_alpha(pairs: dict, alphas: dict, rank: int, alpha: float | None, folded: bool,
                     read_from: Path) -> tuple[float, float | None]:
    """The scale still to fold into lora_B (besides per-module ``.alpha`` keys) and the alpha the output carries."""
    if not alphas:
        return (1.0 if folded else training_scale(rank, alpha)), alpha
    if folded:
        raise ExportError(f"{read_from}: its metadata says alpha/rank is folded in, yet it has .alpha keys "
                          f"({sorted(alphas)[0]}.alpha, ...); it cannot say which strength is meant")
    unlike = sorted(module for module in pairs if alphas.get(module) != alphas.get(min(pairs)))
    if unlike:
        raise ExportError(f"{read_from}: .alpha keys differ between modules or are missing ({min(pairs)}: "
                          f"{alphas.get(min(pairs))}, {unlike[0]}: {alphas.get(unlike[0])})")
    module_alpha = alphas[min(pairs)]
    if alpha is not None and alpha != module_alpha:
        raise ExportError(f"{read_from}: its metadata says lora_alpha {alpha:g} but its .alpha keys say "
                          f"{module_alpha:g}; it cannot say which strength is meant")
    return 1.0, module_alpha   # convert folds each .alpha / rank; the metadata alpha is not applied again


def dora_run_note(path: str | Path) -> str | None:
    """What the end of a DoRA run says about its LoRA file ``path``: which loaders read it right; None for a LoRA."""
    metadata = file_metadata_of(path)
    if metadata.get("lora_variant") != "dora":
        return None
    base = "--demo --seed SEED" if "(demo)" in metadata.get("base_model", "") else "--model_dir MODEL_DIR"
    return (f"DoRA: ComfyUI loads {Path(path).name} as trained; {DORA_IN_DIFFSYNTH}. For DiffSynth: python -m "
            f"diffsynth_mbc.export {path} --format merged {base} --output merged.safetensors (the DiT's weights with "
            "the DoRA merged in)")


def _file_tensors(tensors: dict, target_format: str, scale: float, base_from: dict) -> dict:
    """The output's tensors: a LoRA layout (``convert``), or the DiT's weights with the LoRA merged in."""
    if target_format != MERGED:
        return convert(tensors, target_format, scale=scale)
    from diffsynth_mbc.training.lora.merge import base_weights, merged_weights

    modules = sorted(lora_pairs(split_magnitudes(tensors)[0])[0])
    return merged_weights(tensors, scale, base_weights(modules, **base_from))


def _merged_metadata(facts: dict, read_from: Path, rank: int, alpha: float | None, variant: str,
                     base_from: dict) -> dict:
    base = str(base_from["model_dir"]) if base_from.get("model_dir") else f"demo seed {base_from['demo_seed']}"
    return {"format": "pt", "content": "DiT weights with a LoRA merged in (load_state_dict, strict=False)",
            "merged_from": read_from.name, "lora_variant": variant, "lora_rank": str(rank),
            "lora_alpha": str(alpha if alpha is not None else rank), "base_weights": base,
            "base_model": str(facts.get("base_model", BASE_MODEL)), "step": str(facts.get("step") or ""),
            "run_id": str(facts.get("run_id") or ""), "lora_target_modules": str(facts.get("lora_target_modules", ""))}


def export(source: str | Path, target_format: str, output: str | Path, overwrite: bool = False,
           model_dir: str | Path | None = None, demo_seed: int | None = None) -> dict:
    """Write ``output``; ``merged`` reads the base weights from ``model_dir`` or the demo's model (``demo_seed``)."""
    base_from = {"model_dir": model_dir, "demo_seed": demo_seed}
    if target_format == MERGED and model_dir is None and demo_seed is None:
        raise ExportError("--format merged needs the base model's weights: --model_dir DIR (the Wan2.2-TI2V-5B "
                          "release the LoRA was trained on) or --demo (the demo's model, with the run's --seed)")
    tensors, facts, read_from = read_lora(source)
    output = Path(output)
    _check_output(output, read_from, Path(source), overwrite)
    folded = str(facts.get("lora_scale_folded", "")).lower() == "true"
    rank, alpha = rank_of(facts, read_from), alpha_of(facts, read_from)
    variant = "dora" if split_magnitudes(tensors)[1] else "lora"
    try:
        pairs, alphas = lora_pairs(split_magnitudes(tensors)[0])
        check_pairs(pairs, rank)
        scale, alpha = _scale_and_alpha(pairs, alphas, rank, alpha, folded, read_from)
        converted = _file_tensors(tensors, target_format, scale, base_from)
    except LoraFormatError as exc:
        raise ExportError(f"{read_from}: {exc}") from None
    except ModelFileError as exc:
        raise ExportError(f"{read_from}: {exc}") from None
    broken = nonfinite_tensors(converted)
    if broken:
        raise ExportError(f"{read_from}: {describe_nonfinite(broken, len(converted))}; nothing was written")
    step = facts.get("step")
    metadata = _merged_metadata(facts, read_from, rank, alpha, variant, base_from) if target_format == MERGED else \
        file_metadata(rank=rank, alpha=alpha, targets=str(facts.get("lora_target_modules", "")),
                      base_model=str(facts.get("base_model", BASE_MODEL)),
                      step=int(step) if str(step or "").isdigit() else None,
                      run_id=facts.get("run_id"), layout=target_format, variant=variant)
    # what trained it goes along (kohya-style ss_* and the project's recipe and plan)
    metadata = {**training_keys(file_metadata_of(read_from), lora=target_format != MERGED), **metadata}
    output.parent.mkdir(parents=True, exist_ok=True)
    atomic_save_safetensors(output, converted, metadata=metadata)
    return {"input": str(read_from), "output": str(output), "format": target_format, "tensors": len(converted),
            "scale_folded": scale if not alphas else alpha / rank, "rank": rank,
            "alpha": alpha if alpha is not None else rank, "variant": variant}


def build_parser() -> argparse.ArgumentParser:
    parser = FlagParser(prog="python -m diffsynth_mbc.export", allow_abbrev=False,
                        description="Convert a LoRA file or checkpoint folder into a file ComfyUI or "
                                    "DiffSynth loads at the trained strength.")
    parser.add_argument("source", help="a LoRA .safetensors file or a checkpoint folder (CHECKPOINTS/step-N)")
    parser.add_argument("--format", choices=FORMATS + (MERGED,), default="comfyui",
                        help="comfyui: diffusion_model.<module>.lora_A/B.weight (default); diffsynth: <module>...; "
                             "merged: the DiT's weights with the LoRA (or DoRA) merged in, for DiffSynth's "
                             "pipe.dit.load_state_dict(..., strict=False): needs --model_dir or --demo")
    parser.add_argument("--model_dir", help="--format merged: the Wan2.2-TI2V-5B folder whose DiT the LoRA was "
                                            "trained on (only the weights the LoRA changes are read)")
    parser.add_argument("--demo", action="store_true", help="--format merged: the demo's tiny model as the base")
    parser.add_argument("--seed", type=int, default=42, help="--demo only: the demo run's --seed (default 42)")
    parser.add_argument("--output", required=True, help="the file to write (never the input)")
    parser.add_argument("--overwrite", action="store_true", help="replace --output when it exists (else refused)")
    return parser


def _base_options(options) -> dict:
    """``export``'s model_dir/demo_seed from the flags; ExportError for a flag that would do nothing."""
    if options.format != MERGED:
        given = [flag for flag, value in (("--model_dir", options.model_dir), ("--demo", options.demo)) if value]
        if given:
            raise ExportError(f"{given[0]} is read by --format merged only (this export writes the "
                              f"{options.format} layout, which holds no base weights)")
        return {}
    if options.model_dir and options.demo:
        raise ExportError("--model_dir and --demo both name the base weights: give one")
    return {"model_dir": options.model_dir, "demo_seed": options.seed if options.demo else None}


def _written(result: dict) -> list[str]:
    """What the command prints after writing."""
    if result["format"] == MERGED:
        kind = {"dora": "DoRA", "lora": "LoRA"}[result["variant"]]
        return [f"wrote {result['output']}: {result['tensors']} DiT weights with the {kind} merged in (rank "
                f"{result['rank']}, alpha {result['alpha']:g}); DiffSynth: "
                f"pipe.dit.load_state_dict(safetensors.torch.load_file(...), strict=False)"]
    lines = [f"wrote {result['output']}: {result['tensors']} tensors, {result['format']} layout, rank "
             f"{result['rank']}, alpha {result['alpha']:g} (scale {result['scale_folded']:g} folded into lora_B)"]
    if result["variant"] == "dora":
        lines.append(f"note: a DoRA: ComfyUI loads it as trained; {DORA_IN_DIFFSYNTH}. For DiffSynth, export with "
                     "--format merged --model_dir MODEL_DIR (the DiT's weights with the DoRA merged in)")
    return lines


def main(argv: list[str] | None = None) -> int:
    from diffsynth_mbc.gpu import quiet_torch_notices

    quiet_torch_notices()   # safetensors' torch import would print them above our line
    options = build_parser().parse_args(argv)
    try:
        result = export(options.source, options.format, options.output, overwrite=options.overwrite,
                        **_base_options(options))
    except (ExportError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    for line in _written(result):
        print(line, file=sys.stderr)
    return 0
