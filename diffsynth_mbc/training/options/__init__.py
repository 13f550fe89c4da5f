"""Options of ``python -m diffsynth_mbc.train``: defaults < preset file (--config) < command line, resolved once
into a read-only ``TrainOptions`` that travels through the whole run. No torch.

- ``run_options.py``: ``TrainOptions``, every option declared once (``declaration.py``: type, default, help, range
  or choices, kinds), and the list options' values parsed once (``flag_values.py``);
- ``parser.py``: the command line, built from the declarations;
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
from diffsynth_mbc.training.options.parser import build_parser
from diffsynth_mbc.training.options.run_options import DECLARATIONS, DEFAULTS, LISTED, TrainOptions
from diffsynth_mbc.yaml_input import load_yaml

__all__ = ["DECLARATIONS", "DEFAULTS", "MAX_SIDE", "TRACKER_PACKAGES", "TrainOptions", "build_parser",
           "check_frame_options", "check_run_id", "check_tracker", "load_preset", "resolve_options", "validate"]


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
    for key, value in data.items():
        read = DECLARATIONS[key].reader   # as the flag reads its text
        if value is not None and read is not None and not isinstance(value, bool):
            try:
                data[key] = read(value)
            except (TypeError, ValueError, argparse.ArgumentTypeError):
                raise OptionsError(f"--config: {path}: {key}: cannot read {quoted(value)} as {read.__name__}") from None
    return data


def resolve_options(argv: list[str] | None = None) -> TrainOptions:
    """Parse, merge and validate. Raises OptionsError (or SystemExit for argparse usage errors)."""
    given = vars(build_parser().parse_args(argv))
    preset = load_preset(given.pop("config")) if "config" in given else {}
    options = {**DEFAULTS, **preset, **given}
    if given.get("demo"):   # the command line's --demo beats a preset's model: the run trains the tiny one
        options.update({key: None for key in ("model_dir", "model_id") if key not in given})
    if "use_gradient_checkpointing" in given and "gradient_checkpointing" not in given:
        options["gradient_checkpointing"] = None   # the command line's true/false beats a preset's auto
    if options["gradient_checkpointing"] is None:
        options["gradient_checkpointing"] = "all" if options["use_gradient_checkpointing"] else "none"
    options["gradient_checkpointing"] = str(options["gradient_checkpointing"]).strip().lower()
    apply_datasets(options, preset, given)
    for key in LISTED:   # parsed once, here: refused naming the flag
        options[key] = DECLARATIONS[key].typed(options[key])
    validate(options)
    # Each run's own folders by default: runs that share a log or checkpoint folder corrupt each other. A preset's
    # log or checkpoint folder belongs to its output folder: an --output_path given without them takes them along.
    moved_output = "output_path" in given and given["output_path"] != preset.get("output_path")
    for key, folder in (("log_dir", DEFAULT_LOGS_FOLDER), ("checkpoint_dir", DEFAULT_CHECKPOINTS_FOLDER)):
        if not options[key] or (moved_output and key not in given):
            options[key] = str(Path(options["output_path"]) / folder)
    return TrainOptions(**options)
