"""Options of ``python -m diffsynth_mbc.train``: defaults < preset file (--config) < command line, resolved once
into a read-only ``TrainOptions`` that travels through the whole run. No torch.

- ``run_options.py``: ``TrainOptions``, every option with its type and default;
- ``parser.py``: the command line (flags in groups, with their help);
- ``checks.py``: every value checked once, with errors that name the flag;
- here: reading a preset (unknown keys are refused, naming the key and the file) and resolving all three.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from diffsynth_mbc.data.dataset_list import apply_datasets
from diffsynth_mbc.errors import OptionsError, clipped, quoted
from diffsynth_mbc.run_layout import DEFAULT_CHECKPOINTS_FOLDER, DEFAULT_LOGS_FOLDER
from diffsynth_mbc.training.options.checks import (MAX_SIDE, TRACKER_PACKAGES, check_frame_options, check_run_id,
                                                   check_tracker, validate)
from diffsynth_mbc.training.options.parser import _parse_bool, build_parser
from diffsynth_mbc.training.options.run_options import CHOICES, DEFAULTS, TrainOptions
from diffsynth_mbc.yaml_input import load_yaml

__all__ = ["CHOICES", "DEFAULTS", "MAX_SIDE", "TRACKER_PACKAGES", "TrainOptions", "build_parser",
           "check_frame_options", "check_run_id", "check_tracker", "load_preset", "resolve_options", "validate"]

_BOOLEAN = {key for key, value in DEFAULTS.items() if isinstance(value, bool)}


def load_preset(path: str | Path) -> dict:
    path = Path(path)
    try:
        data = load_yaml(path, "--config") or {}
    except FileNotFoundError:
        raise OptionsError(f"--config: file not found: {path}") from None
    if not isinstance(data, dict):
        raise OptionsError(f"--config: {path} must hold a mapping of option: value, got {quoted(data)}")
    unknown = sorted(map(str, set(data) - set(DEFAULTS)))
    if unknown:
        raise OptionsError(f"--config: unknown key(s) in {path}: {clipped(', '.join(unknown))}")
    types = {action.dest: action.type for action in build_parser()._actions if action.type is not None}
    for key, value in data.items():
        if value is not None and key in types and not isinstance(value, bool):
            try:
                data[key] = types[key](value)
            except (TypeError, ValueError, argparse.ArgumentTypeError):
                raise OptionsError(f"--config: {path}: {key}: cannot read {quoted(value)} as "
                                   f"{getattr(types[key], '__name__', 'a value')}") from None
    return data


def resolve_options(argv: list[str] | None = None) -> TrainOptions:
    """Parse, merge and validate. Raises OptionsError (or SystemExit for argparse usage errors)."""
    given = vars(build_parser().parse_args(argv))
    preset = load_preset(given.pop("config")) if "config" in given else {}
    options = {**DEFAULTS, **preset, **given}
    for key in _BOOLEAN:
        if not isinstance(options[key], bool):
            options[key] = _parse_bool(options[key])
    if "use_gradient_checkpointing" in given and "gradient_checkpointing" not in given:
        options["gradient_checkpointing"] = None   # the command line's true/false beats a preset's auto
    if options["gradient_checkpointing"] is None:
        options["gradient_checkpointing"] = "all" if options["use_gradient_checkpointing"] else "none"
    options["gradient_checkpointing"] = str(options["gradient_checkpointing"]).strip().lower()
    apply_datasets(options, preset, given)
    validate(options)
    # Each run's own folders by default: runs that share a log or checkpoint folder corrupt each other.
    if not options["log_dir"]:
        options["log_dir"] = str(Path(options["output_path"]) / DEFAULT_LOGS_FOLDER)
    if not options["checkpoint_dir"]:
        options["checkpoint_dir"] = str(Path(options["output_path"]) / DEFAULT_CHECKPOINTS_FOLDER)
    return TrainOptions(**options)
