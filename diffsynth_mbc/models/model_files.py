"""Which files the Wan2.2-TI2V-5B release needs, and checking them before anything loads. No torch.

A local model directory laid out like the release:

    diffusion_pytorch_model-00001-of-00003.safetensors  (... 00003)   the DiT shards
    models_t5_umt5-xxl-enc-bf16.pth                                   UMT5-XXL text encoder
    Wan2.2_VAE.pth                                                    Wan2.2 VAE
    google/umt5-xxl/                                                  tokenizer folder
"""

from __future__ import annotations

import glob
import json
import os
import re
import struct
import zipfile
from dataclasses import dataclass
from pathlib import Path

MODELSCOPE_ID = "Wan-AI/Wan2.2-TI2V-5B"
DIT_PATTERN = "diffusion_pytorch_model*.safetensors"
TEXT_ENCODER_FILE = "models_t5_umt5-xxl-enc-bf16.pth"
VAE_FILE = "Wan2.2_VAE.pth"
TOKENIZER_DIR = "google/umt5-xxl"
TOKENIZER_FILES_ANY = ("tokenizer.json", "spiece.model")


class ModelFileError(ValueError):
    """A model file is missing or not what it should be; the message names the file."""


@dataclass(frozen=True)
class ModelFiles:
    dit_shards: tuple[Path, ...]
    text_encoder: Path
    vae: Path
    tokenizer_dir: Path


def _check_safetensors(path: Path) -> None:
    try:
        with open(path, "rb") as handle:
            header_size = struct.unpack("<Q", handle.read(8))[0]
            if not 0 < header_size < 100 * 2**20:
                raise ValueError(f"header size {header_size}")
            json.loads(handle.read(header_size))
    except Exception as exc:  # struct.error, ValueError, UnicodeDecodeError
        raise ModelFileError(f"{path}: not a readable safetensors file ({exc}); re-download it") from None


def _check_torch_checkpoint(path: Path) -> None:
    if not zipfile.is_zipfile(path):
        raise ModelFileError(f"{path}: not a PyTorch checkpoint (no zip archive inside); re-download it")


def _require_file(path: Path, what: str) -> Path:
    if not path.is_file():
        raise ModelFileError(f"missing {what}: {path}")
    if path.stat().st_size == 0:
        raise ModelFileError(f"empty {what}: {path}")
    return path


def _expected_shard_count(shards: list[Path]) -> int | None:
    counts = {int(m.group(1)) for s in shards if (m := re.search(r"-of-(\d+)\.safetensors$", s.name))}
    return counts.pop() if len(counts) == 1 else None


def locate_model_files(model_dir: str | os.PathLike) -> ModelFiles:
    """Find and check every file of the release in ``model_dir``; raise ModelFileError naming the first bad one."""
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise ModelFileError(f"model directory not found: {model_dir}")
    shards = sorted(Path(p) for p in glob.glob(str(model_dir / DIT_PATTERN)))
    if not shards:
        raise ModelFileError(f"missing DiT weights: no {DIT_PATTERN} in {model_dir}")
    expected = _expected_shard_count(shards)
    if expected is not None:
        names = {s.name for s in shards}
        for index in range(1, expected + 1):
            name = f"diffusion_pytorch_model-{index:05d}-of-{expected:05d}.safetensors"
            if name not in names:
                raise ModelFileError(f"missing DiT shard: {model_dir / name}")
    for shard in shards:
        _check_safetensors(_require_file(shard, "DiT shard"))
    text_encoder = _require_file(model_dir / TEXT_ENCODER_FILE, "text encoder")
    _check_torch_checkpoint(text_encoder)
    vae = _require_file(model_dir / VAE_FILE, "VAE")
    _check_torch_checkpoint(vae)
    tokenizer_dir = model_dir / TOKENIZER_DIR
    if not tokenizer_dir.is_dir():
        raise ModelFileError(f"missing tokenizer folder: {tokenizer_dir}")
    if not any((tokenizer_dir / name).is_file() for name in TOKENIZER_FILES_ANY):
        raise ModelFileError(f"tokenizer folder {tokenizer_dir} has neither of {', '.join(TOKENIZER_FILES_ANY)}")
    return ModelFiles(tuple(shards), text_encoder, vae, tokenizer_dir)
