"""One step plan, printed everywhere: the plan command's headline, its projected run length, the launchers' brief
lines and the doctor's projection all give the total of ``plan_from_options`` (the training's own plan)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

from catalog_helpers import write_media_metadata
from diffsynth_mbc.doctor.cli import main as doctor_main
from diffsynth_mbc.training.plan.command import main as plan_main
from e2e_helpers import REPO, run_main

pytestmark = pytest.mark.slow   # each test starts Python processes that import torch

FULL = str(REPO / "configs" / "train_full.yaml")
VIDEOS, IMAGES = 80_000, 90_180   # the team's 170,180-row catalogue


@pytest.fixture(scope="module")
def catalogue(tmp_path_factory):
    """A metadata.csv as `python -m diffsynth_mbc.convert` writes it (video, prompt, media_type), 170,180 rows."""
    return write_media_metadata(tmp_path_factory.mktemp("catalogue") / "metadata.csv", VIDEOS, IMAGES)


def run(module, *args, cwd):
    """``python -m MODULE`` of this checkout (PYTHONPATH), from ``cwd``."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run([sys.executable, "-m", module, *args], capture_output=True, text=True, timeout=300,
                          cwd=cwd, env=env)


def number(text: str) -> int:
    return int(text.replace(",", ""))


# (flags): the full preset as it is, and accumulation 3 with images 7 to a batch, where rounding the clips' and
# the images' steps apart (the projection's own count) gave 77,410 against the plan's 77,405.
@pytest.mark.parametrize("flags", [[], ["--gradient_accumulation_steps", "3", "--image_batch_size", "7"]])
def test_the_plan_prints_one_total_in_its_headline_and_its_projection(catalogue, tmp_path, flags):
    common = ["--config", FULL, "--dataset_metadata_path", str(catalogue), "--output_path", str(tmp_path / "out"),
              "--assume", "V100S-32GB", "--cached", *flags]
    result = run("diffsynth_mbc.plan", "--world_size", "2", *common, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    headline = [number(n) for n in re.findall(r"([\d,]+) steps in total", result.stderr)]
    projected = re.search(r"projected run length: .*?: ([\d,]+ \()?([\d,]+) video \+ ([\d,]+) image\)? optimizer "
                          r"steps per GPU", result.stderr)
    assert len(headline) == 1 and projected, result.stderr
    video, image = number(projected.group(2)), number(projected.group(3))
    assert video + image == headline[0], result.stderr          # the projection times the plan's steps
    assert number(projected.group(1).rstrip(" (")) == headline[0]   # and prints the plan's total
    # the launchers' brief lines, and the doctor's projection of the same run
    # the same commands' mains in this process (the first question above went to the command itself)
    brief = run_main(plan_main, ["--gpus", "2", "--brief", *common], tmp_path)
    assert [number(n) for n in re.findall(r"([\d,]+) steps in total", brief.stderr)] == headline, brief.stderr
    doctor = run_main(doctor_main, ["--gpus", "2", "--quick", "--json", *common], tmp_path)
    projection = json.loads(doctor.stdout)["speed"]["projection"]
    assert projection["total_steps_per_gpu"] == headline[0]
    assert projection["video_steps_per_gpu"] + projection["image_steps_per_gpu"] == headline[0]
    assert f"{headline[0]:,} ({projection['video_steps_per_gpu']:,} video + " in projection["line"]
