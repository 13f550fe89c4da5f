"""Every option checked once, here: ``validate`` raises OptionsError naming the flag and the value. No torch."""

from __future__ import annotations

import math
import re
from pathlib import Path

from diffsynth_mbc.data.caption_rules import check_caption_options
from diffsynth_mbc.data.dataset_list import MAX_REPEAT
from diffsynth_mbc.errors import OptionsError, quoted
from diffsynth_mbc.sample_prompts import MAX_SIDE, parse_strengths   # MAX_SIDE: pixels, each side
from diffsynth_mbc.training.lora.ema import check_options as check_ema_options
from diffsynth_mbc.training.lora.init_from_file import check_init_lora_option
from diffsynth_mbc.training.options.run_options import CHOICES as _CHOICES, DEFAULTS
from diffsynth_mbc.training.plan.recompute import parse_choice
from diffsynth_mbc.data.media.stages import check_below_final, parse_stages
from diffsynth_mbc.values import finite_number

# Every number the training reads, checked here and nowhere else: (lowest, highest, lowest allowed?, highest allowed?).
# NaN and infinity are refused for every float: a NaN learning rate or alpha trains "fine" and writes a NaN LoRA.
_INTEGERS = {   # key: (lowest, optional)
    "height": (1, False), "width": (1, False), "num_frames": (1, False), "dataset_repeat": (1, False),
    "lora_rank": (1, False), "num_epochs": (1, False), "batch_size": (1, False),
    "gradient_accumulation_steps": (1, False), "max_nonfinite_steps": (1, False), "keep_checkpoints": (1, False),
    "val_samples": (1, False), "dataset_num_workers": (0, False), "warmup_steps": (0, False),
    "keep_old_histories": (0, False), "seed": (0, False), "image_batch_size": (1, True), "save_steps": (1, True),
    "checkpoint_steps": (1, True), "val_steps": (1, True), "sample_steps": (1, True), "timestep_strata": (1, False),
    "health_steps": (0, True),
}
_FLOATS = {     # key: (low, high, low included, optional)
    "learning_rate": (0.0, None, False, False), "lora_alpha": (0.0, None, False, True),
    "weight_decay": (0.0, None, True, False), "max_grad_norm": (0.0, None, True, False),
    "status_interval_s": (0.0, None, False, False), "print_every_s": (0.0, None, False, False),
    "stop_grace_s": (0.0, None, False, False), "checkpoint_minutes": (0.0, None, False, True),
    "max_bad_media_fraction": (0.0, 1.0, True, False), "early_stop_min_delta": (0.0, 1.0, True, False),
    "source_fps": (0.0, None, False, True),
    "min_timestep_boundary": (0.0, 1.0, True, False), "max_timestep_boundary": (0.0, 1.0, True, False),
    "timestep_shift": (0.0, None, False, False), "logit_mean": (-math.inf, None, False, False),
    "logit_std": (0.0, None, False, False), "sigmoid_scale": (0.0, None, False, False),
    "caption_dropout": (0.0, 1.0, True, False), "i2v_probability": (0.0, 1.0, True, False),
    "loraplus_lr_ratio": (0.0, None, False, True),
}
# The numbers a run may leave unset (None: off, or the default the help names); a preset's value is cleared with none.
OPTIONAL_NUMBERS = frozenset([key for key, (_, optional) in _INTEGERS.items() if optional]
                             + [key for key, (*_, optional) in _FLOATS.items() if optional])
# Parameters of one --timestep_sampling scheme: given with another scheme they would do nothing, so they are refused.
_SCHEME_PARAMETERS = {"timestep_shift": "shift", "logit_mean": "logit_normal", "logit_std": "logit_normal",
                      "sigmoid_scale": "sigmoid"}
# A run id names files and folders (checkpoint temp folders, tracker runs, log lines): one plain name.
_RUN_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
_TARGET_MODULE = re.compile(r"^[A-Za-z0-9_]+(\.[A-Za-z0-9_]+)*$")


# --report_to: the packages accelerate starts each tracker with (any one of them) and how to install them. A tracker
# accelerate cannot start is dropped with one warning in the log and the run trains on untracked: refused instead.
TRACKER_PACKAGES = {"tensorboard": (("tensorboard", "tensorboardX"), "pip install -e '.[tensorboard]'"),
                    "wandb": (("wandb",), "pip install wandb")}


def check_tracker(name: str) -> None:
    """The --report_to tracker's package is installed (looked up, not imported: no torch here)."""
    import importlib.util

    if name not in TRACKER_PACKAGES:
        return
    packages, install = TRACKER_PACKAGES[name]
    if not any(importlib.util.find_spec(package) is not None for package in packages):
        raise OptionsError(f"--report_to {name} needs the {packages[0]} package, which is not installed here: "
                           f"{install} (or leave --report_to out)")


def check_run_id(value, source: str = "--run_id") -> None:
    """A run id is one plain name: letters, digits, '.', '_', '-', starting with a letter or digit."""
    if not isinstance(value, str) or not _RUN_ID.match(value):
        raise OptionsError(f"{source} must be one plain name (letters, digits, '.', '_', '-', starting with a letter "
                           f"or digit, at most 128 characters; no '/' or '..'), got {quoted(value)}")


def _check_numbers(options: dict) -> None:
    for key, (lowest, optional) in _INTEGERS.items():
        value = options[key]
        if value is None and optional:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < lowest:
            what = "a positive integer" if lowest == 1 else "an integer of 0 or more"
            raise OptionsError(f"--{key} must be {what}, got {quoted(value)}")
    for key, (low, high, low_included, optional) in _FLOATS.items():
        value = options[key]
        if value is None and optional:
            continue
        below = finite_number(value) is None or value < low or (value == low and not low_included)
        if below or (high is not None and value > high):
            bound = f"{'at least' if low_included else 'above'} {low:g}"
            if high is not None:
                bound = f"between {low:g} and {high:g}"
            raise OptionsError(f"--{key} must be a finite number {bound}, got {quoted(value)}")
    if options["dataset_repeat"] > MAX_REPEAT:
        catalogue = "each catalogue of --datasets" if options.get("datasets") else options["dataset_metadata_path"]
        raise OptionsError(f"--dataset_repeat {options['dataset_repeat']:,} is above {MAX_REPEAT:,}, the most a "
                           f"catalogue ({catalogue}) is repeated per epoch; train more epochs (--num_epochs) instead")
    steps = 1000   # DiffSynth's training schedule: a timestep is drawn from [int(min * 1000), int(max * 1000))
    if int(options["min_timestep_boundary"] * steps) >= int(options["max_timestep_boundary"] * steps):
        raise OptionsError(f"--min_timestep_boundary ({options['min_timestep_boundary']:g}) must be below "
                           f"--max_timestep_boundary ({options['max_timestep_boundary']:g}) by at least 1/{steps}, "
                           "so there is a timestep to draw")


def _check_names(options: dict) -> None:
    if options["run_id"] is not None:
        check_run_id(options["run_id"])
    targets = options["lora_target_modules"]
    if not isinstance(targets, str) or not all(_TARGET_MODULE.match(name) for name in targets.split(",")):
        raise OptionsError(f"--lora_target_modules must be a comma-separated list of module names (q,k,v,o,ffn.0, "
                           f"...), got {quoted(targets)}")
    for key, allowed in _CHOICES.items():
        if options[key] not in allowed:
            raise OptionsError(f"--{key} must be one of {', '.join(str(a) for a in allowed if a)}, "
                               f"got {quoted(options[key])}")
    for key in ("output_path", "log_dir", "checkpoint_dir"):
        if options[key] and Path(options[key]).exists() and not Path(options[key]).is_dir():
            raise OptionsError(f"--{key} {options[key]} is a file, not a folder")
    check_tracker(options["report_to"])
    caption_problem = check_caption_options(options)
    if caption_problem:
        raise OptionsError(caption_problem)
    parse_choice(options["gradient_checkpointing"])


def check_frame_options(options: dict) -> None:
    """A random window is drawn anew every epoch: no latent cache can hold it."""
    if options["frame_sampling"] == "random_window":
        for key in ("cache", "val_cache"):
            if options[key]:
                raise OptionsError(f"--frame_sampling random_window cannot train from --{key} {options[key]}: its "
                                   "frames are drawn anew every epoch, and a latent cache holds one set of frames per "
                                   "clip; use head or uniform with a cache, or train from the media files")


def _check_objective(options: dict) -> None:
    """--i2v_probability chooses between the modes of --objective modes; with diffsynth it would do nothing."""
    if options["objective"] == "diffsynth" and options["i2v_probability"] != DEFAULTS["i2v_probability"]:
        raise OptionsError(f"--i2v_probability {options['i2v_probability']:g} applies to --objective modes only, and "
                           "this run uses --objective diffsynth (every sample conditioned on its first frame)")


def _check_timestep_parameters(options: dict) -> None:
    for key, scheme in _SCHEME_PARAMETERS.items():
        if options[key] != DEFAULTS[key] and options["timestep_sampling"] != scheme:
            raise OptionsError(f"--{key} {options[key]:g} applies to --timestep_sampling {scheme} only, and this run "
                               f"uses --timestep_sampling {options['timestep_sampling']}")


def validate(options: dict) -> None:
    """Every option checked once, here; OptionsError names the flag and the value."""
    _check_numbers(options)
    _check_names(options)
    _check_timestep_parameters(options)
    _check_objective(options)
    for key in ("height", "width"):
        if options[key] > MAX_SIDE:
            raise OptionsError(f"--{key} {options[key]} is above {MAX_SIDE}, the largest side this trains "
                               "(Wan2.2-TI2V-5B was trained at 1280x704)")
        if options[key] % 32:
            raise OptionsError(f"--{key} must be a multiple of 32 (Wan2.2 VAE x DiT patch), got {options[key]}")
    if options["num_frames"] % 4 != 1:
        raise OptionsError(f"--num_frames must be 4k+1 (1, 5, 9, 13, 17, ...), got {options['num_frames']}")
    if not options["dataset_metadata_path"]:
        raise OptionsError("--dataset_metadata_path is required (metadata.csv from `python -m diffsynth_mbc.convert`)")
    if options["dataset_base_path"] is None:
        raise OptionsError("--dataset_base_path is required (the folder metadata paths are relative to)")
    try:
        quantiles = [float(q) for q in str(options["val_timestep_quantiles"]).split(",")]
    except ValueError:
        quantiles = []
    if not quantiles or not all(0 <= q < 1 for q in quantiles):
        raise OptionsError("--val_timestep_quantiles must be comma-separated numbers in [0, 1), got "
                           f"{quoted(options['val_timestep_quantiles'])}")
    if options["sample_steps"] is not None and not options["sample_prompts"]:
        raise OptionsError("--sample_steps needs a positive number and --sample_prompts FILE")
    if parse_strengths(options["sample_strengths"]) != [1.0] and not options["sample_prompts"]:
        raise OptionsError("--sample_strengths needs --sample_prompts FILE (the prompts it renders at each strength)")
    if options["val_steps"] and not options["val_metadata_path"]:
        raise OptionsError("--val_steps needs --val_metadata_path (metadata_val.csv from the converter); "
                           "--val_steps none trains without validation")
    if options["early_stop"] is not None and not (options["val_metadata_path"] and options["val_steps"]):
        raise OptionsError("--early_stop needs a validation to decide on: --val_metadata_path FILE and --val_steps N "
                           "(it stops after --early_stop of them in a row without improving), or --early_stop off")
    check_frame_options(options)
    check_below_final(parse_stages(options["resolution_stages"]),   # refused naming the stage that is wrong
                      options["width"], options["height"], options["num_frames"])
    if options["lora_variant"] == "dora" and options["lora_format"] != "comfyui":
        raise OptionsError("--lora_variant dora needs --lora_format comfyui: DiffSynth's LoRA loader reads no DoRA "
                           f"magnitudes, so a {options['lora_format']} file would load at the wrong strength")
    check_init_lora_option(options)
    check_ema_options(options)
    if options["demo"] and (options["model_dir"] or options["model_id"]):
        given = " and ".join(f"--{key} {options[key]}" for key in ("model_dir", "model_id") if options[key])
        raise OptionsError(f"--demo builds a tiny random model; do not combine it with {given}")
