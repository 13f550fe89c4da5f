"""``python -m diffsynth_mbc.export LORA_OR_CHECKPOINT --format comfyui|diffsynth --output FILE [--overwrite]``.

Converts a LoRA file written by any version of this trainer, or a checkpoint folder
(``CHECKPOINTS/step-00001234``), into a file that ComfyUI or DiffSynth loads at the strength it was
trained with (see ``lora_format``). The input is never modified; an existing output is replaced only
with ``--overwrite``; the output is written to a temp file and renamed. Exit codes: 0 written, 2 bad input or options (the message names the file).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

from diffsynth_mbc.atomic import atomic_save_safetensors
from diffsynth_mbc.flags import FlagParser
from diffsynth_mbc.training.lora_format import (
    FORMATS,
    LoraFormatError,
    check_pairs,
    convert,
    describe_nonfinite,
    file_metadata,
    lora_pairs,
    nonfinite_tensors,
    split_magnitudes,
    training_scale,
)

BASE_MODEL = "Wan2.2-TI2V-5B"


class ExportError(ValueError):
    pass


def _checkpoint_fingerprint(folder: Path) -> dict:
    try:
        return json.loads((folder / "checkpoint.json").read_text(encoding="utf-8")).get("fingerprint") or {}
    except (OSError, ValueError):
        return {}


def read_lora(source: str | Path) -> tuple[dict, dict, Path]:
    """(tensors, what we know about them, the file read) from a LoRA file or a checkpoint folder."""
    from safetensors import SafetensorError, safe_open

    source = Path(source)
    facts: dict = {}
    if source.is_dir():
        facts.update({k: v for k, v in _checkpoint_fingerprint(source).items()
                      if k in ("lora_rank", "lora_alpha", "lora_target_modules")})
        source = source / "lora.safetensors"
    if not source.is_file():
        raise ExportError(f"{source}: no such LoRA file (give a .safetensors file or a checkpoint folder)")
    try:
        with safe_open(str(source), framework="pt") as handle:
            metadata = handle.metadata() or {}
            tensors = {key: handle.get_tensor(key) for key in handle.keys()}
    except (SafetensorError, OSError, ValueError) as exc:
        raise ExportError(f"{source}: not a readable safetensors file ({exc})") from None
    for key in ("lora_rank", "lora_alpha", "lora_target_modules", "base_model", "step", "run_id",
                "lora_scale_folded"):
        if metadata.get(key) not in (None, ""):
            facts[key] = metadata[key]
    return tensors, facts, source


def _rank(facts: dict, read_from: Path) -> int:
    value = facts.get("lora_rank")
    if value in (None, "", "None"):
        raise ExportError(f"{read_from}: the file does not say its LoRA rank (no 'lora_rank' metadata), so its "
                          "strength cannot be made right; give the checkpoint folder instead")
    try:
        number = float(value)
    except (TypeError, ValueError):
        number = math.nan
    if not math.isfinite(number) or number < 1 or number != int(number):
        raise ExportError(f"{read_from}: lora_rank {value!r} in its metadata is not a whole number of 1 or more")
    return int(number)


def _alpha(facts: dict, read_from: Path) -> float | None:
    value = facts.get("lora_alpha")
    if value in (None, "", "None"):
        return None
    try:
        number = float(value)
    except (TypeError, ValueError):
        number = math.nan
    if not math.isfinite(number) or number <= 0:
        raise ExportError(f"{read_from}: lora_alpha {value!r} in its metadata is not a finite number above 0")
    return number


def _check_output(output: Path, read_from: Path, source: Path, overwrite: bool = False) -> None:
    """Never the input, never inside the checkpoint folder read from (its state files), never a folder; an existing
    file only with ``overwrite``."""
    target = output.resolve()
    if target == read_from.resolve():
        raise ExportError(f"{output}: the output would overwrite the input; choose another --output")
    folder = source if source.is_dir() else read_from.parent
    if (folder / "checkpoint.json").is_file() and target.is_relative_to(folder.resolve()):
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


def export(source: str | Path, target_format: str, output: str | Path, overwrite: bool = False) -> dict:
    tensors, facts, read_from = read_lora(source)
    output = Path(output)
    _check_output(output, read_from, Path(source), overwrite)
    folded = str(facts.get("lora_scale_folded", "")).lower() == "true"
    rank, alpha = _rank(facts, read_from), _alpha(facts, read_from)
    try:
        pairs, alphas = lora_pairs(split_magnitudes(tensors)[0])
        check_pairs(pairs, rank)
        scale, alpha = _scale_and_alpha(pairs, alphas, rank, alpha, folded, read_from)
        converted = convert(tensors, target_format, scale=scale)
    except LoraFormatError as exc:
        raise ExportError(f"{read_from}: {exc}") from None
    broken = nonfinite_tensors(converted)
    if broken:
        raise ExportError(f"{read_from}: {describe_nonfinite(broken, len(converted))}; nothing was written")
    step = facts.get("step")
    metadata = file_metadata(rank=rank, alpha=alpha, targets=str(facts.get("lora_target_modules", "")),
                             base_model=str(facts.get("base_model", BASE_MODEL)),
                             step=int(step) if str(step or "").isdigit() else None,
                             run_id=facts.get("run_id"), layout=target_format,
                             variant="dora" if split_magnitudes(tensors)[1] else "lora")
    output.parent.mkdir(parents=True, exist_ok=True)
    atomic_save_safetensors(output, converted, metadata=metadata)
    return {"input": str(read_from), "output": str(output), "format": target_format, "tensors": len(converted),
            "scale_folded": scale if not alphas else alpha / rank, "rank": rank,
            "alpha": alpha if alpha is not None else rank}


def build_parser() -> argparse.ArgumentParser:
    parser = FlagParser(prog="python -m diffsynth_mbc.export", allow_abbrev=False,
                        description="Convert a LoRA file or checkpoint folder into a file ComfyUI or "
                                    "DiffSynth loads at the trained strength.")
    parser.add_argument("source", help="a LoRA .safetensors file or a checkpoint folder (CHECKPOINTS/step-N)")
    parser.add_argument("--format", choices=FORMATS, default="comfyui",
                        help="comfyui: diffusion_model.<module>.lora_A/B.weight (default); diffsynth: <module>...")
    parser.add_argument("--output", required=True, help="the file to write (never the input)")
    parser.add_argument("--overwrite", action="store_true", help="replace --output when it exists (else refused)")
    return parser


def main(argv: list[str] | None = None) -> int:
    from diffsynth_mbc.gpu import quiet_torch_notices

    quiet_torch_notices()   # safetensors' torch import would print them above our line
    options = build_parser().parse_args(argv)
    try:
        result = export(options.source, options.format, options.output, overwrite=options.overwrite)
    except (ExportError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {result['output']}: {result['tensors']} tensors, {result['format']} layout, rank {result['rank']}, "
          f"alpha {result['alpha']:g} (scale {result['scale_folded']:g} folded into lora_B)", file=sys.stderr)
    return 0
