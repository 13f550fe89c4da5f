"""The run's options as the training resolved them, kept beside the run (``OUTPUT/run_options.json``, written by rank
0 when the run starts and again on every resume), so that what reads the run afterwards (``python -m
diffsynth_mbc.sample --validate``) measures with the run's own settings: its validation catalogue, samples, seeds
and timesteps, its size and buckets. Relative paths are kept as given, with the folder they were relative to.
No torch."""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

from diffsynth_mbc.atomic import atomic_write_json
from diffsynth_mbc.run_layout import RUN_OPTIONS
from diffsynth_mbc.training.options.run_options import TrainOptions

PATH_OPTIONS = ("dataset_base_path", "dataset_metadata_path", "model_dir", "sample_prompts", "cache", "val_cache",
                "val_metadata_path", "val_base_path", "output_path", "log_dir", "checkpoint_dir", "init_lora")


def write_run_options(options: TrainOptions) -> Path:
    values = options.as_dict()
    if values.get("datasets"):
        values["datasets"] = [dataclasses.asdict(item) for item in values["datasets"]]
    path = Path(options.output_path) / RUN_OPTIONS
    atomic_write_json(path, {"cwd": os.getcwd(), "options": values}, indent=1)
    return path


def read_run_options(output_path: str | os.PathLike) -> TrainOptions | None:
    """The options a run at ``output_path`` trained with, their relative paths made absolute against the folder the
    run started in; None when the run kept none (started before they were kept)."""
    from diffsynth_mbc.data.dataset_list import Catalogue

    path = Path(output_path) / RUN_OPTIONS
    if not path.is_file():
        return None
    saved = json.loads(path.read_text(encoding="utf-8"))
    values = {key: value for key, value in saved["options"].items()
              if key in {field.name for field in dataclasses.fields(TrainOptions)}}
    started_in = Path(saved.get("cwd") or ".")
    for key in PATH_OPTIONS:
        if isinstance(values.get(key), str) and values[key] and not os.path.isabs(values[key]):
            values[key] = str(started_in / values[key])
    if values.get("datasets"):
        values["datasets"] = [Catalogue(**{**item, "base_path": str(started_in / item["base_path"]),
                                           "metadata_path": str(started_in / item["metadata_path"])})
                              for item in values["datasets"]]
    return TrainOptions(**values)
