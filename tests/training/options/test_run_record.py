"""``run_options.json``: what the training keeps beside a run, frozen as the code wrote it before the options were
declared once (``run_options_before.json``, written for the flags below), so that a run of either reads the same.
Pure: no torch, no run."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from diffsynth_mbc.training.options import resolve_options
from diffsynth_mbc.training.options.run_record import RUN_OPTIONS, read_run_options, write_run_options

BEFORE = Path(__file__).with_name("run_options_before.json")
FLAGS = ["--dataset_base_path", "catalog", "--dataset_metadata_path", "metadata/metadata.csv",
         "--resolution_stages", "832x480x9:0.50,1024x576:0.2", "--buckets", "aspect", "--lora_target_modules", "q,k,v,o",
         "--lora_alpha", "16", "--val_metadata_path", "metadata/metadata_val.csv", "--val_steps", "100",
         "--val_timestep_quantiles", "0.25,0.75", "--sample_prompts", "prompts.yaml", "--sample_strengths", "0,0.5,1",
         "--ema_decay", "0.999"]


def test_the_options_are_written_as_before(tmp_path):
    written = write_run_options(resolve_options([*FLAGS, "--output_path", str(tmp_path / "out")]))
    options = json.loads(written.read_text(encoding="utf-8"))["options"]
    before = json.loads(BEFORE.read_text(encoding="utf-8"))["options"]
    assert {key: value for key, value in options.items() if key in before and key not in (
        "output_path", "log_dir", "checkpoint_dir")} \
        == {key: value for key, value in before.items() if key not in ("output_path", "log_dir", "checkpoint_dir")}
    assert set(options) - set(before) == {"fp32_residual"}   # declared since, with its default
    assert options["fp32_residual"] == "auto"
    assert (options["val_timestep_quantiles"], options["sample_strengths"]) == ("0.25,0.75", "0,0.5,1")


def test_a_record_written_before_reads_as_the_options_it_was_written_for(tmp_path):
    shutil.copy(BEFORE, tmp_path / RUN_OPTIONS)
    read = read_run_options(tmp_path)
    resolved = resolve_options([*FLAGS, "--output_path", "out"])
    started = Path("/runs/start")
    assert read == resolved.replace(**{key: str(started / getattr(resolved, key)) for key in (
        "dataset_base_path", "dataset_metadata_path", "val_metadata_path", "sample_prompts", "output_path", "log_dir",
        "checkpoint_dir")})
    assert read.resolution_stages == resolved.resolution_stages and read.sample_strengths == resolved.sample_strengths
