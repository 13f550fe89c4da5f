"""The LoRA training module: DiffSynth's Wan pipeline units and training loss, TI2V first-frame condition."""

from __future__ import annotations

import torch
from diffsynth.trainers.utils import DiffusionTrainingModule
from diffsynth.pipelines.wan_video_new import WanVideoPipeline


class WanTI2VLoraModule(DiffusionTrainingModule):
    """Wraps a WanVideoPipeline; only the LoRA weights injected into its DiT are trainable.

    ``forward(batch)`` takes a list of samples as DiffSynth's VideoDataset yields them
    (``{"video": [PIL frames], "prompt": str, ...}``) and returns the mean loss over the list.
    Each sample runs through the pipeline's own units (shape check, noise, VAE encode, prompt
    encode, TI2V first-frame fusion) and ``pipe.training_loss``.
    """

    def __init__(self, pipe: WanVideoPipeline, lora_target_modules: str = "q,k,v,o,ffn.0,ffn.2",
                 lora_rank: int = 32, lora_alpha: float | None = None, lora_dtype: torch.dtype = torch.float32,
                 use_gradient_checkpointing: bool = True, use_gradient_checkpointing_offload: bool = False,
                 max_timestep_boundary: float = 1.0, min_timestep_boundary: float = 0.0):
        super().__init__()
        pipe.scheduler.set_timesteps(1000, training=True)
        pipe.freeze_except([])
        pipe.dit = self.add_lora_to_model(pipe.dit, target_modules=lora_target_modules.split(","),
                                          lora_rank=lora_rank, lora_alpha=lora_alpha, upcast_dtype=lora_dtype)
        self.pipe = pipe
        self.use_gradient_checkpointing = use_gradient_checkpointing
        self.use_gradient_checkpointing_offload = use_gradient_checkpointing_offload
        self.max_timestep_boundary = max_timestep_boundary
        self.min_timestep_boundary = min_timestep_boundary

    def pipeline_inputs(self, sample: dict) -> tuple[dict, dict, dict]:
        video = sample["video"]
        height, width = video[0].size[1], video[0].size[0]
        shared = {
            "input_video": video, "input_image": video[0],  # TI2V: condition on the first frame
            "height": height, "width": width, "num_frames": len(video),
            "cfg_scale": 1, "cfg_merge": False, "tiled": False, "rand_device": self.pipe.device,
            "use_gradient_checkpointing": self.use_gradient_checkpointing,
            "use_gradient_checkpointing_offload": self.use_gradient_checkpointing_offload,
            "vace_scale": 1, "max_timestep_boundary": self.max_timestep_boundary,
            "min_timestep_boundary": self.min_timestep_boundary,
        }
        return shared, {"prompt": sample["prompt"]}, {}

    def encode(self, sample: dict) -> dict:
        """Run the pipeline units: everything the DiT needs for one sample (latents, noise, context, ...)."""
        shared, positive, negative = self.pipeline_inputs(sample)
        with torch.no_grad():
            for unit in self.pipe.units:
                shared, positive, negative = self.pipe.unit_runner(unit, self.pipe, shared, positive, negative)
        return {**shared, **positive}

    def sample_loss(self, sample: dict) -> torch.Tensor:
        inputs = self.encode(sample)
        models = {name: getattr(self.pipe, name) for name in self.pipe.in_iteration_models}
        return self.pipe.training_loss(**models, **inputs)

    def forward(self, batch: list[dict]) -> torch.Tensor:
        losses = [self.sample_loss(sample) for sample in batch]
        return torch.stack(losses).mean()

    def lora_state_dict(self, state_dict: dict | None = None) -> dict:
        """Trainable (LoRA) weights with DiffSynth's key layout: ``blocks.0.self_attn.q.lora_A.default.weight``."""
        state_dict = self.state_dict() if state_dict is None else state_dict
        return self.export_trainable_state_dict(state_dict, remove_prefix="pipe.dit.")
