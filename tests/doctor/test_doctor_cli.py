"""``python -m diffsynth_mbc.doctor`` as users run it: on this machine (no GPU), and planning for a V100."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from diffsynth_mbc.data.demo import prepare
from e2e_helpers import REPO

pytestmark = pytest.mark.slow
FULL = str(REPO / "configs" / "train_full.yaml")


def doctor(*args, cwd=None):
    result = subprocess.run([sys.executable, "-m", "diffsynth_mbc.doctor", *args], capture_output=True, text=True,
                            cwd=cwd or REPO, timeout=300)
    return result.returncode, result.stdout, result.stderr


def by_name(report):
    return {c["name"]: c for c in report["checks"]}


def test_on_a_machine_without_a_gpu_it_says_so_and_checks_the_rest(tmp_path):
    root = tmp_path / "demo"
    prepare(root, num_videos=2, num_images=1)
    flags = ["--config", str(REPO / "configs" / "train_demo.yaml"), "--dataset_base_path", str(root / "catalog"),
             "--dataset_metadata_path", str(root / "metadata" / "metadata.csv"), "--output_path", str(tmp_path / "out")]
    code, out, err = doctor(*flags, "--json")
    assert code == 0, err
    report = json.loads(out)
    checks = by_name(report)
    assert report["gpu"] is None and checks["GPU"]["status"] == "warn" and "no CUDA GPU" in checks["GPU"]["detail"]
    assert checks["memory"]["status"] == "skip" and "--assume" in checks["memory"]["detail"]
    assert checks["metadata"]["status"] == "ok" and "3 rows; the first 3 decode at 64x64x9" in checks["metadata"]["detail"]
    assert checks["model files"]["status"] == "ok" and checks["ffmpeg"]["status"] == "ok"
    code, table, _ = doctor(*flags)
    assert code == 0 and "no CUDA GPU" in table and "memory" in table


def test_planning_for_a_v100_the_encode_every_step_plan_does_not_fit_and_cache_fp16_does():
    code, out, err = doctor("--config", FULL, "--assume", "V100-32GB", "--json")
    assert code == 1, err   # the memory (and here the missing metadata) fail
    report = json.loads(out)
    assert report["gpu"]["name"] == "V100-32GB" and report["gpu"]["assumed"] and not report["gpu"]["native_bf16"]
    memory = report["memory"]
    assert memory["plan"]["tokens"] == 4400 and memory["plan"]["precision"] == "fp16"   # auto on sm_70
    assert memory["plan"]["attention"] == "mem_efficient" and not memory["plan"]["cached"]
    assert not memory["fits"] and memory["total_bytes"] > memory["limit_bytes"]
    first = memory["changes_that_fit"][0]
    assert first["cached"] and first["precision"] == "fp16" and first["flags"].startswith("--cache")
    assert first["total_bytes"] < memory["limit_bytes"] / 1.5
    assert by_name(report)["memory"]["status"] == "fail" and "--cache" in by_name(report)["memory"]["fix"]
    assert report["speed"]["seconds_per_step"] > 0
    # stable: the same question gives the same plan and verdict, in the same order of keys
    again = json.loads(doctor("--config", FULL, "--assume", "V100-32GB", "--json")[1])
    assert again["memory"] == memory and list(again) == list(report) == sorted(report)


def test_an_a100_runs_the_full_preset_as_configured():
    report = json.loads(doctor("--config", FULL, "--assume", "A100-80GB", "--json")[1])
    assert report["memory"]["fits"] and report["memory"]["plan"]["precision"] == "bf16"
    assert report["memory"]["plan"]["attention"] == "flash"


def test_usage_errors_are_exit_2():
    code, _, err = doctor("--config", FULL, "--assume", "GTX-480")
    assert code == 2 and "unknown GPU 'GTX-480'" in err and "V100-32GB" in err
    code, _, err = doctor("--config", FULL, "--height", "700")
    assert code == 2 and "multiple of 32" in err
