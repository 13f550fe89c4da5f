"""What a checkpoint must share with the run that resumes it, and what ``--force_resume`` does about the rest.
No torch.

Every checkpoint records the run's settings (``run_fingerprint``). A resume compares them with its own
(``fingerprint_differences``) and is refused, listing each difference, unless ``--force_resume true``. Some of
them (the learning rate, weight decay, schedule) would otherwise come back from the checkpoint's saved optimizer
and scheduler state and silently beat the flags given now; under ``--force_resume`` they are set from this run's
options after loading (``apply_run_settings``), so what the run says it uses is what it uses; when the plan then
ends at another step than this run's total (the checkpoint's steps were counted under its plan), the schedule runs
to that step (``checkpoints/resume.go_on_with_this_plan``). What a resume may change (``MAY_CHANGE``: the processes,
the precision) is said, not refused.
"""

from __future__ import annotations

import os

from diffsynth_mbc.data.media.frame_selection import frame_selection_from
from diffsynth_mbc.training.lora.ema import fingerprint as ema_fingerprint
from diffsynth_mbc.training.options.run_options import DECLARATIONS
from diffsynth_mbc.training.plan.residual_policy import decide_fp32_residual

# Settings a checkpoint must share with the run that resumes it (exact data position, weights and optimisation): the
# options declared part of it (``fingerprint=True``, as a preset holds them), and what ``run_fingerprint`` works out.
OPTION_KEYS = tuple(name for name, declaration in DECLARATIONS.items() if declaration.fingerprint)
FINGERPRINT_KEYS = OPTION_KEYS + (
    "world_size", "gradient_accumulation_steps", "metadata_sha256", "metadata_rows", "cache", "image_batch_size",
    "dataset_base_path", "mixed_precision", "timestep_boundaries", "dataset_repeats", "frames", "timestep_sampling",
    "ema", "objective", "fp32_residual")
# What a checkpoint saved before a setting existed trained with: every sample conditioned on its first frame.
# Before --buckets existed, everything trained at --height x --width; before --fp32_residual, DiffSynth's forward.
SAVED_BEFORE = {"objective": {"objective": "diffsynth", "i2v_probability": 1.0}, "buckets": "off",
                "fp32_residual": False}
# What a resume may change, said but not refused: the processes it runs on (training/plan/elastic.py: the epoch goes on
# over this run's processes) and the precision (the LoRA and AdamW's state are fp32 either way; the residual stream
# follows the precision, training/plan/residual_policy.py).
MAY_CHANGE = ("world_size", "mixed_precision", "fp32_residual")
COMPARED_KEYS = tuple(key for key in FINGERPRINT_KEYS if key not in MAY_CHANGE)
TIMESTEP_SETTINGS = ("timestep_sampling", "timestep_shift", "logit_mean", "logit_std", "sigmoid_scale",
                     "timestep_strata", "loss_weighting")   # how timesteps are drawn and the loss weighted


def run_fingerprint(options, *, world_size: int, accumulation: int, rows: int, metadata_sha256: str,
                    image_batch: int, precision: str) -> dict:
    """This run's values of every FINGERPRINT_KEYS setting (JSON types, so a saved one compares equal)."""
    values = options.as_dict()
    return {
        **{key: DECLARATIONS[key].recorded(values[key]) for key in OPTION_KEYS},   # a list option: as given
        "world_size": world_size, "gradient_accumulation_steps": accumulation, "metadata_rows": rows,
        "metadata_sha256": metadata_sha256, "cache": bool(options.cache), "image_batch_size": image_batch,
        # The media the metadata's relative paths point at: the same metadata over other files is other data.
        "dataset_base_path": os.path.abspath(options.dataset_base_path), "mixed_precision": precision,
        "timestep_boundaries": [options.min_timestep_boundary, options.max_timestep_boundary],
        # Several catalogues: each one's repeat (the combined metadata's sha256 covers the rest); None with one.
        "dataset_repeats": [c.repeat for c in options.datasets] if options.datasets else None,
        "frames": frame_selection_from(options).settings(),   # None: the first frames (checkpoints before it match)
        "timestep_sampling": {key: values[key] for key in TIMESTEP_SETTINGS},
        "ema": ema_fingerprint(options),
        "objective": {"objective": options.objective, "i2v_probability": options.i2v_probability},
        # how the DiT computes: its residual stream in fp32 or in the model's dtype (the choice for this precision)
        "fp32_residual": decide_fp32_residual(options.fp32_residual, precision).on,
    }


def fingerprint_differences(saved: dict, current: dict, keys=COMPARED_KEYS) -> list[str]:
    """Human lines for every fingerprint key whose value differs: ``lora_rank: checkpoint 32, this run 16``.

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


def hardware_changes(saved: dict, current: dict) -> list[str]:
    """What a resume changes that it may (``MAY_CHANGE``): ``world_size: checkpoint 2, this run 1``."""
    return fingerprint_differences(saved, current, MAY_CHANGE)


def sharded_optimizer_refusal(folder, manifest: dict, world_size: int) -> str | None:
    """Why a checkpoint of DeepSpeed ZeRO-2 (its AdamW state sharded over the processes that saved it, in
    ``*optim_states.pt`` files) cannot resume on another number of processes, and what to do; None when it can."""
    saved = manifest.get("world_size")
    if not saved or saved == world_size or not any("optim_states" in name for name in manifest.get("files") or {}):
        return None
    return (f"{folder} was saved by {saved} DeepSpeed ZeRO-2 processes, whose optimizer state is sharded {saved} ways; "
            f"this run has {world_size}. Resume it on {saved} processes (--gpus), or start a new run from its LoRA "
            f"with --init_lora {folder} (a fresh optimizer), or train with DDP (no --deepspeed), whose checkpoints "
            "resume on any number of GPUs")


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
