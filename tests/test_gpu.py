"""GPU architecture support, precision choice and attention kernel: pure rules, and the entry points refusing."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from diffsynth_mbc.gpu import (GpuReader, MemoryPeaks, arch_problem, attention_kernel, known_gpu, resolve_precision,
                               spec_for_device)
from e2e_helpers import isolated_env

CU130_ARCHS = ["sm_75", "sm_80", "sm_86", "sm_90", "sm_100", "sm_120"]          # torch 2.11+ on PyPI
CU128_ARCHS = ["sm_70", "sm_75", "sm_80", "sm_86", "sm_90", "sm_100", "sm_120"]  # torch 2.8-2.10 on PyPI


def test_a_v100_with_a_build_without_sm_70_is_refused_with_the_fix():
    problem = arch_problem(CU130_ARCHS, (7, 0), "Tesla V100S-PCIE-32GB", "2.14.1+cu130")
    assert problem is not None
    assert "Tesla V100S-PCIE-32GB (sm_70)" in problem and "2.14.1+cu130" in problem
    assert "no kernel image is available" in problem
    assert "Fix: bash install.sh --torch volta (what the README installs with: torch==2.10.0 torchvision==0.25.0" \
        in problem and "requirements-volta.txt" in problem and "pip install" not in problem


@pytest.mark.parametrize("archs, capability", [
    (CU128_ARCHS, (7, 0)),       # the Volta build on a V100
    (CU130_ARCHS, (8, 0)),       # A100
    (["sm_80"], (8, 6)),         # sm_80 code runs on sm_86 (same major, lower minor)
    (["sm_80", "compute_80"], (9, 0)),   # PTX compiles for a newer GPU
])
def test_builds_that_run_on_the_device(archs, capability):
    assert arch_problem(archs, capability, "gpu", "x") is None


@pytest.mark.parametrize("archs, capability", [
    (["sm_75", "sm_80"], (7, 0)),  # sm_75 code does not run on sm_70
    (["sm_80"], (9, 0)),           # no PTX: Hopper cannot run sm_80 cubins
    ([], (8, 0)),                  # a CPU-only build
])
def test_builds_that_do_not(archs, capability):
    assert arch_problem(archs, capability, "gpu", "x") is not None


@pytest.mark.parametrize("choice, capability, expected", [
    ("auto", (7, 0), "fp16"), ("auto", (8, 0), "bf16"), ("auto", (9, 0), "bf16"), ("auto", None, "no"),
    ("fp32", (8, 0), "no"), ("fp16", (8, 0), "fp16"), ("bf16", (7, 0), "bf16"), ("fp32", None, "no"),
])
def test_precision_choice(choice, capability, expected):
    assert resolve_precision(choice, capability)[0] == expected


def test_auto_says_why_and_bf16_on_volta_warns():
    assert "no native bf16" in resolve_precision("auto", (7, 0))[1]
    assert "emulates it" in resolve_precision("bf16", (7, 0))[1]
    with pytest.raises(ValueError, match="fp16 needs a CUDA GPU"):
        resolve_precision("fp16", None)


def test_attention_kernel_per_gpu_and_dtype():
    assert attention_kernel((7, 0), "fp16") == "mem_efficient"
    assert attention_kernel((7, 0), "bf16") == "math"          # the V100 bf16 trap: full score matrices
    assert attention_kernel((8, 0), "bf16") == "flash"
    assert attention_kernel((8, 9), "fp16") == "flash"
    # sm90: PyTorch prefers cuDNN attention (what an H100 with torch 2.11 ran), unless its cuDNN is too old
    assert attention_kernel((9, 0), "fp16") == attention_kernel((9, 0), "bf16") == "cudnn"
    assert attention_kernel((9, 0), "bf16", cudnn_version=91002) == "flash"
    assert attention_kernel((9, 0), "no") == "mem_efficient"            # fp32: no fused low-precision kernel
    assert attention_kernel(None, "no") == "math"


def test_found_gpus_get_their_rates_by_name():
    spec, key = spec_for_device("Tesla V100S-PCIE-32GB", (7, 0), 32 << 30)
    assert key == "V100S-32GB" and spec.name == "Tesla V100S-PCIE-32GB" and spec.fp16_tflops == 130
    assert spec.tensor_tflops("fp16") == 130 and spec.tensor_tflops("bf16") == 16.4   # emulated bf16
    assert spec_for_device("Tesla V100-SXM2-16GB", (7, 0), 16 << 30)[1] == "V100-16GB"
    assert spec_for_device("Tesla V100-PCIE-32GB", (7, 0), 32 << 30)[1] == "V100-PCIe-32GB"
    assert spec_for_device("NVIDIA A100-SXM4-80GB", (8, 0), 80 << 30)[1] == "A100-80GB"
    assert spec_for_device("NVIDIA A100-PCIE-40GB", (8, 0), 40 << 30)[1] == "A100-40GB"
    assert spec_for_device("NVIDIA H100 80GB HBM3", (9, 0), 80 << 30)[1] == "H100-80GB"
    assert spec_for_device("NVIDIA H100 PCIe", (9, 0), 80 << 30)[1] == "H100-PCIe-80GB"
    assert spec_for_device("NVIDIA H200", (9, 0), 141 << 30)[1] == "H200-141GB"
    assert spec_for_device("NVIDIA L40S", (8, 9), 48 << 30)[1] == "L40S-48GB"
    assert spec_for_device("NVIDIA A10", (8, 6), 24 << 30)[1] == "A10-24GB"
    assert spec_for_device("NVIDIA GeForce RTX 4090", (8, 9), 24 << 30)[1] == "RTX4090-24GB"
    unknown, key = spec_for_device("NVIDIA B200", (10, 0), 180 << 30)
    assert key is None and unknown.fp16_tflops is None and unknown.memory_gib == 180


def test_assume_names():
    assert known_gpu("v100-32gb").memory_gib == 32 and not known_gpu("V100 32GB").native_bf16
    assert known_gpu("H100-80GB").native_bf16
    with pytest.raises(ValueError, match="known: V100-16GB"):
        known_gpu("GTX 480")


FAKE_V100 = """
import sys
from diffsynth_mbc import gpu
gpu.current_device = lambda: {"name": "Tesla V100S-PCIE-32GB", "capability": (7, 0), "memory_bytes": 32 << 30,
                              "arch_list": %r, "torch": "2.14.1+cu130", "count": 2}
from diffsynth_mbc.training.cli import main
sys.exit(main(sys.argv[1:]))
""" % CU130_ARCHS


def train(tmp_path, *flags, entry=("-m", "diffsynth_mbc.train")):
    """The training entry in a process of its own (it installs signal handling, as it does for real)."""
    return subprocess.run([sys.executable, *entry, "--dataset_base_path", str(tmp_path), "--dataset_metadata_path",
                           str(tmp_path / "m.csv"), "--output_path", str(tmp_path / "out"), "--demo", *flags],
                          capture_output=True, text=True, timeout=120, env=isolated_env(tmp_path))


@pytest.mark.slow   # starts a Python process that imports torch
def test_the_training_refuses_a_mismatched_gpu_before_anything_loads(tmp_path):
    """A fake device description (a V100 under a build without sm_70): exit 2, the fix named, status failed."""
    result = train(tmp_path, entry=("-c", FAKE_V100))
    assert result.returncode == 2, result.stderr
    assert "bash install.sh --torch volta" in result.stderr and "torch==2.10.0" in result.stderr
    state = json.loads((tmp_path / "out" / "training_logs" / "training_gpu0.json").read_text())
    assert state["status"] == "failed" and "torch==2.10.0" in state["error"]["message"]
    assert state["error"]["type"] == "UnsupportedGpuError"


@pytest.mark.slow   # starts a Python process that imports torch
def test_fp16_on_the_cpu_is_refused_naming_the_flag(tmp_path):
    """accelerate neither autocasts nor scales the loss on the CPU (its Accelerator(mixed_precision='fp16',
    cpu=True) has no scaler), so fp16 there would silently train in fp32: refused instead."""
    result = train(tmp_path, "--mixed_precision", "fp16")
    assert result.returncode == 2, result.stderr
    state = json.loads((tmp_path / "out" / "training_logs" / "training_gpu0.json").read_text())
    assert "--mixed_precision fp16 needs a CUDA GPU" in state["error"]["message"]


def test_memory_peaks_since_the_last_write_and_for_the_run():
    """Each reading is the allocator's peak since the previous one (it is reset after reading): a short checkpoint
    between two writes shows its 31 GiB, and the next quiet interval its own 10 GiB, while the run's peak stays."""
    peaks = MemoryPeaks()
    gib = 2**30
    assert peaks.fields(10 * gib, 12 * gib) == {"peak_allocated_mb": 10240, "peak_reserved_mb": 12288,
                                                "run_peak_allocated_mb": 10240, "run_peak_reserved_mb": 12288}
    assert peaks.fields(31 * gib, 33 * gib)["peak_allocated_mb"] == 31744
    later = peaks.fields(10 * gib, 33 * gib)
    assert later["peak_allocated_mb"] == 10240 and later["run_peak_allocated_mb"] == 31744
    assert later["run_peak_reserved_mb"] == 33792


def test_the_gpu_reader_reports_the_peak_since_the_previous_reading():
    """On a GPU: a 2 GiB tensor freed between two readings shows in the first one only, and in the run's peak.
    Without one: no GPU fields."""
    torch = pytest.importorskip("torch")
    reader = GpuReader()
    if not torch.cuda.is_available():
        assert reader() is None
        return
    reader()                                   # resets the allocator's peak
    block = torch.empty(2 * 2**30, dtype=torch.uint8, device="cuda")
    del block
    first = reader()
    assert first["peak_allocated_mb"] >= 2048 and first["mem_total_mb"] > 0 and first["name"]
    second = reader()
    assert second["peak_allocated_mb"] < 2048 <= second["run_peak_allocated_mb"]
