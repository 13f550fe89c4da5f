"""The LoRA training module: DiffSynth's Wan pipeline units and training loss, TI2V first-frame condition.

Two kinds of sample reach ``forward``: clips as DiffSynth's VideoDataset yields them (encoded on every
step by the pipeline's units) and entries of the latent cache (``{"cached": True, ...}``, see
``diffsynth_mbc.data.cache``), for which only the DiT runs; the VAE and text encoder may then be absent.
"""

from __future__ import annotations

import contextlib
from typing import Sequence

import torch
from diffsynth.trainers.utils import DiffusionTrainingModule
from diffsynth.pipelines.wan_video_new import WanVideoPipeline

from diffsynth_mbc.models.wan_units import run_units, unit_inputs
from diffsynth_mbc.training.lora.variants import add_dora
from diffsynth_mbc.training.step.batch_loss import batch_loss
from diffsynth_mbc.training.step.block_runner import BlockRunner
from diffsynth_mbc.training.step.fp32_residual import keep_residual_in_fp32
from diffsynth_mbc.training.step.lora_cast import compute_lora_in_base_dtype
from diffsynth_mbc.training.step.micro_batch import latent_frames, pixel_shape
from diffsynth_mbc.training.step.objective import (check_mode, check_objective, default_mode, first_frame_in_loss,
                                                   is_conditioned)
from diffsynth_mbc.training.step.timestep_sampling import DrawLog, TimestepSampler


DEFAULT_TARGETS = ("q", "k", "v", "o", "ffn.0", "ffn.2")


def lora_module(pipe: WanVideoPipeline, options, **step) -> "WanTI2VLoraModule":
    """The training's LoRA module over ``pipe`` as ``options`` (a ``TrainOptions``) set it: the adapter (rank, alpha,
    targets, variant), checkpointing, timestep boundaries, loss weighting and objective. ``step``: how this process
    runs a step (``recompute_blocks``, ``compile_blocks``, ``timestep_sampler``)."""
    return WanTI2VLoraModule(
        pipe, lora_target_modules=options.lora_target_modules, lora_rank=options.lora_rank,
        lora_alpha=options.lora_alpha, use_gradient_checkpointing=options.use_gradient_checkpointing,
        use_gradient_checkpointing_offload=options.use_gradient_checkpointing_offload,
        max_timestep_boundary=options.max_timestep_boundary, min_timestep_boundary=options.min_timestep_boundary,
        loss_weighting=options.loss_weighting, lora_variant=options.lora_variant, objective=options.objective, **step)


class WanTI2VLoraModule(DiffusionTrainingModule):
    """Wraps a WanVideoPipeline; only the LoRA weights injected into its DiT are trainable.

    ``forward(batch)`` takes a list of samples as DiffSynth's VideoDataset yields them
    (``{"video": [PIL frames], "prompt": str, ...}``) and returns the mean loss over the list.
    Each sample runs through the pipeline's own units (shape check, noise, VAE encode, prompt
    encode, TI2V first-frame fusion); the samples of one latent shape then go through the DiT in one
    forward with DiffSynth's objective per sample (``step.batch_loss``). The LoRA weights stay fp32 and
    compute in the DiT's dtype (``step.lora_cast``; ``lora_compute="upcast"`` keeps peft's own forward, which
    casts the activations up to the LoRA weights' fp32, for comparison; DoRA layers, ``lora_variant="dora"``, always
    compute that way); ``fp32_residual`` keeps the DiT's time embedding, modulation and residual stream in fp32 while
    its matmuls and attention run in its dtype, as Wan2.2's reference (``step.fp32_residual``); ``recompute_blocks`` of
    the DiT's blocks recompute
    their activations in backward (``None``: all of them, as DiffSynth's checkpointing does), and
    ``compile_blocks`` compiles each block. A sample with ``"cached": True``
    (from ``CachedLatentDataset``) skips the encoders: ``inputs_from_cache`` builds the same inputs from
    the stored latents and text embedding, so ``pipe.vae`` and ``pipe.text_encoder`` may be None.
    """

    def __init__(self, pipe: WanVideoPipeline, lora_target_modules: Sequence[str] = DEFAULT_TARGETS,
                 lora_rank: int = 32, lora_alpha: float | None = None, lora_dtype: torch.dtype = torch.float32,
                 use_gradient_checkpointing: bool = True, use_gradient_checkpointing_offload: bool = False,
                 max_timestep_boundary: float = 1.0, min_timestep_boundary: float = 0.0,
                 recompute_blocks: int | None = None, compile_blocks: bool = False, lora_compute: str = "base",
                 timestep_sampler: TimestepSampler | None = None, loss_weighting: str = "diffsynth",
                 lora_variant: str = "lora", objective: str = "modes", fp32_residual: bool = False):
        super().__init__()
        check_objective(objective, 1.0)
        if lora_compute not in ("base", "upcast"):
            raise ValueError(f"lora_compute must be 'base' or 'upcast', got {lora_compute!r}")
        pipe.scheduler.set_timesteps(1000, training=True)
        pipe.freeze_except([])
        if lora_variant not in ("lora", "dora"):
            raise ValueError(f"lora_variant must be 'lora' or 'dora', got {lora_variant!r}")
        inject = add_dora if lora_variant == "dora" else self.add_lora_to_model
        if isinstance(lora_target_modules, str):   # as a LoRA file's metadata names them: "q,k,v"
            lora_target_modules = lora_target_modules.split(",")
        pipe.dit = inject(pipe.dit, target_modules=list(lora_target_modules),
                          lora_rank=lora_rank, lora_alpha=lora_alpha, upcast_dtype=lora_dtype)
        if lora_compute == "base":
            compute_lora_in_base_dtype(pipe.dit)
        if fp32_residual:   # before the blocks compile: they compile with this forward
            keep_residual_in_fp32(pipe.dit)
        self.pipe = pipe
        if recompute_blocks is None:
            recompute_blocks = len(pipe.dit.blocks) if use_gradient_checkpointing else 0
        self.blocks = BlockRunner(pipe.dit.blocks, recompute_blocks, offload=use_gradient_checkpointing_offload,
                                  compile_blocks=compile_blocks)
        self.use_gradient_checkpointing = use_gradient_checkpointing
        self.use_gradient_checkpointing_offload = use_gradient_checkpointing_offload
        self.max_timestep_boundary = max_timestep_boundary
        self.min_timestep_boundary = min_timestep_boundary
        # How training draws its timesteps and weights its loss (``timestep_sampling``); what it drew and the
        # loss at each draw wait in ``draws`` for the loop's history (``take_draws``).
        self.timestep_sampler = timestep_sampler or TimestepSampler(schedule_shift=pipe.scheduler.shift)
        self.loss_weighting = loss_weighting
        # What each sample trains (training/step/objective.py): a sample's "mode" when the loop chose one, else the
        # default of its kind (an image t2i, a video i2v; everything i2v under --objective diffsynth).
        self.objective = objective
        self.draws = DrawLog()

    def scalar_inputs(self) -> dict:
        """Training switches passed to ``training_loss`` on both paths."""
        return {
            "use_gradient_checkpointing": self.use_gradient_checkpointing,
            "use_gradient_checkpointing_offload": self.use_gradient_checkpointing_offload,
            "vace_scale": 1, "max_timestep_boundary": self.max_timestep_boundary,
            "min_timestep_boundary": self.min_timestep_boundary,
        }

    def pipeline_inputs(self, sample: dict, conditioned: bool = True) -> tuple[dict, dict, dict]:
        return unit_inputs(self.pipe, sample, conditioned=conditioned, **self.scalar_inputs())

    def encode(self, sample: dict, conditioned: bool = True) -> dict:
        """Run the pipeline units: everything the DiT needs for one sample (latents, noise, context, ...); without
        the first-frame condition the image unit has no image and leaves the noise whole."""
        return run_units(self.pipe, *self.pipeline_inputs(sample, conditioned))

    def inputs_from_cache(self, sample: dict, conditioned: bool = True) -> dict:
        """What ``encode`` returns, built from a cache entry instead of running the VAE and text encoder.

        The same steps as the units, in the same order of random draws: noise of the latent shape from
        ``pipe.generate_noise`` (NoiseInitializer), then the first-frame latent written into it in place,
        which also makes it the ``latents`` (InputVideoEmbedder + ImageEmbedderFused); not ``conditioned``: the
        noise stays whole, as the units leave it without an input image.
        """
        pipe = self.pipe
        # non_blocking: the host does not wait for the GPU to finish the previous step before copying
        input_latents = sample["input_latents"].to(device=pipe.device, dtype=pipe.torch_dtype, non_blocking=True)
        if input_latents.dim() == 4:
            input_latents = input_latents.unsqueeze(0)
        first_frame = sample.get("first_frame_latents")
        first_frame = input_latents[:, :, :1] if first_frame is None else first_frame.to(
            device=pipe.device, dtype=pipe.torch_dtype, non_blocking=True).reshape(input_latents[:, :, :1].shape)
        latent_frames, latent_height, latent_width = input_latents.shape[2:]
        factor = getattr(pipe.vae, "upsampling_factor", 16) if pipe.vae is not None else 16
        shared = {
            "height": sample.get("height", latent_height * factor), "width": sample.get("width", latent_width * factor),
            "num_frames": sample.get("num_frames", (latent_frames - 1) * 4 + 1),
            "cfg_scale": 1, "cfg_merge": False, "tiled": False, "rand_device": pipe.device, "vace_context": None,
            **self.scalar_inputs(),
        }
        noise = pipe.generate_noise(tuple(input_latents.shape), seed=None, rand_device=pipe.device)
        shared.update({"noise": noise, "latents": noise, "input_latents": input_latents})
        if pipe.dit.fuse_vae_embedding_in_latents and conditioned:
            noise[:, :, 0:1] = first_frame
            shared.update({"fuse_vae_embedding_in_latents": True, "first_frame_latents": first_frame})
        context = sample["context"].to(device=pipe.device, dtype=pipe.torch_dtype, non_blocking=True)
        return {**shared, "prompt": sample.get("prompt"), "context": context if context.dim() == 3 else context[None]}

    def mode(self, sample: dict) -> str:
        """The sample's training mode: the one the loop or the validation chose, else its kind's default."""
        is_image = latent_frames(sample) == 1
        mode = sample.get("mode") or default_mode(self.objective, is_image)
        check_mode(self.objective, mode, is_image)
        return mode

    def inputs(self, sample: dict) -> dict:
        """What the DiT's objective needs for one sample, from the cache or through the pipeline's units, in the
        sample's mode (``mode`` and ``first_frame_in_loss`` ride along for ``batch_loss`` and the history)."""
        mode = self.mode(sample)
        conditioned = is_conditioned(mode)
        inputs = (self.inputs_from_cache(sample, conditioned) if sample.get("cached")
                  else self.encode(sample, conditioned))
        return {**inputs, "mode": mode, "first_frame_in_loss": first_frame_in_loss(self.objective)}

    def sample_loss(self, sample: dict, timestep_quantile: float | None = None) -> torch.Tensor:
        """The training loss of one sample; at a fixed point of the schedule when ``timestep_quantile`` is given
        (0.5: the middle timestep), so two evaluations differ only by the LoRA."""
        return self.inputs_loss(self.inputs(sample), timestep_quantile)

    def inputs_loss(self, inputs: dict, timestep_quantile: float | None = None) -> torch.Tensor:
        """``sample_loss`` from what ``inputs`` gave (left unchanged): one encoding serves every quantile."""
        if timestep_quantile is not None:   # DiffSynth draws from [min, max) boundaries: make it one timestep
            steps = self.pipe.scheduler.num_train_timesteps
            inputs = {**inputs, "min_timestep_boundary": timestep_quantile,
                      "max_timestep_boundary": timestep_quantile + 1 / steps}
        return batch_loss(self.pipe, [inputs], self.blocks)[0]

    def forward(self, batch: list[dict] | dict) -> torch.Tensor:
        """Mean loss over a list of samples; a single sample dict is what DiffSynth's own loop passes.

        Samples of one latent shape (what the shape-grouped sampler gives) share one DiT forward; a list that
        mixes shapes is run one forward per shape and weighted by the samples in each."""
        if isinstance(batch, dict):
            batch = [batch]
        groups: dict[tuple, list[dict]] = {}
        for sample in batch:
            inputs = self.inputs(sample)
            groups.setdefault(tuple(inputs["input_latents"].shape), []).append(inputs)
        if len(groups) == 1:
            return self.training_loss(next(iter(groups.values())))
        return sum(self.training_loss(group) * len(group) for group in groups.values()) / len(batch)

    def training_loss(self, group: list[dict]) -> torch.Tensor:
        """Mean loss of one same-shape group at timesteps drawn by ``timestep_sampler``; the draws are logged."""
        bounds = [(inputs.get("min_timestep_boundary", 0), inputs.get("max_timestep_boundary", 1)) for inputs in group]
        ids = self.timestep_sampler.draw_ids(self.pipe.scheduler.sigmas, bounds)
        loss, losses = batch_loss(self.pipe, group, self.blocks, ids, weighting=self.loss_weighting)
        self.draws.add(self.pipe.scheduler.timesteps[ids], losses, [inputs["mode"] for inputs in group],
                       [pixel_shape(inputs["input_latents"]) for inputs in group])
        return loss

    @contextlib.contextmanager
    def lora_disabled(self):
        """The base model for the duration (LoRA scale 0): every LoRA or DoRA layer of the DiT gives its base layer's
        output alone (peft's ``enable_adapters(False)``; a DoRA's magnitudes are left out too, so it is exactly the
        base weights' output). Each parameter's ``requires_grad``, which peft switches, is put back as it was."""
        from peft.tuners.tuners_utils import BaseTunerLayer

        layers = [layer for layer in self.pipe.dit.modules() if isinstance(layer, BaseTunerLayer)]
        trainable = [(parameter, parameter.requires_grad) for parameter in self.parameters()]
        for layer in layers:
            layer.enable_adapters(False)
        try:
            yield len(layers)
        finally:
            for layer in layers:
                layer.enable_adapters(True)
            for parameter, flag in trainable:
                parameter.requires_grad_(flag)

    def lora_state_dict(self, state_dict: dict | None = None) -> dict:
        """Trainable (LoRA) weights with DiffSynth's key layout: ``blocks.0.self_attn.q.lora_A.default.weight``."""
        state_dict = self.state_dict() if state_dict is None else state_dict
        return self.export_trainable_state_dict(state_dict, remove_prefix="pipe.dit.")
