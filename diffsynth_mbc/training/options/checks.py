"""Every option checked once, here: ``validate`` raises OptionsError naming the flag and the value. Each option's
choices or range come from its declaration (``run_options.py``); the rules between options are written here. The list
options were parsed (and so checked) when they were typed. No torch."""

from __future__ import annotations

import re
from pathlib import Path

from diffsynth_mbc.data.caption_rules import check_caption_options
from diffsynth_mbc.data.dataset_list import MAX_REPEAT
from diffsynth_mbc.errors import OptionsError, quoted
from diffsynth_mbc.sample_prompts import MAX_SIDE   # MAX_SIDE: pixels, each side
from diffsynth_mbc.training.lora.ema import check_options as check_ema_options
from diffsynth_mbc.training.lora.init_from_file import check_init_lora_option
from diffsynth_mbc.training.options.declaration import Declaration
from diffsynth_mbc.training.options.run_options import DECLARATIONS, DEFAULTS
from diffsynth_mbc.training.plan.recompute import parse_choice
from diffsynth_mbc.data.media.stages import check_below_final
from diffsynth_mbc.values import finite_number

# Parameters of one --timestep_sampling scheme: given with another scheme they would do nothing, so they are refused.
_SCHEME_PARAMETERS = {"timestep_shift": "shift", "logit_mean": "logit_normal", "logit_std": "logit_normal",
                      "sigmoid_scale": "sigmoid"}
# A run id names files and folders (checkpoint temp folders, tracker runs, log lines): one plain name.
_RUN_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


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


def check_value(declaration: Declaration, value) -> None:
    """One option's declared kind of value: one of its choices, or a whole number (never a bool) or a finite one
    within its range; None where the default is None. NaN and infinity are refused for every float: a NaN learning
    rate or alpha trains "fine" and writes a NaN LoRA. OptionsError naming the flag and the value."""
    if value is None and declaration.default is None:
        return
    if declaration.choices:
        if value not in declaration.choices:
            raise OptionsError(f"{declaration.flag} must be one of {', '.join(declaration.choices)}, "
                               f"got {quoted(value)}")
    elif declaration.parse is int:
        if isinstance(value, bool) or not isinstance(value, int) or value < declaration.low:
            what = "a positive integer" if declaration.low == 1 else f"an integer of {declaration.low} or more"
            raise OptionsError(f"{declaration.flag} must be {what}, got {quoted(value)}")
    elif declaration.parse is float and not _in_range(declaration, value):
        raise OptionsError(f"{declaration.flag} must be a finite number{_range_said(declaration)}, "
                           f"got {quoted(value)}")


def _in_range(declaration: Declaration, value) -> bool:
    low, high = declaration.low, declaration.high
    return finite_number(value) is not None and (
        low is None or value > low or (value == low and declaration.low_included)) and (
        high is None or value < high or (value == high and declaration.high_included))


def _range_said(declaration: Declaration) -> str:
    """`` between 0 and 1``, `` above 0``, `` at least 0 and below 1``; empty without a range."""
    low, high = declaration.low, declaration.high
    if low is not None and high is not None and declaration.low_included and declaration.high_included:
        return f" between {low:g} and {high:g}"
    parts = ([f"{'at least' if declaration.low_included else 'above'} {low:g}"] if low is not None else []) + (
        [f"{'at most' if declaration.high_included else 'below'} {high:g}"] if high is not None else [])
    return f" {' and '.join(parts)}" if parts else ""


def _check_numbers(options: dict) -> None:
    for name, declaration in DECLARATIONS.items():
        check_value(declaration, options[name])
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
    if options["sample_steps"] is not None and not options["sample_prompts"]:
        raise OptionsError("--sample_steps needs a positive number and --sample_prompts FILE")
    if options["sample_strengths"] != (1.0,) and not options["sample_prompts"]:
        raise OptionsError("--sample_strengths needs --sample_prompts FILE (the prompts it renders at each strength)")
    if options["val_steps"] and not options["val_metadata_path"]:
        raise OptionsError("--val_steps needs --val_metadata_path (metadata_val.csv from the converter); "
                           "--val_steps none trains without validation")
    if options["early_stop"] is not None and not (options["val_metadata_path"] and options["val_steps"]):
        raise OptionsError("--early_stop needs a validation to decide on: --val_metadata_path FILE and --val_steps N "
                           "(it stops after --early_stop of them in a row without improving), or --early_stop off")
    check_frame_options(options)
    check_below_final(options["resolution_stages"],   # refused naming the stage that is wrong
                      options["width"], options["height"], options["num_frames"])
    if options["lora_variant"] == "dora" and options["lora_format"] != "comfyui":
        raise OptionsError("--lora_variant dora needs --lora_format comfyui: DiffSynth's LoRA loader reads no DoRA "
                           f"magnitudes, so a {options['lora_format']} file would load at the wrong strength")
    check_init_lora_option(options)
    check_ema_options(options)
    if options["demo"] and (options["model_dir"] or options["model_id"]):
        given = " and ".join(f"--{key} {options[key]}" for key in ("model_dir", "model_id") if options[key])
        raise OptionsError(f"--demo builds a tiny random model; do not combine it with {given}")
