"""``python -m diffsynth_mbc.doctor`` as users run it: on this machine (no GPU), and planning for a V100.

A GPU-less check and a usage error go to the command in a process of its own; the other questions call its ``main``
in this process (the same code, without a Python start-up and torch's import per question)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from catalog_helpers import write_media_metadata
from diffsynth_mbc.data.demo import prepare
from diffsynth_mbc.doctor.cli import main as doctor_main
from diffsynth_mbc.training.plan import run_length
from e2e_helpers import REPO, run_main

pytestmark = pytest.mark.slow
FULL = str(REPO / "configs" / "train_full.yaml")


def doctor_command(*args):
    """The command in a process of its own, from the repository: (exit status, stdout, stderr)."""
    result = subprocess.run([sys.executable, "-m", "diffsynth_mbc.doctor", *args], capture_output=True, text=True,
                            cwd=REPO, timeout=300)
    return result.returncode, result.stdout, result.stderr


def doctor(*args):
    """The command's ``main`` in this process, from the repository: (exit status, stdout, stderr)."""
    result = run_main(doctor_main, args, REPO)
    return result.returncode, result.stdout, result.stderr


def by_name(report):
    return {c["name"]: c for c in report["checks"]}


def test_on_a_machine_without_a_gpu_it_says_so_and_checks_the_rest(tmp_path):
    root = tmp_path / "demo"
    prepare(root, num_videos=2, num_images=1)
    flags = ["--config", str(REPO / "configs" / "train_demo.yaml"), "--dataset_base_path", str(root / "catalog"),
             "--dataset_metadata_path", str(root / "metadata" / "metadata.csv"), "--output_path", str(tmp_path / "out")]
    code, out, err = doctor_command(*flags, "--json")
    assert code == 0, err
    report = json.loads(out)
    checks = by_name(report)
    assert report["gpu"] is None and checks["GPU"]["status"] == "warn" and "no CUDA GPU" in checks["GPU"]["detail"]
    assert checks["memory"]["status"] == "skip" and "--assume" in checks["memory"]["detail"]
    assert checks["metadata"]["status"] == "ok"
    assert "3 rows (2 videos, 1 images); the first 3 decode at 64x64x9" in checks["metadata"]["detail"]
    assert report["speed"] == {"unknown": "no GPU: the speed model covers GPUs (plan with --assume NAME, or measure "
                                          "this machine with --probe N)"}
    assert checks["model files"]["status"] == "ok" and checks["ffmpeg"]["status"] == "ok"
    code, table, _ = doctor(*flags)
    assert code == 0 and "no CUDA GPU" in table and "memory" in table


def test_planning_for_a_v100_without_recomputation_it_does_not_fit_and_says_what_does():
    """The command that crashed with TypeError (two suggestions both set the checkpointing)."""
    code, out, err = doctor("--config", FULL, "--assume", "V100-32GB", "--use_gradient_checkpointing", "false",
                            "--json")
    assert code == 1 and "Traceback" not in err, err   # the memory (and here the missing metadata) fail
    report = json.loads(out)
    assert report["gpu"]["name"] == "V100-32GB" and report["gpu"]["assumed"] and not report["gpu"]["native_bf16"]
    memory = report["memory"]
    assert memory["plan"]["precision"] == "fp16"   # auto on sm_70
    # the preset's --buckets aspect without rows to read: sized for the largest of its buckets (30 x 30 cells)
    assert memory["plan"]["tokens"] == 5 * 900 and memory["bucket"] == "960x960"
    assert memory["plan"]["attention"] == "mem_efficient" and not memory["plan"]["cached"]
    assert memory["plan"]["recomputed_blocks"] == 0 and memory["plan"]["compiled"]    # compile auto: on
    assert not memory["fits"] and memory["total_bytes"] > memory["limit_bytes"]
    first, second = memory["changes_that_fit"][:2]   # the fewest recomputed blocks that fit, then all of them
    assert first["flags"] == "--gradient_checkpointing auto" and first["total_bytes"] < memory["limit_bytes"]
    assert second["flags"] == "--gradient_checkpointing all" and second["total_bytes"] < first["total_bytes"]
    assert by_name(report)["memory"]["status"] == "fail"
    assert "--gradient_checkpointing auto" in by_name(report)["memory"]["fix"]
    assert not any("offload" in change["flags"] for change in memory["changes_that_fit"])
    assert report["speed"]["video"]["seconds_per_step"] > 0 and report["speed"]["video"]["kind"] == "estimate"
    assert "projection" not in report["speed"]   # no metadata, no run length
    # stable: the same question gives the same plan and verdict, in the same order of keys
    again = json.loads(doctor("--config", FULL, "--assume", "V100-32GB", "--use_gradient_checkpointing", "false",
                              "--json")[1])
    assert again["memory"] == memory and list(again) == list(report) == sorted(report)


def test_auto_checkpointing_speed_and_run_length_for_the_full_run_on_two_v100s(tmp_path):
    metadata = write_media_metadata(tmp_path / "metadata.csv", 800, 900)
    code, out, err = doctor("--config", FULL, "--assume", "V100S-32GB", "--gpus", "2", "--cached",
                            "--gradient_checkpointing", "auto", "--dataset_metadata_path", str(metadata), "--json")
    report = json.loads(out)
    assert report["media"] == {"videos": 800, "images": 900}
    memory = report["memory"]
    assert memory["fits"] and memory["plan"]["cached"] and 0 < memory["plan"]["recomputed_blocks"] < 30
    assert any(a.startswith("gradient checkpointing auto: ") for a in report["assumptions"])
    speed = report["speed"]
    assert speed["rates_from"] == "V100S-32GB" and speed["video"]["kind"] == speed["image"]["kind"] == "estimate"
    assert any("scaled to V100S-32GB" in source for source in speed["video"]["sources"])
    projected = speed["projection"]
    assert projected["video_steps_per_gpu"] == 5 * 400 and projected["image_steps_per_gpu"] == 5 * 90
    assert projected["cache_build_seconds"] > 0 and projected["line"].startswith("projected run length: ")
    code, table, _ = doctor("--config", FULL, "--assume", "V100S-32GB", "--gpus", "2", "--cached",
                            "--dataset_metadata_path", str(metadata))
    assert "projected run length:" in table and "0.0 days" not in table and "scaled to V100S-32GB" in table
    # the cache build, the longest wait before the first step, on a line of its own, said to be an estimate
    cache_line = projected["cache_line"]
    assert cache_line.startswith(f"latent cache build: {run_length.duration(projected['cache_build_seconds'])} "
                                 "(estimate), before the first step: 400 clips x ")
    assert " + 450 images x " in cache_line and " per GPU, 2 GPU(s) in parallel" in cache_line
    assert "\nlatent cache build: " in table.replace("\n\n", "\n")
    code, table, _ = doctor("--config", FULL, "--assume", "V100S-32GB", "--gpus", "2",
                            "--dataset_metadata_path", str(metadata))
    assert "projected run length:" in table and "latent cache build" not in table   # nothing to build


def test_an_a100_runs_the_full_preset_as_configured_and_an_h100_gets_cudnn_attention():
    report = json.loads(doctor("--config", FULL, "--assume", "A100-80GB", "--json")[1])
    assert report["memory"]["fits"] and report["memory"]["plan"]["precision"] == "bf16"
    assert report["memory"]["plan"]["attention"] == "flash"
    report = json.loads(doctor("--config", FULL, "--assume", "H100-80GB", "--json")[1])
    assert report["memory"]["plan"]["attention"] == "cudnn"
    # the preset's --gradient_checkpointing auto: on 80 GB no block needs recomputing
    assert report["speed"]["video"]["sources"][0].startswith("H100 LoRA in the training precision, compiled, 0 of "
                                                             "30 blocks recomputed, cudnn attention: 0.27 s measured")


def test_usage_errors_are_exit_2():
    code, _, err = doctor_command("--config", FULL, "--assume", "GTX-480")
    assert code == 2 and "unknown GPU 'GTX-480'" in err and "V100-32GB" in err
    code, _, err = doctor("--config", FULL, "--height", "700")
    assert code == 2 and "multiple of 32" in err
    code, _, err = doctor("--config", FULL, "--assume", "V100-32GB", "--probe", "3")
    assert code == 2 and "--probe measures this machine" in err
    code, _, err = doctor("--config", FULL, "--assume", "V100-32GB", "--gradient_checkpointing", "45")
    assert code == 2 and "--gradient_checkpointing 45: the DiT has 30 blocks" in err, err   # the training's own error


def test_under_aspect_buckets_the_first_rows_decode_at_their_buckets_and_it_says_so(tmp_path):
    """The demo's square media at a 160x96 area go to the 128x128 bucket: the doctor names what decoded, not
    --width x --height (it said "decode at 160x96x9" of rows that train at 128x128)."""
    root = tmp_path / "demo"
    prepare(root, num_videos=2, num_images=1)
    flags = ["--config", str(REPO / "configs" / "train_demo.yaml"), "--dataset_base_path", str(root / "catalog"),
             "--dataset_metadata_path", str(root / "metadata" / "metadata.csv"), "--output_path", str(tmp_path / "out"),
             "--buckets", "aspect", "--height", "96", "--width", "160", "--json"]
    code, out, err = doctor(*flags)
    assert code == 0, err
    detail = by_name(json.loads(out))["metadata"]["detail"]
    assert detail.endswith("the first 3 decode at 128x128x9, 128x128x1 (their aspect buckets)"), detail
