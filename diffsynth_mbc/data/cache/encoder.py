"""Loading the encoders the cache needs (VAE, text encoder; never the DiT) and encoding one clip or caption
through DiffSynth's own pipeline units, as training does on every step."""

from __future__ import annotations

import functools
from pathlib import Path

# ---------------------------------------------------------------------------------------------
# Encoding


def _dit_flags(config: dict):
    """What DiffSynth's units read from ``pipe.dit``: its flags, without building the 5B model."""
    import torch

    flags = torch.nn.Module()  # no parameters; the pipeline only accepts a module (or None) as its dit
    for key in ("in_dim", "has_image_input", "require_vae_embedding", "require_clip_embedding",
                "fuse_vae_embedding_in_latents"):
        setattr(flags, key, config[key])
    flags.has_image_pos_emb = False
    return flags


def resolve_model_id_files(model_id: str):
    """Download (if needed) the encoders of a ModelScope release; returns (text_encoder, vae, tokenizer_dir)."""
    from diffsynth.pipelines.wan_video_new import ModelConfig

    from diffsynth_mbc.models.model_files import TEXT_ENCODER_FILE, VAE_FILE

    paths = []
    for pattern in (TEXT_ENCODER_FILE, VAE_FILE, "google/*"):
        config = ModelConfig(model_id=model_id, origin_file_pattern=pattern)
        config.download_if_necessary()
        paths.append(Path(config.path if isinstance(config.path, str) else config.path[0]))
    return tuple(paths)


@functools.lru_cache(maxsize=2)
def _demo_encoders(seed: int, device: str, torch_dtype):
    """The demo's encoders, built once per process (deterministic from the seed; used without gradients)."""
    import tempfile

    from diffsynth_mbc.models.pipeline import build_demo_pipeline

    with tempfile.TemporaryDirectory(prefix="mbc-demo-tokenizer-") as tokenizer_dir:  # read while building
        return build_demo_pipeline(device=device, torch_dtype=torch_dtype, seed=seed, tokenizer_dir=tokenizer_dir)


def load_encoders(options, device: str, torch_dtype, model_files):
    """A WanVideoPipeline with the VAE, text encoder and tokenizer only; ``pipe.dit`` holds the DiT's flags."""
    from diffsynth_mbc.models.pipeline import TI2V_5B_DIT, TINY_DIT

    if options.demo:
        return ready_to_encode(_demo_encoders(options.seed, device, torch_dtype), TINY_DIT)
    from diffsynth.pipelines.wan_video_new import ModelConfig, WanVideoPipeline

    from diffsynth_mbc.models.model_files import ModelFileError

    text_encoder, vae, tokenizer_dir = model_files
    pipe = WanVideoPipeline.from_pretrained(
        torch_dtype=torch_dtype, device=device,
        model_configs=[ModelConfig(path=str(text_encoder)), ModelConfig(path=str(vae))],
        tokenizer_config=ModelConfig(path=str(tokenizer_dir)))
    missing = [name for name in ("text_encoder", "vae") if getattr(pipe, name) is None]
    if missing:
        raise ModelFileError(f"DiffSynth did not recognise the {', '.join(missing)} weights "
                             f"({text_encoder}, {vae}); are these the Wan2.2-TI2V-5B files?")
    return ready_to_encode(pipe, TI2V_5B_DIT)


def ready_to_encode(pipe, dit_config: dict):
    """``pipe`` (its VAE, text encoder and tokenizer loaded) set up as the cache encodes: ``pipe.dit`` holds only
    the flags of ``dit_config``, every model is in eval mode (no dropout in the text encoder) and the scheduler in
    training mode (InputVideoEmbedder returns input_latents only then), as WanTI2VLoraModule sets them."""
    pipe.dit = _dit_flags(dit_config)
    pipe.freeze_except([])
    pipe.scheduler.set_timesteps(1000, training=True)
    return pipe


class PendingClips:
    """Decodes the rows still to encode (in DataLoader workers); a failure comes back as its reason."""

    def __init__(self, dataset, rows: list[int]):
        self.dataset = dataset
        self.rows = rows

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int):
        row, stage = self.rows[index]   # (row, stage): --resolution_stages' stage, or the final size
        final = stage >= len(self.dataset.stages)
        try:
            return (row, None if final else stage), self.dataset[row if final else (row, stage)], None
        except Exception as exc:  # noqa: BLE001 - MediaDecodeError names the row and file
            return (row, None if final else stage), None, str(exc)


def first_item(batch):
    return batch[0]


def header_shapes(path: Path) -> dict:
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as handle:
        return {name: list(handle.get_slice(name).get_shape()) for name in handle.keys()}


class Encoder:
    """The per-rank work: latents through the media units, captions through the prompt unit."""

    def __init__(self, pipe, cache_dir: Path, torch_dtype):
        import torch

        from diffsynth_mbc.models.wan_units import media_units, prompt_units

        self.torch = torch
        self.pipe = pipe
        self.cache_dir = cache_dir
        self.torch_dtype = torch_dtype
        self.media_units = media_units(pipe)
        self.prompt_units = prompt_units(pipe)

    def encode_media(self, sample: dict) -> tuple[dict, str]:
        from diffsynth_mbc.models.wan_units import run_units, unit_inputs

        torch = self.torch
        out = run_units(self.pipe, *unit_inputs(self.pipe, sample), units=self.media_units)
        latents = out["input_latents"][0].to(device="cpu", dtype=self.torch_dtype)
        first = out["first_frame_latents"][0].to(device="cpu", dtype=self.torch_dtype)
        tensors = {"input_latents": latents}
        # The Wan2.2 VAE is causal: its first latent frame sees the first video frame only, so the
        # TI2V first-frame latent is input_latents[:, :1]. Stored only where that does not hold exactly.
        if torch.equal(first, latents[:, :1]):
            return tensors, "derived"
        tensors["first_frame_latents"] = first
        return tensors, "stored"

    def encode_text(self, caption: str):
        from diffsynth_mbc.models.wan_units import run_units

        pipe = self.pipe
        context = run_units(pipe, {"cfg_scale": 1, "cfg_merge": False}, {"prompt": caption}, {},
                            units=self.prompt_units)["context"]
        _, mask = pipe.prompter.tokenizer(pipe.prompter.process_prompt(caption, positive=None), return_mask=True,
                                          add_special_tokens=True)
        tokens = int(mask.gt(0).sum())
        if context.shape[0] != 1 or bool(context[:, tokens:].ne(0).any()):
            raise RuntimeError(f"the prompt encoder no longer zeroes positions past the {tokens} real tokens; "
                               "the unpadded text cache would not reproduce its output")
        return context[0, :tokens].to(device="cpu", dtype=self.torch_dtype)


