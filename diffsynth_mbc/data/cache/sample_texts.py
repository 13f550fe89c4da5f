"""The sample prompts' text embeddings, stored beside the latent cache so a cached run can sample.

A run from the cache loads neither the text encoder nor (otherwise) the VAE. For ``--sample_prompts``
the cache command also encodes every sample prompt and negative prompt into
``CACHE_DIR/sample_prompts.safetensors`` (one tensor per distinct text, keyed by its sha256, the
encoder's identity in the metadata); the training then loads only the VAE to render the clips (and to
encode a TI2V first-frame image).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from diffsynth_mbc.atomic import atomic_save_safetensors
from diffsynth_mbc.data.cache.index import CacheError
from diffsynth_mbc.run_layout import CACHE_SAMPLE_TEXTS


def text_key(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def texts_of(prompts) -> list[str]:
    """Every distinct prompt and negative prompt, in first-seen order."""
    return list(dict.fromkeys([p.prompt for p in prompts] + [p.negative_prompt for p in prompts]))


def write_sample_texts(cache_dir: Path, pipe, texts: list[str], torch_dtype, identity: str) -> Path:
    import torch

    tensors = {}
    with torch.no_grad():
        for text in texts:
            context = pipe.prompter.encode_prompt(text, positive=True, device=pipe.device)
            tensors[text_key(text)] = context[0].to(device="cpu", dtype=torch_dtype).contiguous()
    path = Path(cache_dir) / CACHE_SAMPLE_TEXTS
    atomic_save_safetensors(path, tensors, metadata={"texts": json.dumps({text_key(t): t for t in texts}),
                                                     "text_encoder": identity})
    return path


def read_sample_texts(cache_dir: Path, texts: list[str]) -> dict:
    """{text: context [text_len, dim]} for every text asked for, or a CacheError naming what is missing."""
    from safetensors.torch import load_file

    path = Path(cache_dir) / CACHE_SAMPLE_TEXTS
    if not path.is_file():
        raise CacheError(f"--sample_prompts with --cache: {path} is missing; build the cache with the same "
                         "--sample_prompts FILE (python -m diffsynth_mbc.cache ... --sample_prompts FILE)")
    stored = load_file(str(path))
    missing = [text for text in texts if text_key(text) not in stored]
    if missing:
        raise CacheError(f"{path} has no embedding for {len(missing)} sample text(s), e.g. {missing[0]!r}; rebuild "
                         "the cache with the current --sample_prompts FILE")
    return {text: stored[text_key(text)] for text in texts}
