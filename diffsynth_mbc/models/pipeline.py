"""Building DiffSynth's Wan pipeline: from the real TI2V-5B weights, or tiny and random for the demo."""

from __future__ import annotations

import tempfile
from pathlib import Path

import torch
from diffsynth.models.wan_video_dit import WanModel
from diffsynth.models.wan_video_text_encoder import WanTextEncoder
import functools

import diffsynth.models.wan_video_vae as wan_video_vae
from diffsynth.models.wan_video_vae import WanVideoVAE38
from diffsynth.pipelines.wan_video_new import ModelConfig, WanVideoPipeline

from diffsynth_mbc.models.model_files import MODELSCOPE_ID, ModelFileError, locate_model_files

# Wan2.2-TI2V-5B's DiT; the tiny demo model keeps every flag and shrinks the widths.
TI2V_5B_DIT = dict(dim=3072, in_dim=48, ffn_dim=14336, out_dim=48, text_dim=4096, freq_dim=256, eps=1e-6,
                   patch_size=(1, 2, 2), num_heads=24, num_layers=30, has_image_input=False,
                   seperated_timestep=True, require_vae_embedding=False, require_clip_embedding=False,
                   fuse_vae_embedding_in_latents=True)
# (dim / num_heads) // 3 must be even for the RoPE split: 64 / 2 = 32 -> 10, fine.
TINY_DIT = dict(TI2V_5B_DIT, dim=64, ffn_dim=128, text_dim=32, freq_dim=32, num_heads=2, num_layers=2)
TINY_TEXT_ENCODER = dict(dim=32, dim_attn=32, dim_ffn=64, num_heads=2, num_layers=1, num_buckets=8)
TINY_TEXT_LEN = 32
# The VAE's encoder and decoder width. Its conv3d layers are most of what a demo step computes on a CPU: 8 encodes a
# demo clip in about half the time 16 took, with every layer of the Wan2.2 VAE and its 48-channel latents kept.
TINY_VAE_WIDTH = 8


def training_pipeline(options, device: str, torch_dtype: torch.dtype, process_index: int) -> WanVideoPipeline:
    """What a training process loads: everything, or from the latent cache the DiT only (plus the VAE when it
    renders sample clips: their prompts' embeddings come from the cache)."""
    cached = bool(options.cache)
    vae_for_samples = cached and bool(options.sample_prompts)
    if not options.demo:
        return load_pipeline(options.model_dir, options.model_id, device=device, torch_dtype=torch_dtype,
                             load_encoders=not cached, load_vae=vae_for_samples)
    pipe = build_demo_pipeline(device=device, torch_dtype=torch.float32, seed=options.seed,
                               tokenizer_dir=str(Path(options.output_path) / ".demo_tokenizer" / f"rank{process_index}"),
                               load_encoders=not cached or vae_for_samples)
    if vae_for_samples:   # the same seeded VAE as the cache's; no text encoder
        pipe.text_encoder = pipe.prompter.text_encoder = None
    return pipe


def load_pipeline(model_dir: str | None, model_id: str | None, device: str, torch_dtype: torch.dtype,
                  load_encoders: bool = True, load_vae: bool = False) -> WanVideoPipeline:
    """The real pipeline from a local release folder (checked first) or a ModelScope id."""
    load_vae = load_vae or load_encoders
    if model_dir:
        files = locate_model_files(model_dir)  # raises ModelFileError before any weight is read
        paths = [[str(p) for p in files.dit_shards]]
        if load_encoders:
            paths.append(str(files.text_encoder))
        if load_vae:
            paths.append(str(files.vae))
        configs = [ModelConfig(path=p) for p in paths]
        tokenizer = ModelConfig(path=str(files.tokenizer_dir))
    else:
        model_id = model_id or MODELSCOPE_ID
        patterns = ["diffusion_pytorch_model*.safetensors"]
        if load_encoders:
            patterns.append("models_t5_umt5-xxl-enc-bf16.pth")
        if load_vae:
            patterns.append("Wan2.2_VAE.pth")
        configs = [ModelConfig(model_id=model_id, origin_file_pattern=p) for p in patterns]
        tokenizer = ModelConfig(model_id=model_id, origin_file_pattern="google/*")
    pipe = WanVideoPipeline.from_pretrained(torch_dtype=torch_dtype, device=device, model_configs=configs,
                                            tokenizer_config=tokenizer)
    # DiffSynth leaves a model None (with only a printed note) when it does not recognise a file.
    wanted = ("dit",) + (("text_encoder",) if load_encoders else ()) + (("vae",) if load_vae else ())
    missing = [name for name in wanted if getattr(pipe, name) is None]
    if missing:
        source = model_dir or model_id
        raise ModelFileError(f"DiffSynth did not recognise the {', '.join(missing)} weights in {source}; "
                             "are these the Wan2.2-TI2V-5B files?")
    return pipe


def demo_tokenizer_in(folder: Path) -> Path:
    """`folder` holding the demo tokenizer, written there unless it already is."""
    folder.mkdir(parents=True, exist_ok=True)
    if not (folder / "tokenizer.json").exists():
        _write_demo_tokenizer(folder)
    return folder


def _write_demo_tokenizer(folder: Path) -> Path:
    """A word-level tokenizer made in code (pad=0, eos=1, unk=2), saved the way the prompter loads one."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    words = ("a an the of in on and with news anchor studio city street night day video image clip "
             "뉴스 영상 사진 앵커 스튜디오 도시 거리 밤 낮").split()
    vocab = {"<pad>": 0, "</s>": 1, "<unk>": 2, **{word: index + 3 for index, word in enumerate(words)}}
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.post_processor = processors.TemplateProcessing(single="$A </s>", special_tokens=[("</s>", 1)])
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="<pad>", eos_token="</s>",
                            unk_token="<unk>").save_pretrained(folder)
    return folder


def build_tiny_vae() -> WanVideoVAE38:
    """The Wan2.2 VAE class with narrow encoder and decoder.

    WanVideoVAE38 exposes only the encoder width and always builds a 256-wide decoder (705M
    parameters, seconds of start-up for every rank); the inner class it calls takes the decoder width.
    """
    full_size = wan_video_vae.VideoVAE38_
    wan_video_vae.VideoVAE38_ = functools.partial(full_size, dec_dim=TINY_VAE_WIDTH)
    try:
        return WanVideoVAE38(z_dim=48, dim=TINY_VAE_WIDTH)
    finally:
        wan_video_vae.VideoVAE38_ = full_size


def build_demo_pipeline(device: str = "cpu", torch_dtype: torch.dtype = torch.float32, seed: int = 0,
                        tokenizer_dir: str | None = None, load_encoders: bool = True) -> WanVideoPipeline:
    """A tiny, randomly initialised pipeline with Wan2.2-TI2V-5B's architecture, from DiffSynth's classes.

    Same seed, same weights, on every rank. The VAE keeps the Wan2.2 class and latent width (48) with
    narrow encoder and decoder; the DiT keeps every TI2V flag.
    """
    generator_state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    try:
        pipe = WanVideoPipeline(device=device, torch_dtype=torch_dtype)
        # from_pretrained sets these (None when absent); generation's S2V unit reads them.
        pipe.audio_encoder = pipe.audio_processor = None
        pipe.dit = WanModel(**TINY_DIT)
        if load_encoders:
            pipe.vae = build_tiny_vae()
            pipe.text_encoder = WanTextEncoder(vocab=64, **TINY_TEXT_ENCODER)
            pipe.prompter.text_len = TINY_TEXT_LEN
            pipe.prompter.fetch_models(pipe.text_encoder)
            if tokenizer_dir:
                pipe.prompter.fetch_tokenizer(str(demo_tokenizer_in(Path(tokenizer_dir))))
            else:  # the tokenizer is read into memory: its files are not needed afterwards
                with tempfile.TemporaryDirectory(prefix="mbc-demo-tokenizer-") as folder:
                    pipe.prompter.fetch_tokenizer(str(demo_tokenizer_in(Path(folder))))
        pipe.height_division_factor = pipe.width_division_factor = 32
    finally:
        torch.random.set_rng_state(generator_state)
    return pipe.to(device=device, dtype=torch_dtype)


def plant_massive_activations(dit: WanModel, channels: tuple[int, ...] = (3, 40), peak: float = 80000.0,
                              gate: float = 2.0) -> float:
    """Drive a few residual channels of ``dit`` past fp16's range (65,504), as a DiT's massive activations are: every
    block's FFN writes the same value into each of ``channels`` of every token and its gate scales it by ``gate`` (the
    FFN's output rows and the time projection's gate rows for those channels zeroed, so the sum is exact), so the
    residual stream there grows by ``peak / blocks`` per block and ends at about ``peak``. Each block's FFN output and
    each add fit fp16; their sum over the blocks does not. Returns what each FFN writes. A test model: in fp16 the
    forward must keep the residual stream in fp32 to stay finite (``training/step/fp32_residual.py``)."""
    gate_chunk = 5   # DiffSynth's DiTBlock splits its modulation into shift, scale, gate (attention), shift, scale, gate
    ffn_bias = peak / (len(dit.blocks) * gate)
    rows = [gate_chunk * dit.dim + channel for channel in channels]
    with torch.no_grad():
        for block in dit.blocks:
            block.ffn[2].weight[list(channels), :] = 0
            block.ffn[2].bias[list(channels)] = ffn_bias
            block.modulation[0, gate_chunk, list(channels)] = gate
        dit.time_projection[1].weight[rows, :] = 0
        dit.time_projection[1].bias[rows] = 0
    return ffn_bias
