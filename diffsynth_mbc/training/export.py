"""``python -m diffsynth_mbc.export LORA_OR_CHECKPOINT --format comfyui|diffsynth --output FILE``.

Converts a LoRA file written by any version of this trainer, or a checkpoint folder
(``CHECKPOINTS/step-00001234``), into a file that ComfyUI or DiffSynth loads at the strength it was
trained with (see ``lora_format``). The input is never modified; the output is written to a temp
file and renamed. Exit codes: 0 written, 2 bad input or options (the message names the file).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from diffsynth_mbc.atomic import atomic_save_safetensors
from diffsynth_mbc.training.lora_format import FORMATS, LoraFormatError, convert, file_metadata, training_scale

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


def export(source: str | Path, target_format: str, output: str | Path) -> dict:
    tensors, facts, read_from = read_lora(source)
    output = Path(output)
    if output.resolve() == read_from.resolve():
        raise ExportError(f"{output}: the output would overwrite the input; choose another --output")
    folded = str(facts.get("lora_scale_folded", "")).lower() == "true"
    rank = facts.get("lora_rank")
    if rank in (None, "", "None"):
        raise ExportError(f"{read_from}: the file does not say its LoRA rank (no 'lora_rank' metadata), so its "
                          "strength cannot be made right; give the checkpoint folder instead")
    rank = int(float(rank))
    alpha = facts.get("lora_alpha")
    alpha = None if alpha in (None, "", "None") else float(alpha)
    scale = 1.0 if folded else training_scale(rank, alpha)
    try:
        converted = convert(tensors, target_format, scale=scale)
    except LoraFormatError as exc:
        raise ExportError(f"{read_from}: {exc}") from None
    step = facts.get("step")
    metadata = file_metadata(rank=rank, alpha=alpha, targets=str(facts.get("lora_target_modules", "")),
                             base_model=str(facts.get("base_model", BASE_MODEL)),
                             step=int(step) if str(step or "").isdigit() else None,
                             run_id=facts.get("run_id"), layout=target_format)
    output.parent.mkdir(parents=True, exist_ok=True)
    atomic_save_safetensors(output, converted, metadata=metadata)
    return {"input": str(read_from), "output": str(output), "format": target_format, "tensors": len(converted),
            "scale_folded": scale, "rank": rank, "alpha": alpha if alpha is not None else rank}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m diffsynth_mbc.export", allow_abbrev=False,
                                     description="Convert a LoRA file or checkpoint folder into a file ComfyUI or "
                                                 "DiffSynth loads at the trained strength.")
    parser.add_argument("source", help="a LoRA .safetensors file or a checkpoint folder (CHECKPOINTS/step-N)")
    parser.add_argument("--format", choices=FORMATS, default="comfyui",
                        help="comfyui: diffusion_model.<module>.lora_A/B.weight (default); diffsynth: <module>...")
    parser.add_argument("--output", required=True, help="the file to write (never the input)")
    options = parser.parse_args(argv)
    try:
        result = export(options.source, options.format, options.output)
    except (ExportError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {result['output']}: {result['tensors']} tensors, {result['format']} layout, rank {result['rank']}, "
          f"alpha {result['alpha']:g} (scale {result['scale_folded']:g} folded into lora_B)", file=sys.stderr)
    return 0
