"""The options a training run carries from its first line to its last: one typed, read-only object.

``TrainOptions`` names every option with its type and default (DiffSynth's names where they overlap, so the users'
flags carry over); ``resolve_options`` (``options/__init__.py``) builds it from the defaults, a preset and the
command line, once, after every check in ``options/checks.py``. No torch.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True, kw_only=True)
class TrainOptions:
    # data (DiffSynth names)
    dataset_base_path: str | None = None
    dataset_metadata_path: str | None = None
    height: int = 704
    width: int = 1280
    num_frames: int = 17
    dataset_repeat: int = 1
    dataset_num_workers: int = 2
    # several catalogues (data/dataset_list.py: Catalogue items once resolved); the keys above: one catalogue
    datasets: list | None = None
    # model
    model_dir: str | None = None
    model_id: str | None = None
    demo: bool = False
    # LoRA (DiffSynth names)
    lora_rank: int = 32
    lora_alpha: float | None = None
    lora_format: str = "comfyui"
    lora_target_modules: str = "q,k,v,o,ffn.0,ffn.2"
    lora_variant: str = "lora"
    loraplus_lr_ratio: float | None = None
    init_lora: str | None = None
    # optimisation
    learning_rate: float = 1e-4
    weight_decay: float = 0.01
    num_epochs: int = 1
    batch_size: int = 1
    gradient_accumulation_steps: int = 1
    lr_scheduler: str = "constant"
    warmup_steps: int = 0
    max_grad_norm: float = 1.0
    seed: int = 42
    mixed_precision: str = "auto"
    fp32_residual: str = "auto"   # the DiT's modulation and residual stream in fp32 (training/plan/residual_policy.py)
    max_nonfinite_steps: int = 20
    use_gradient_checkpointing: bool = True
    use_gradient_checkpointing_offload: bool = False
    gradient_checkpointing: str | None = None
    compile: str = "auto"
    image_batch_size: int | None = None
    max_timestep_boundary: float = 1.0
    min_timestep_boundary: float = 0.0
    find_unused_parameters: bool = False
    timestep_sampling: str = "diffsynth"
    timestep_shift: float = 5.0
    logit_mean: float = 0.0
    logit_std: float = 1.0
    sigmoid_scale: float = 1.0
    timestep_strata: int = 1
    loss_weighting: str = "diffsynth"
    objective: str = "modes"
    i2v_probability: float = 1.0
    # output and logging
    output_path: str = "./runs/lora"
    log_dir: str | None = None
    run_id: str | None = None
    save_steps: int | None = None
    status_interval_s: float = 5.0
    dist_backend: str | None = None
    # checkpoints, resume, stopping
    checkpoint_steps: int | None = None
    checkpoint_minutes: float | None = None
    keep_checkpoints: int = 3
    checkpoint_dir: str | None = None
    keep_old_histories: int = 3
    print_every_s: float = 30.0
    report_to: str = "none"
    resume: str | None = None
    force_resume: bool = False
    start_over: bool = False
    stop_grace_s: float = 300.0
    allow_stale_cache: bool = False
    decoder: str = "fast"
    frame_sampling: str = "head"
    source_fps: float | None = None
    short_clips: str = "shorten"
    buckets: str = "off"
    resolution_stages: str | None = None   # "832x480:0.7": 70% of the steps at that area first (data/media/stages.py)
    # bad media and validation
    max_bad_media_fraction: float = 0.01
    val_metadata_path: str | None = None
    val_base_path: str | None = None
    val_steps: int | None = None
    val_samples: int = 16
    val_timestep_quantiles: str = "0.1,0.3,0.5,0.7,0.9"
    early_stop: int | None = None     # stop after N validations in a row without improving (evaluation/best_so_far.py)
    early_stop_min_delta: float = 0.001   # an improvement: at least this much below (relative)
    health_steps: int | None = None   # LoRA health records every N optimizer steps (0: off; None: 10 for LoRA, 100
                                      # for DoRA: plan/evaluation_cost.health_cadence; evaluation/lora_health.py)
    # samples
    sample_prompts: str | None = None
    sample_steps: int | None = None
    sample_strengths: str = "1"     # comma-separated LoRA strengths (sample_prompts.parse_strengths)
    # latent cache
    cache: str | None = None
    val_cache: str | None = None
    # captions
    caption_dropout: float = 0.0
    caption_prefix: str = ""
    caption_suffix: str = ""
    # EMA of the LoRA weights (training/lora/ema.py)
    ema_decay: float | None = None
    ema_warmup: bool = True
    validate_with: str = "raw"

    def as_dict(self) -> dict:
        """Every option by name (for a preset written from these options, or a record of the run's settings)."""
        return {field.name: getattr(self, field.name) for field in dataclasses.fields(self)}

    def replace(self, **changes) -> "TrainOptions":
        """These options with some changed (the object itself never changes)."""
        return dataclasses.replace(self, **changes)


DEFAULTS = {field.name: field.default for field in dataclasses.fields(TrainOptions)}

CHOICES = {"lr_scheduler": ("constant", "cosine"), "dist_backend": (None, "nccl", "gloo"),
           "lora_format": ("comfyui", "diffsynth"), "decoder": ("fast", "diffsynth"),
           "report_to": ("none", "tensorboard", "wandb"), "mixed_precision": ("auto", "bf16", "fp16", "fp32"),
           "compile": ("auto", "on", "off"), "fp32_residual": ("auto", "on", "off"),
           "frame_sampling": ("head", "uniform", "random_window"),
           "short_clips": ("shorten", "loop", "skip"), "buckets": ("off", "aspect"),
           "timestep_sampling": ("diffsynth", "uniform", "shift", "logit_normal", "sigmoid"),
           "loss_weighting": ("diffsynth", "none"), "lora_variant": ("lora", "dora"),
           "objective": ("modes", "diffsynth")}
