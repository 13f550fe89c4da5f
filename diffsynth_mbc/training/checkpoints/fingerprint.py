"""What a checkpoint must share with the run that resumes it, and what ``--force_resume`` does about the rest.
No torch.

Every checkpoint records the run's settings (``run_fingerprint``). A resume compares them with its own
(``fingerprint_differences``) and is refused, listing each difference, unless ``--force_resume true``. Some of
them (the learning rate, weight decay, schedule) would otherwise come back from the checkpoint's saved optimizer
and scheduler state and silently beat the flags given now; under ``--force_resume`` they are set from this run's
options after loading (``apply_run_settings``), so what the run says it uses is what it uses.
"""

from __future__ import annotations

import os

from diffsynth_mbc.data.media.frame_selection import frame_selection_from
from diffsynth_mbc.training.lora.ema import fingerprint as ema_fingerprint
from diffsynth_mbc.training.plan.residual_policy import decide_fp32_residual

# Settings a checkpoint must share with the run that resumes it (exact data position, weights and optimisation).
FINGERPRINT_KEYS = ("world_size", "batch_size", "gradient_accumulation_steps", "dataset_repeat", "num_frames",
                    "height", "width", "lora_rank", "lora_alpha", "lora_target_modules", "metadata_sha256",
                    "metadata_rows", "seed", "num_epochs", "cache", "image_batch_size", "dataset_base_path",
                    "learning_rate", "lr_scheduler", "warmup_steps", "weight_decay", "max_grad_norm",
                    "mixed_precision", "timestep_boundaries", "dataset_repeats", "frames", "timestep_sampling",
                    "caption_dropout", "caption_prefix", "caption_suffix", "lora_variant",
                    "loraplus_lr_ratio", "ema", "objective", "buckets", "resolution_stages", "fp32_residual")
# What a checkpoint saved before a setting existed trained with: every sample conditioned on its first frame.
# Before --buckets existed, everything trained at --height x --width; before --fp32_residual, DiffSynth's forward.
SAVED_BEFORE = {"objective": {"objective": "diffsynth", "i2v_probability": 1.0}, "buckets": "off",
                "fp32_residual": False}
TIMESTEP_SETTINGS = ("timestep_sampling", "timestep_shift", "logit_mean", "logit_std", "sigmoid_scale",
                     "timestep_strata", "loss_weighting")   # how timesteps are drawn and the loss weighted


def run_fingerprint(options, *, world_size: int, accumulation: int, rows: int, metadata_sha256: str,
                    image_batch: int, precision: str) -> dict:
    """This run's values of every FINGERPRINT_KEYS setting (JSON types, so a saved one compares equal)."""
    values = options.as_dict()
    return {
        "world_size": world_size, "batch_size": options.batch_size, "gradient_accumulation_steps": accumulation,
        "dataset_repeat": options.dataset_repeat, "num_frames": options.num_frames, "height": options.height,
        "width": options.width, "lora_rank": options.lora_rank, "lora_alpha": options.lora_alpha,
        "lora_target_modules": options.lora_target_modules, "metadata_rows": rows,
        "metadata_sha256": metadata_sha256, "seed": options.seed, "num_epochs": options.num_epochs,
        "cache": bool(options.cache), "image_batch_size": image_batch,
        # The media the metadata's relative paths point at: the same metadata over other files is other data.
        "dataset_base_path": os.path.abspath(options.dataset_base_path),
        "learning_rate": options.learning_rate, "lr_scheduler": options.lr_scheduler,
        "warmup_steps": options.warmup_steps, "weight_decay": options.weight_decay,
        "max_grad_norm": options.max_grad_norm, "mixed_precision": precision,
        "timestep_boundaries": [options.min_timestep_boundary, options.max_timestep_boundary],
        # Several catalogues: each one's repeat (the combined metadata's sha256 covers the rest); None with one.
        "dataset_repeats": [c.repeat for c in options.datasets] if options.datasets else None,
        "frames": frame_selection_from(options).settings(),   # None: the first frames (checkpoints before it match)
        "timestep_sampling": {key: values[key] for key in TIMESTEP_SETTINGS},
        "caption_dropout": options.caption_dropout, "caption_prefix": options.caption_prefix,
        "caption_suffix": options.caption_suffix,
        "lora_variant": options.lora_variant, "loraplus_lr_ratio": options.loraplus_lr_ratio,
        "ema": ema_fingerprint(options),
        "objective": {"objective": options.objective, "i2v_probability": options.i2v_probability},
        "buckets": options.buckets,   # which shape each sample trains at, and how batches are dealt
        "resolution_stages": options.resolution_stages,   # which size each step trains at
        # how the DiT computes: its residual stream in fp32 or in the model's dtype (the choice for this precision)
        "fp32_residual": decide_fp32_residual(options.fp32_residual, precision).on,
    }


def fingerprint_differences(saved: dict, current: dict, keys=FINGERPRINT_KEYS) -> list[str]:
    """Human lines for every fingerprint key whose value differs: ``world_size: checkpoint 2, this run 4``.

    A key the checkpoint did not record (saved before it was compared) is not compared, except where what such a
    checkpoint did is known (``SAVED_BEFORE``: it trained DiffSynth's objective)."""
    lines = []
    for key in keys:
        if key not in saved and (key not in SAVED_BEFORE or key not in current):
            continue
        value = saved.get(key, SAVED_BEFORE.get(key))
        if value != current.get(key):
            before = "" if key in saved else " (saved before the setting existed)"
            lines.append(f"{key}: checkpoint {value!r}{before}, this run {current.get(key)!r}")
    return lines


def apply_run_settings(scheduler, options) -> list[str]:
    """After loading a checkpoint under --force_resume: this run's learning rate, weight decay and schedule, not
    the saved optimizer's and scheduler's. The current learning rate is recomputed from this run's schedule at
    the restored step. Returns what the optimizer now uses, one line per setting."""
    from diffsynth_mbc.training.lora.variants import group_lr_ratio

    step = scheduler.last_epoch
    for index, group in enumerate(scheduler.optimizer.param_groups):
        group["weight_decay"] = options.weight_decay
        group["initial_lr"] = options.learning_rate * group_lr_ratio(group, options)   # LoRA+: lora_B's ratio
        scheduler.base_lrs[index] = group["initial_lr"]
        group["lr"] = group["initial_lr"] * scheduler.lr_lambdas[index](step)
    scheduler._last_lr = [group["lr"] for group in scheduler.optimizer.param_groups]
    return [f"learning_rate {options.learning_rate:g} with the {options.lr_scheduler} schedule and "
            f"{options.warmup_steps} warm-up steps (at step {step}: {scheduler._last_lr[0]:g})",
            f"weight_decay {options.weight_decay:g}", f"max_grad_norm {options.max_grad_norm:g}"] + (
        [f"loraplus_lr_ratio {options.loraplus_lr_ratio:g}"] if options.loraplus_lr_ratio else [])
