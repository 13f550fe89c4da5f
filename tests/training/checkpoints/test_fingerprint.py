"""The settings a checkpoint records (``run_fingerprint``), frozen as the code wrote them before the options were
declared once: a checkpoint written then must compare equal to the same options now, or it would not resume. Pure:
no torch, no run."""

from __future__ import annotations

import json

import pytest

from diffsynth_mbc.data.dataset_list import Catalogue
from diffsynth_mbc.training.checkpoints.fingerprint import (FINGERPRINT_KEYS, fingerprint_differences,
                                                             hardware_changes, run_fingerprint)
from diffsynth_mbc.training.options import resolve_options
from diffsynth_mbc.training.options.run_options import TrainOptions

BASE = "/data/mbc/catalog"
REQUIRED = ["--dataset_base_path", BASE, "--dataset_metadata_path", "m.csv"]
TIMESTEPS = {"timestep_sampling": "diffsynth", "timestep_shift": 5.0, "logit_mean": 0.0, "logit_std": 1.0,
             "sigmoid_scale": 1.0, "timestep_strata": 1, "loss_weighting": "diffsynth"}
# A default run's record, as checkpoint.json holds it (2 GPUs, accumulation 4, fp16).
PLAIN = {"world_size": 2, "batch_size": 1, "gradient_accumulation_steps": 4, "dataset_repeat": 1, "num_frames": 17,
         "height": 704, "width": 1280, "lora_rank": 32, "lora_alpha": None, "lora_target_modules": "q,k,v,o,ffn.0,ffn.2",
         "metadata_rows": 170180, "metadata_sha256": "ab" * 32, "seed": 42, "num_epochs": 1, "cache": False,
         "image_batch_size": 5, "dataset_base_path": BASE, "learning_rate": 0.0001, "lr_scheduler": "constant",
         "warmup_steps": 0, "weight_decay": 0.01, "max_grad_norm": 1.0, "mixed_precision": "fp16",
         "timestep_boundaries": [0.0, 1.0], "dataset_repeats": None, "frames": None, "timestep_sampling": TIMESTEPS,
         "caption_dropout": 0.0, "caption_prefix": "", "caption_suffix": "", "lora_variant": "lora",
         "loraplus_lr_ratio": None, "ema": None, "objective": {"objective": "modes", "i2v_probability": 1.0},
         "buckets": "off", "resolution_stages": None}
STAGED_FLAGS = ["--resolution_stages", "832x480x9:0.50,1024x576:0.2", "--buckets", "aspect", "--frame_sampling",
                "uniform", "--source_fps", "24", "--lora_target_modules", "q,k,v,o", "--timestep_sampling",
                "logit_normal", "--logit_std", "0.8", "--lora_alpha", "16", "--cache", "c", "--val_cache", "vc",
                "--val_metadata_path", "v.csv"]
STAGED = {**PLAIN, "lora_alpha": 16.0, "lora_target_modules": "q,k,v,o", "cache": True,
          "frames": {"sampling": "uniform", "source_fps": 24.0, "short_clips": "shorten"},
          "timestep_sampling": {**TIMESTEPS, "timestep_sampling": "logit_normal", "logit_std": 0.8},
          "buckets": "aspect", "resolution_stages": "832x480x9:0.50,1024x576:0.2"}   # the stages as they were given
SEVERAL_OPTIONS = dict(
    datasets=[Catalogue("news", "news", "news/metadata.csv"),
              Catalogue("drama", "drama", "drama/metadata.csv", 2, "mbc drama, ", "video")],
    dataset_repeat=3, dataset_base_path=BASE, dataset_metadata_path="out/datasets/metadata.csv", ema_decay=0.999,
    ema_warmup=False, validate_with="both", objective="modes", i2v_probability=0.5, lora_variant="dora",
    loraplus_lr_ratio=16.0, caption_dropout=0.1, caption_prefix="mbcstyle, ", caption_suffix=" end",
    min_timestep_boundary=0.1, max_timestep_boundary=0.9, learning_rate=2e-4, lr_scheduler="cosine", warmup_steps=100,
    weight_decay=0.0, max_grad_norm=0.5, seed=7, num_epochs=5, batch_size=2, lora_rank=16, height=480, width=832,
    num_frames=33)
SEVERAL = {**PLAIN, "batch_size": 2, "dataset_repeat": 3, "num_frames": 33, "height": 480, "width": 832,
           "lora_rank": 16, "seed": 7, "num_epochs": 5, "learning_rate": 0.0002, "lr_scheduler": "cosine",
           "warmup_steps": 100, "weight_decay": 0.0, "max_grad_norm": 0.5, "timestep_boundaries": [0.1, 0.9],
           "dataset_repeats": [1, 2], "caption_dropout": 0.1, "caption_prefix": "mbcstyle, ", "caption_suffix": " end",
           "lora_variant": "dora", "loraplus_lr_ratio": 16.0, "ema": [0.999, False],
           "objective": {"objective": "modes", "i2v_probability": 0.5}}


def fingerprint(options) -> dict:
    return run_fingerprint(options, world_size=2, accumulation=4, rows=170180, metadata_sha256="ab" * 32,
                           image_batch=5, precision="fp16")


@pytest.mark.parametrize("options,recorded", [
    (lambda: resolve_options(REQUIRED), PLAIN),
    (lambda: resolve_options(REQUIRED + STAGED_FLAGS), STAGED),
    (lambda: TrainOptions(**SEVERAL_OPTIONS), SEVERAL),
], ids=["defaults", "stages-buckets-frames-cache", "catalogues-ema-dora"])
def test_the_fingerprint_of_these_options_is_what_checkpoints_already_hold(options, recorded):
    """A setting added since (``fp32_residual``: on under fp16 by default) is compared with what such a checkpoint
    trained with (off). It is one a resume may change, as the precision and the processes are (a V100's fp16
    checkpoint goes on in bf16 on an H100): said, not refused."""
    current = fingerprint(options())
    assert current == {**recorded, "fp32_residual": True}
    assert json.loads(json.dumps(current)) == current   # what checkpoint.json gives back compares equal
    assert set(FINGERPRINT_KEYS) == set(recorded) | {"fp32_residual"}
    assert fingerprint_differences(recorded, current) == []
    assert hardware_changes(recorded, current) == [
        "fp32_residual: checkpoint False (saved before the setting existed), this run True"]
    assert hardware_changes(recorded, fingerprint(options().replace(fp32_residual="off"))) == []
    elsewhere = run_fingerprint(options(), world_size=1, accumulation=4, rows=170180, metadata_sha256="ab" * 32,
                                image_batch=5, precision="bf16")
    assert fingerprint_differences(recorded, elsewhere) == []
    assert hardware_changes(recorded, elsewhere) == [
        "world_size: checkpoint 2, this run 1", "mixed_precision: checkpoint 'fp16', this run 'bf16'",
        "fp32_residual: checkpoint False (saved before the setting existed), this run True"]


def test_a_changed_setting_is_named():
    other = fingerprint(resolve_options(REQUIRED + STAGED_FLAGS + ["--lora_target_modules", "q,k",
                                                                   "--fp32_residual", "off"]))
    assert fingerprint_differences(STAGED, other) == ["lora_target_modules: checkpoint 'q,k,v,o', this run 'q,k'"]
    assert "resolution_stages: checkpoint '832x480x9:0.50,1024x576:0.2', this run None" in fingerprint_differences(
        STAGED, fingerprint(resolve_options(REQUIRED)))
