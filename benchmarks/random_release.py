"""A Wan2.2-TI2V-5B release folder with random weights: the real release's file names, key names and shapes.

    python benchmarks/random_release.py OUT_DIR [--device cuda] [--dtype bf16]
    python benchmarks/random_release.py --check      # only the key check below, on the meta device, writes nothing

The weights cannot be downloaded everywhere the full-size path has to be measured. With this folder as
``--model_dir``, the training, the latent cache builder and ``doctor --probe`` load the model exactly as they
load the real one: ``locate_model_files`` checks the folder, DiffSynth recognises each file by the hash of its
key names and shapes and builds the full-size models from it. Only the values are random, and the tokenizer
is the demo's word-level one (every prompt is padded to 512 tokens, so the text encoder's work does not depend
on the words). Written: the DiT as 3 safetensors shards, the umt5-xxl text encoder and the Wan2.2 VAE as
PyTorch checkpoints (the VAE's keys without the ``model.`` prefix DiffSynth adds), ``google/umt5-xxl/``.
The models are built one at a time on ``--device`` with their own initialisation (CUDA: seconds; about 23 GB
written in bf16). ``--check`` builds them on the meta device and exits 1 unless DiffSynth's model table
recognises all three.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from step_timing import built_in  # noqa: E402

DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}
DIT_SHARDS = 3


def release_models(dit_config: dict | None = None, text_encoder_config: dict | None = None, build_vae=None):
    """(file name, DiffSynth model name, a builder of the module) for each file of the release; the DiT's
    builder makes the whole DiT, the caller shards it. Full size unless configs or a VAE builder are given."""
    from diffsynth.models.wan_video_dit import WanModel
    from diffsynth.models.wan_video_text_encoder import WanTextEncoder
    from diffsynth.models.wan_video_vae import WanVideoVAE38

    from diffsynth_mbc.models.model_files import TEXT_ENCODER_FILE, VAE_FILE
    from diffsynth_mbc.models.pipeline import TI2V_5B_DIT

    return [
        ("diffusion_pytorch_model", "wan_video_dit", lambda: WanModel(**(dit_config or TI2V_5B_DIT))),
        (TEXT_ENCODER_FILE, "wan_video_text_encoder", lambda: WanTextEncoder(**(text_encoder_config or {}))),
        (VAE_FILE, "wan_video_vae", build_vae or WanVideoVAE38),
    ]


def file_state_dict(module, file_name: str) -> dict:
    """The module's tensors under the names the release's file uses."""
    from diffsynth_mbc.models.model_files import VAE_FILE

    state = module.state_dict()
    if file_name == VAE_FILE:   # DiffSynth's converter prefixes the file's keys with "model."
        state = {key.removeprefix("model."): value for key, value in state.items()}
    return state


def recognised_as(state: dict) -> list[str]:
    """The DiffSynth model names its model table gives a file of these keys and shapes ([] when unknown)."""
    from diffsynth.configs.model_config import model_loader_configs
    from diffsynth.models.utils import hash_state_dict_keys

    digest = hash_state_dict_keys(state, with_shape=True)
    return [name for _, known, names, _, _ in model_loader_configs if known == digest for name in names]


def check() -> list[str]:
    """The models DiffSynth would not recognise at full size (built on the meta device: no memory, no values)."""
    import torch

    unrecognised = []
    for file_name, model_name, build in release_models():
        with torch.device("meta"):
            state = file_state_dict(build(), file_name)
        if model_name not in recognised_as(state):
            unrecognised.append(f"{file_name}: not recognised as {model_name}")
    return unrecognised


def write_release(folder: Path, device: str, dtype, models=None) -> list[Path]:
    """Every file of the release under ``folder``; the paths written."""
    import torch
    from safetensors.torch import save_file

    from diffsynth_mbc.atomic import atomic_path
    from diffsynth_mbc.models.model_files import TOKENIZER_DIR
    from diffsynth_mbc.models.pipeline import demo_tokenizer_in

    folder.mkdir(parents=True, exist_ok=True)
    written = []
    for file_name, _, build in models or release_models():
        with built_in(dtype, device):
            module = build()
        state = {key: value.to(dtype).contiguous().cpu() for key, value in file_state_dict(module, file_name).items()}
        del module
        if file_name.endswith(".pth"):
            with atomic_path(folder / file_name) as temp:
                torch.save(state, temp)
            written.append(folder / file_name)
            continue
        keys = list(state)
        for index in range(DIT_SHARDS):
            shard = {key: state[key] for key in keys[index::DIT_SHARDS]}
            path = folder / f"{file_name}-{index + 1:05d}-of-{DIT_SHARDS:05d}.safetensors"
            with atomic_path(path) as temp:
                save_file(shard, str(temp))
            written.append(path)
    written.append(demo_tokenizer_in(folder / TOKENIZER_DIR))
    return written


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out_dir", nargs="?", type=Path, help="the release folder to write (created)")
    parser.add_argument("--check", action="store_true", help="only check DiffSynth recognises every file's keys")
    parser.add_argument("--device", default="cuda", help="where the models are built (default cuda)")
    parser.add_argument("--dtype", choices=DTYPES, default="bf16", help="the files' dtype (default bf16)")
    args = parser.parse_args(argv)
    if args.check:
        problems = check()
        print("\n".join(problems) or "DiffSynth recognises the DiT, the text encoder and the VAE at full size")
        return 1 if problems else 0
    if args.out_dir is None:
        parser.error("give OUT_DIR, or --check")
    import torch

    for path in write_release(args.out_dir, args.device, getattr(torch, DTYPES[args.dtype])):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
