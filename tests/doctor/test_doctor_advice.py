"""The doctor's advice on the team's 2 x V100S: `--gradient_checkpointing auto` when it fits and is faster (not
offloading), every V100 name in the no-GPU hint, the GPU count it assumes with --assume, and presets that already
use what it would choose."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import yaml

from catalog_helpers import write_media_metadata
from diffsynth_mbc.doctor import advice, checks
from diffsynth_mbc.doctor.checks import GIB
from diffsynth_mbc.gpu import KNOWN_GPUS, known_gpu
from diffsynth_mbc.training.options import resolve_options
from diffsynth_mbc.training.plan import estimates
from e2e_helpers import REPO

FULL = str(REPO / "configs" / "train_full.yaml")
PRESETS = [str(REPO / "configs" / name) for name in ("train_full.yaml", "train_test.yaml")]
TEAM_GPU, TEAM_GPUS = "V100S-32GB", 2
MEDIA = (80_000, 90_180)


def estimate_on_the_team_box(cached: bool):
    """The RunEstimate of some options on 2 x V100S (fp16: --mixed_precision auto on sm_70), as the doctor makes it."""
    spec = known_gpu(TEAM_GPU)
    return lambda options: estimates.estimate_run(options, spec, spec.name, "fp16", gpus=TEAM_GPUS, nodes=1,
                                                  cached_launch=cached, media=MEDIA)


def speed_check(options, cached):
    estimate = estimate_on_the_team_box(cached)
    return advice.speed_check(options, estimate(options), estimate, int(known_gpu(TEAM_GPU).memory_gib * GIB))


def test_every_block_recomputed_on_v100s_gets_auto_as_the_faster_fix():
    """All 30 blocks recomputed: 3.54 s/step; auto recomputes 12 (10 with the residual stream in fp16, which fp16's
    range does not hold) and takes 2.97 (11.2 days against 9.7)."""
    options = resolve_options(["--config", FULL, "--gradient_checkpointing", "all"])
    check = speed_check(options, cached=True)
    assert check.status == checks.WARN and "30 of 30 blocks recomputed" in check.detail
    assert check.fix.startswith("--gradient_checkpointing auto: ") and "12 of 30 blocks recomputed" in check.fix
    (flags, faster), = advice.faster_settings(options, estimate_on_the_team_box(True)(options),
                                              estimate_on_the_team_box(True), int(32 * GIB))
    slow = estimate_on_the_team_box(True)(options)
    assert flags == "--gradient_checkpointing auto"
    assert faster.speed["video"]["seconds_per_step"] < slow.speed["video"]["seconds_per_step"]
    assert faster.projection.total_seconds < slow.projection.total_seconds


@pytest.mark.slow
def test_the_doctor_table_advises_auto_and_no_offloading_when_auto_fits(tmp_path):
    """It listed `fits with --use_gradient_checkpointing_offload true` for a run that fits, and no word of auto."""
    metadata = write_media_metadata(tmp_path / "metadata.csv", 80, 90)
    env = {**os.environ, "PYTHONPATH": str(REPO), "COLUMNS": "250"}
    result = subprocess.run([sys.executable, "-m", "diffsynth_mbc.doctor", "--config", FULL, "--assume", TEAM_GPU,
                             "--gpus", "2", "--cached", "--gradient_checkpointing", "all", "--dataset_metadata_path",
                             str(metadata), "--output_path", str(tmp_path / "out"), "--quick"],
                            capture_output=True, text=True, cwd=tmp_path, timeout=300, env=env)
    assert "Traceback" not in result.stderr, result.stderr
    assert "--gradient_checkpointing auto" in result.stdout and "offload" not in result.stdout, result.stdout


def test_the_no_gpu_hint_names_every_v100_the_doctor_knows():
    check = checks.gpu_check(checks.Target(None, 0, False, [], "2.x"))
    volta = [name for name, spec in KNOWN_GPUS.items() if spec.capability == (7, 0)]
    assert "V100S-32GB" in volta and len(volta) >= 5
    assert all(name in check.fix for name in volta), check.fix


def test_with_assume_and_no_gpus_it_plans_for_the_launchers_gpu_count_and_says_so():
    settings = yaml.safe_load((REPO / "configs" / "accelerate" / "ddp.yaml").read_text())
    target = checks.find_target(TEAM_GPU, None)
    assert target.count == settings["num_processes"] // settings["num_machines"] == 2
    detail = checks.gpu_check(target).detail
    assert detail.startswith("2 x V100S-32GB assumed") and "--gpus not given" in detail
    assert "configs/accelerate/ddp.yaml" in detail
    assert checks.find_target(TEAM_GPU, 3).count == 3


@pytest.mark.parametrize("preset", PRESETS)
@pytest.mark.parametrize("cached", [True, False])
def test_the_presets_use_what_the_doctor_would_choose_on_the_team_box(preset, cached):
    options = resolve_options(["--config", preset])
    assert options.gradient_checkpointing == "auto"
    check = speed_check(options, cached)
    assert check.status == checks.OK and "no faster setting fits" in check.detail, check
    # ... and a command-line --use_gradient_checkpointing false still beats the preset's auto
    assert resolve_options(["--config", preset, "--use_gradient_checkpointing", "false"]).gradient_checkpointing == "none"
