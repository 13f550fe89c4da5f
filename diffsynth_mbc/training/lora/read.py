"""Reading a LoRA file or a checkpoint folder's LoRA: its tensors, and what its metadata says of rank, alpha,
targets and base model; a file that cannot be read is a ``LoraReadError`` naming it. No torch at import."""

from __future__ import annotations

import json
import struct
from pathlib import Path

from diffsynth_mbc.run_layout import CHECKPOINT_LORA, CHECKPOINT_MANIFEST
from diffsynth_mbc.values import finite_number, positive_number

class LoraReadError(ValueError):
    """A LoRA file or checkpoint that cannot be read or used, with the file named."""


def _checkpoint_fingerprint(folder: Path) -> dict:
    try:
        return json.loads((folder / CHECKPOINT_MANIFEST).read_text(encoding="utf-8")).get("fingerprint") or {}
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
        source = source / CHECKPOINT_LORA
    if not source.is_file():
        raise LoraReadError(f"{source}: no such LoRA file (give a .safetensors file or a checkpoint folder)")
    try:
        with safe_open(str(source), framework="pt") as handle:
            metadata = handle.metadata() or {}
            tensors = {key: handle.get_tensor(key) for key in handle.keys()}
    except (SafetensorError, OSError, ValueError) as exc:
        raise LoraReadError(f"{source}: not a readable safetensors file ({exc})") from None
    for key in ("lora_rank", "lora_alpha", "lora_target_modules", "base_model", "step", "run_id",
                "lora_scale_folded"):
        if metadata.get(key) not in (None, ""):
            facts[key] = metadata[key]
    return tensors, facts, source


def rank_of(facts: dict, read_from: Path) -> int:
    value = facts.get("lora_rank")
    if value in (None, "", "None"):
        raise LoraReadError(f"{read_from}: the file does not say its LoRA rank (no 'lora_rank' metadata), so its "
                            "strength cannot be made right; give the checkpoint folder instead")
    number = finite_number(value, text=True)
    if number is None or number < 1 or number != int(number):
        raise LoraReadError(f"{read_from}: lora_rank {value!r} in its metadata is not a whole number of 1 or more")
    return int(number)


def alpha_of(facts: dict, read_from: Path) -> float | None:
    value = facts.get("lora_alpha")
    if value in (None, "", "None"):
        return None
    number = positive_number(value, text=True)
    if number is None:
        raise LoraReadError(f"{read_from}: lora_alpha {value!r} in its metadata is not a finite number above 0")
    return number


def file_metadata_of(path: str | Path) -> dict:
    """The string metadata of a safetensors file, read from its header alone ({} when it cannot be read)."""
    try:
        with open(path, "rb") as handle:
            size = struct.unpack("<Q", handle.read(8))[0]
            header = json.loads(handle.read(size)) if 0 < size < 100 * 2**20 else {}
    except (OSError, ValueError, struct.error):
        return {}
    metadata = header.get("__metadata__") if isinstance(header, dict) else None
    return metadata if isinstance(metadata, dict) else {}
