"""The run's options as the training resolved them, kept beside the run (``OUTPUT/run_options.json``, written by rank
0 when the run starts and again on every resume), so that what reads the run afterwards (``python -m
diffsynth_mbc.sample --validate``) measures with the run's own settings: its validation catalogue, samples, seeds
and timesteps, its size and buckets. Relative paths are kept as given, with the folder they were relative to.
No torch."""

from __future__ import annotations

import dataclasses
import json
import math
import os
from pathlib import Path

from diffsynth_mbc.atomic import atomic_write_json
from diffsynth_mbc.errors import OptionsError, quoted
from diffsynth_mbc.run_layout import RUN_OPTIONS
from diffsynth_mbc.training.options.run_options import DECLARATIONS, TrainOptions

PATH_OPTIONS = tuple(name for name, declaration in DECLARATIONS.items() if declaration.path)


def write_run_options(options: TrainOptions) -> Path:
    path = Path(options.output_path) / RUN_OPTIONS
    atomic_write_json(path, {"cwd": os.getcwd(), "options": options.recorded()}, indent=1)
    return path


def read_run_options(output_path: str | os.PathLike) -> TrainOptions | None:
    """The options a run at ``output_path`` trained with, their relative paths made absolute against the folder the
    run started in; None when the run kept none (started before they were kept). OptionsError naming the file when it
    is damaged or a value is not of its option's type."""
    from diffsynth_mbc.data.dataset_list import Catalogue

    path = Path(output_path) / RUN_OPTIONS
    if not path.is_file():
        return None
    try:
        saved = json.loads(path.read_text(encoding="utf-8"))
        values = {key: value for key, value in saved["options"].items() if key in DECLARATIONS}
        started_in = Path(saved.get("cwd") or ".")
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise OptionsError(f"{path}: damaged, it is not the run's options as the training writes them ({exc}); a "
                           "resume of the run writes it again, or move it aside and give the sweep its settings "
                           "(--demo or --model_dir, --height, --width, ...)") from None
    for key, value in values.items():   # a list option is kept as its text (read by its declaration's parser)
        if not (_of_type(value, "str | None") if DECLARATIONS[key].listed else _of_type(value, _TYPES[key])):
            raise OptionsError(f"{path}: option {key} is {quoted(value)}, not {_TYPES[key]}; the file is damaged")
    for key in PATH_OPTIONS:
        if isinstance(values.get(key), str) and values[key] and not os.path.isabs(values[key]):
            values[key] = str(started_in / values[key])
    if values.get("datasets"):
        try:
            values["datasets"] = [Catalogue(**{**item, "base_path": str(started_in / item["base_path"]),
                                               "metadata_path": str(started_in / item["metadata_path"])})
                                  for item in values["datasets"]]
        except (KeyError, TypeError) as exc:
            raise OptionsError(f"{path}: option datasets is damaged ({exc})") from None
    return TrainOptions(**values)   # its list options parsed from their text


# Each option's type as TrainOptions declares it: "int", "float | None", ...
_TYPES = {field.name: str(field.type) for field in dataclasses.fields(TrainOptions)}
_KINDS = {"int": int, "float": (int, float), "str": str, "bool": bool, "list": list}


def _of_type(value, declared: str) -> bool:
    """Whether ``value`` is of the declared type (an int for a float; never a bool for a number; finite floats)."""
    kinds = [kind.strip() for kind in declared.split("|")]
    if value is None:
        return "None" in kinds
    if isinstance(value, bool):
        return "bool" in kinds
    if isinstance(value, float) and not math.isfinite(value):
        return False
    known = [_KINDS[kind] for kind in kinds if kind in _KINDS]
    return not known or any(isinstance(value, kind) for kind in known)   # a type not listed here: not checked
