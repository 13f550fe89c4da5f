"""The doctor's disk check: the latent cache a run builds (--cached) or reads (--cache DIR) counts against the free
space of its disk, beside the checkpoints; a finished cache adds nothing, an unfinished one what is not there yet."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from diffsynth_mbc.doctor import disk
from diffsynth_mbc.doctor.checks import FAIL, GIB, OK, WARN
from diffsynth_mbc.doctor.cli import main as doctor_main
from diffsynth_mbc.errors import OptionsError
from diffsynth_mbc.training.options import resolve_options
from catalog_helpers import write_media_metadata
from e2e_helpers import REPO, run_main

FULL = str(REPO / "configs" / "train_full.yaml")


def options_for(tmp_path, *flags):
    metadata = write_media_metadata(tmp_path / "metadata.csv", 8, 9)
    return resolve_options(["--config", FULL, "--dataset_metadata_path", str(metadata),
                            "--output_path", str(tmp_path / "runs" / "full" / "lora"), *flags])


def test_the_verdict_adds_up_what_the_folders_on_one_disk_need():
    needs = [disk.Need("runs/full/lora/checkpoints", "checkpoints", int(5.1 * GIB), "4 at a time"),
             disk.Need("runs/full/latent_cache", "latent cache", int(423.6 * GIB), "built first by --cached")]
    short = disk.disk_check(int(100 * GIB), needs)
    assert short.status == FAIL and short.detail.startswith("100.0 GiB free, needs about 428.7 GiB: ")
    assert "checkpoints 5.1 GiB in runs/full/lora/checkpoints" in short.detail
    assert "latent cache 423.6 GiB in runs/full/latent_cache (built first by --cached)" in short.detail
    assert "runs/full/latent_cache" in short.fix
    assert disk.disk_check(int(500 * GIB), needs).status == WARN    # under 1.5 x what it needs
    assert disk.disk_check(int(700 * GIB), needs).status == OK and disk.disk_check(int(700 * GIB), needs).fix == ""
    assert disk.disk_check(int(6 * GIB), needs[:1]).status == WARN   # the checkpoints alone


def test_a_cached_launch_counts_the_cache_it_builds_beside_the_output_folder(tmp_path):
    options = options_for(tmp_path)
    assert [n.what for n in disk.disk_needs(options, (8, 9), cached_launch=False)] == ["checkpoints"]
    needs = disk.disk_needs(options, (8, 9), cached_launch=True)
    cache = needs[1]
    assert (cache.what, cache.path) == ("latent cache", str(tmp_path / "runs" / "full" / "latent_cache"))
    assert cache.bytes == disk.cache_bytes(options, 8, 9) > 0 and "built first by --cached" in cache.note
    # a clip at the training size (5 latent frames) costs more than an image (one)
    assert disk.cache_bytes(options, 1, 0) > disk.cache_bytes(options, 0, 1) > 0


def test_a_cache_dir_is_counted_less_what_it_holds_and_nothing_once_finished(tmp_path):
    folder = tmp_path / "cache"
    options = options_for(tmp_path, "--cache", str(folder))
    projected = disk.cache_bytes(options, 8, 9)
    assert disk.disk_needs(options, (8, 9), cached_launch=False)[1].bytes == projected   # read: built first
    entry = folder / "entries" / "ab" / "one.safetensors"
    entry.parent.mkdir(parents=True)
    entry.write_bytes(b"\0" * 4096)
    partial = disk.disk_needs(options, (8, 9), cached_launch=False)[1]
    assert partial.bytes == projected - 4096 and "written already" in partial.note
    (folder / "cache.json").write_text("{}")
    finished = disk.disk_needs(options, (8, 9), cached_launch=True)[1]
    assert finished.bytes == 0 and "finished already" in finished.note and "nothing more to write" in finished.note


@pytest.mark.slow
def test_doctor_cached_counts_the_cache_in_the_disk_check(tmp_path):
    """`doctor --cached` on 170K rows counted 5.1 GiB of checkpoints; with `--cache DIR` it said 423.6 GiB."""
    metadata = write_media_metadata(tmp_path / "metadata.csv", 80_000, 90_180)
    flags = ["--config", FULL, "--dataset_metadata_path", str(metadata), "--output_path", str(tmp_path / "out" / "lora"),
             "--assume", "V100S-32GB", "--gpus", "2", "--quick", "--json"]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    reports = {}
    for name, extra in (("cached", ["--cached"]), ("cache", ["--cache", str(tmp_path / "cache")])):
        if name == "cached":   # the command itself
            result = subprocess.run([sys.executable, "-m", "diffsynth_mbc.doctor", *flags, *extra],
                                    capture_output=True, text=True, cwd=tmp_path, timeout=300, env=env)
        else:                  # its main in this process: the same code, without a second torch import
            result = run_main(doctor_main, [*flags, *extra], tmp_path)
        reports[name] = [c for c in json.loads(result.stdout)["checks"] if c["name"] == "disk"]
    options = resolve_options(["--config", FULL, "--dataset_metadata_path", str(metadata)])
    cache_gib = disk.cache_bytes(options, 80_000, 90_180) / GIB
    assert cache_gib > 100
    for name, checks in reports.items():
        detail = " ".join(c["detail"] for c in checks)
        assert f"latent cache {cache_gib:.1f} GiB in " in detail, (name, detail)
        assert "80,000 clips + 90,180 images" in detail
    assert str(tmp_path / "out" / "latent_cache") in " ".join(c["detail"] for c in reports["cached"])


def test_the_doctor_on_the_demo_takes_a_presets_config_and_sizes_the_tiny_models_checkpoints(tmp_path):
    """`doctor --config configs/train_test.yaml --demo` was refused ("do not combine it with --model_dir/--model_id",
    which came from the preset), and without --config the disk check asked for 5.1 GiB of checkpoints where a demo
    checkpoint is about 276 KB."""
    metadata = write_media_metadata(tmp_path / "metadata.csv", 6, 5)
    data = ["--dataset_base_path", str(tmp_path), "--dataset_metadata_path", str(metadata)]
    preset = resolve_options(["--config", str(REPO / "configs" / "train_test.yaml"), "--demo", *data])
    assert preset.demo and preset.model_dir is None and preset.model_id is None   # the command line's --demo wins
    with pytest.raises(OptionsError, match="do not combine it with --model_dir elsewhere$"):
        resolve_options(["--config", str(REPO / "configs" / "train_test.yaml"), "--demo", "--model_dir", "elsewhere",
                         *data])
    demo = resolve_options(["--demo", *data, "--output_path", str(tmp_path / "runs" / "lora")])
    full = resolve_options([*data, "--model_dir", "models/Wan2.2-TI2V-5B"])
    assert disk.checkpoint_bytes(demo) < 2 * 2**20 < GIB < disk.checkpoint_bytes(full)   # the same rank and targets
    # the same latents; each caption's embedding 32 tokens x 32 wide instead of 120 x 4096 (2 bytes a value)
    assert disk.cache_bytes(full, 6, 5) - disk.cache_bytes(demo, 6, 5) == 11 * (120 * 4096 - 32 * 32) * 2
    report = run_main(doctor_main, ["--demo", *data, "--output_path", tmp_path / "runs" / "lora", "--quick", "--json"],
                      tmp_path)
    detail, = [c["detail"] for c in json.loads(report.stdout)["checks"] if c["name"] == "disk"]
    needed = disk.checkpoint_bytes(demo) * (demo.keep_checkpoints + 1)
    assert f"checkpoints {needed / 2**20:.1f} MiB in {tmp_path / 'runs' / 'lora' / 'checkpoints'}" in detail, detail
    refused = run_main(doctor_main, ["--config", REPO / "configs" / "train_test.yaml", "--demo", *data, "--quick",
                                     "--json"], tmp_path)
    assert "do not combine" not in refused.stderr and json.loads(refused.stdout)["checks"], refused.stderr
