"""What a GPU can do for this training: architecture support of the installed torch, precision, attention kernel;
and what it is using (the status file's ``gpu`` fields, with the allocator's peaks).

Pure logic over plain values (a capability tuple, an arch list, allocator byte counts), so it is tested
without a GPU; the few functions that ask torch import it inside. Used by the training and cache entry
points (refuse to start on a torch build without the device's kernels), by the training's status file and
by ``python -m diffsynth_mbc.doctor``.
"""

from __future__ import annotations

import dataclasses
import re

PRECISIONS = ("auto", "bf16", "fp16", "fp32")
VOLTA_TORCH = "torch==2.10.0 torchvision==0.25.0"   # newest PyPI wheels (CUDA 12.8) that still ship sm_70


class UnsupportedGpuError(RuntimeError):
    """The installed torch has no kernels for this GPU."""


@dataclasses.dataclass(frozen=True)
class GpuSpec:
    """A GPU model: dense tensor-core peak TFLOPS (no sparsity), memory bandwidth and fp32 (CUDA-core) TFLOPS,
    from NVIDIA's data sheets. ``None`` where unknown (a GPU not in ``KNOWN_GPUS``)."""
    name: str
    capability: tuple[int, int]
    memory_gib: float
    fp16_tflops: float | None
    bf16_tflops: float | None   # None: no native bf16 (emulated, without tensor cores)
    nvlink: bool = False
    bandwidth_gbs: float | None = None
    fp32_tflops: float | None = None

    @property
    def native_bf16(self) -> bool:
        return self.capability >= (8, 0)

    def tensor_tflops(self, precision: str) -> float | None:
        """The matmul rate the training gets in ``precision`` (bf16, fp16, or no: fp32 without tensor cores)."""
        if precision == "fp16":
            return self.fp16_tflops
        if precision == "bf16":
            return self.bf16_tflops or self.fp32_tflops   # emulated bf16 runs on the CUDA cores
        return self.fp32_tflops


KNOWN_GPUS = {spec.name: spec for spec in (
    GpuSpec("V100-16GB", (7, 0), 16, 125, None, True, 900, 15.7),        # SXM2
    GpuSpec("V100-32GB", (7, 0), 32, 125, None, True, 900, 15.7),        # SXM2
    GpuSpec("V100-PCIe-16GB", (7, 0), 16, 112, None, False, 900, 14),
    GpuSpec("V100-PCIe-32GB", (7, 0), 32, 112, None, False, 900, 14),
    GpuSpec("V100S-32GB", (7, 0), 32, 130, None, False, 1134, 16.4),     # PCIe
    GpuSpec("T4-16GB", (7, 5), 15, 65, None, False, 320, 8.1),
    GpuSpec("RTX3090-24GB", (8, 6), 24, 71, 71, False, 936, 35.6),
    GpuSpec("A10-24GB", (8, 6), 24, 125, 125, False, 600, 31.2),
    GpuSpec("RTXA6000-48GB", (8, 6), 48, 154.8, 154.8, False, 768, 38.7),
    GpuSpec("RTX4090-24GB", (8, 9), 24, 165, 165, False, 1008, 82.6),
    GpuSpec("L40-48GB", (8, 9), 48, 181, 181, False, 864, 90.5),
    GpuSpec("L40S-48GB", (8, 9), 48, 362, 362, False, 864, 91.6),
    GpuSpec("A100-40GB", (8, 0), 40, 312, 312, True, 1555, 19.5),
    GpuSpec("A100-80GB", (8, 0), 80, 312, 312, True, 2039, 19.5),
    GpuSpec("H100-PCIe-80GB", (9, 0), 80, 756, 756, False, 2000, 51),
    GpuSpec("H100-NVL-94GB", (9, 0), 94, 835, 835, True, 3900, 60),
    GpuSpec("H100-80GB", (9, 0), 80, 989, 989, True, 3350, 67),          # SXM
    GpuSpec("H200-141GB", (9, 0), 141, 989, 989, True, 4800, 67),
)}

# torch.cuda.get_device_name() -> KNOWN_GPUS entries; the first pattern that matches wins, and among
# several entries the one nearest in memory ("Tesla V100-SXM2-32GB", "NVIDIA H100 80GB HBM3", ...).
_DEVICE_NAMES = (
    (r"H100.*PCIe", ("H100-PCIe-80GB",)), (r"H100.*NVL", ("H100-NVL-94GB",)), (r"H100", ("H100-80GB",)),
    (r"H200", ("H200-141GB",)), (r"A100", ("A100-40GB", "A100-80GB")), (r"V100S", ("V100S-32GB",)),
    (r"V100.*PCIE", ("V100-PCIe-16GB", "V100-PCIe-32GB")), (r"V100", ("V100-16GB", "V100-32GB")),
    (r"L40S", ("L40S-48GB",)), (r"\bL40\b", ("L40-48GB",)), (r"\bA10\b", ("A10-24GB",)), (r"\bT4\b", ("T4-16GB",)),
    (r"RTX 4090", ("RTX4090-24GB",)), (r"RTX 3090", ("RTX3090-24GB",)), (r"RTX A6000", ("RTXA6000-48GB",)),
)


def spec_for_device(device_name: str, capability: tuple[int, int], memory_bytes: int) -> tuple[GpuSpec, str | None]:
    """A found GPU as (spec, the KNOWN_GPUS entry its rates come from, or None when it is not known).

    The spec keeps the device's own name, capability and memory; an unknown GPU has no rates (None).
    """
    memory_gib = memory_bytes / 1024 ** 3
    for pattern, names in _DEVICE_NAMES:
        if re.search(pattern, device_name, flags=re.IGNORECASE):
            key = min(names, key=lambda n: abs(KNOWN_GPUS[n].memory_gib - memory_gib))
            return dataclasses.replace(KNOWN_GPUS[key], name=device_name, capability=tuple(capability),
                                       memory_gib=memory_gib), key
    return GpuSpec(device_name, tuple(capability), memory_gib, None, None), None


def known_gpu(name: str) -> GpuSpec:
    """``--assume NAME``: a GPU of KNOWN_GPUS by name (case and separators ignored)."""
    wanted = re.sub(r"[^a-z0-9]", "", name.lower())
    for key, spec in KNOWN_GPUS.items():
        if re.sub(r"[^a-z0-9]", "", key.lower()) == wanted:
            return spec
    raise ValueError(f"unknown GPU {name!r}; known: {', '.join(KNOWN_GPUS)}")


def sm(capability: tuple[int, int]) -> str:
    return f"sm_{capability[0]}{capability[1]}"


def arch_problem(arch_list: list[str], capability: tuple[int, int], device_name: str,
                 torch_version: str) -> str | None:
    """Why the installed torch cannot run on this device, with the fix; None when it can.

    A build runs on a device when it ships kernels for its exact architecture (``sm_XY``) or for an
    older one of the same major version (``sm_86`` runs ``sm_80`` code), or PTX (``compute_XY``) it
    can compile for a newer device.
    """
    major, minor = capability
    for arch in arch_list:
        match = re.fullmatch(r"(sm|compute)_(\d)(\d+)a?", arch)
        if not match:
            continue
        kind, a_major, a_minor = match.group(1), int(match.group(2)), int(match.group(3))
        if kind == "sm" and a_major == major and a_minor <= minor:
            return None
        if kind == "compute" and (a_major, a_minor) <= (major, minor):
            return None
    shipped = " ".join(arch_list) or "none"
    fix = (f"bash install.sh --torch volta (what the README installs with: {VOLTA_TORCH}, the newest PyPI build "
           "with sm_70, requirements-volta.txt)" if capability < (7, 5)
           else "bash install.sh --torch default, or a torch build for this GPU (docs/install.md)")
    return (f"the installed torch {torch_version} has no kernels for {device_name} ({sm(capability)}); "
            f"it ships: {shipped}. Every CUDA kernel would fail with 'no kernel image is available'. Fix: {fix}")


def resolve_precision(choice: str, capability: tuple[int, int] | None) -> tuple[str, str]:
    """``--mixed_precision`` -> (accelerate's value: 'bf16' | 'fp16' | 'no', why), for a GPU or the CPU (None)."""
    if choice not in PRECISIONS:
        raise ValueError(f"--mixed_precision must be one of {', '.join(PRECISIONS)}, got {choice!r}")
    if capability is None:
        if choice in ("auto", "fp32"):
            return "no", "fp32: no GPU (bf16/fp16 mixed precision is for CUDA devices)"
        if choice == "fp16":
            raise ValueError("--mixed_precision fp16 needs a CUDA GPU: accelerate neither autocasts nor scales "
                             "the loss on the CPU; use auto or fp32 here")
        return "bf16", "bf16 on the CPU (slow; auto or fp32 is the usual choice here)"
    native = capability >= (8, 0)
    if choice == "auto":
        if native:
            return "bf16", f"bf16: native on {sm(capability)}"
        return "fp16", (f"fp16 with dynamic loss scaling: {sm(capability)} has no native bf16 (emulated, "
                        "several times slower, and no memory-efficient attention for it)")
    if choice == "fp32":
        return "no", "fp32 (no mixed precision: twice the weight memory, slowest)"
    if choice == "bf16" and not native:
        return "bf16", (f"bf16 as asked, but {sm(capability)} emulates it without tensor cores (several times "
                        "slower) and attention falls back to the math kernel; --mixed_precision fp16 is faster")
    return choice, f"{choice} as asked" + (" (dynamic loss scaling)" if choice == "fp16" else "")


def torch_dtype(precision: str):
    """The weights' torch dtype for a precision: accelerate's ``bf16`` or ``fp16`` (a latent cache's ``--dtype`` too),
    else float32 (``no``, ``fp32``)."""
    import torch

    return {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision, torch.float32)


def attention_kernel(capability: tuple[int, int] | None, precision: str, cudnn_version: int | None = None) -> str:
    """Which of PyTorch's SDPA kernels attention gets: 'cudnn', 'flash', 'mem_efficient' or 'math'.

    PyTorch tries cuDNN attention first on sm90 and sm100/103 when its runtime cuDNN is newer than 9.15.0
    (``check_prefer_cudnn_attention`` in its sdp_utils.cpp; the CUDA 13 wheels; measured on an H100 with
    torch 2.11), else flash attention, which needs sm80+ and fp16/bf16. The memory-efficient kernel runs
    from sm50 for fp16 and fp32 but takes bf16 only from sm80; anything else falls back to the math kernel,
    which stores the full score matrices. ``cudnn_version`` (``torch.backends.cudnn.version()``): None
    when not known, taken as new enough.
    """
    if capability is None:
        return "math"
    if precision in ("bf16", "fp16") and capability >= (8, 0):
        prefers_cudnn = capability in ((9, 0), (10, 0), (10, 3))
        return "cudnn" if prefers_cudnn and (cudnn_version is None or cudnn_version > 91500) else "flash"
    if precision in ("fp16", "no", "fp32"):
        return "mem_efficient"
    return "math"


def nvidia_smi_device() -> tuple[GpuSpec, str | None, int] | None:
    """(spec, the KNOWN_GPUS entry its rates come from, count) of this machine's first GPU as nvidia-smi lists
    them; None without nvidia-smi or a GPU. Reads no torch, so a launcher can ask it in a blink."""
    import shutil
    import subprocess

    if not shutil.which("nvidia-smi"):
        return None
    try:
        listing = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,compute_cap", "--format=csv,noheader,nounits"],
                                 capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return None
    rows = [[field.strip() for field in line.split(",")] for line in listing.stdout.splitlines() if line.strip()]
    if listing.returncode != 0 or not rows or len(rows[0]) < 3:
        return None
    name, memory_mib, capability = rows[0][:3]
    try:
        major, minor = (int(part) for part in capability.split("."))
        memory_bytes = int(float(memory_mib)) * 2 ** 20
    except ValueError:
        return None
    spec, rates_from = spec_for_device(name, (major, minor), memory_bytes)
    return spec, rates_from, len(rows)


# torch's own deprecation notices, printed when torch.cuda imports the deprecated pynvml package and when a
# library scripts a function with torch.jit: they name packages torch chose, nothing a user of ours can act on.
# The launchers filter the same two (launchers/common.sh, PYTHONWARNINGS).
TORCH_NOTICES = ("The pynvml package is deprecated", "`torch.jit.script` is deprecated")
# The same two as PYTHONWARNINGS says them, for a process this one starts (by message: a literal prefix there)
TORCH_NOTICE_FILTERS = ",".join(f"ignore:{notice}:FutureWarning" for notice in TORCH_NOTICES)


def quiet_torch_notices() -> None:
    """Filter only torch's two notices above, in this process (entry points that print their own output call it
    before torch is imported); every other warning still shows."""
    import warnings

    for notice in TORCH_NOTICES:
        warnings.filterwarnings("ignore", message=re.escape(notice), category=FutureWarning)


def current_device() -> dict | None:
    """Name, capability, memory and the installed torch's arch list of CUDA device 0; None without a GPU."""
    import torch

    if not torch.cuda.is_available():
        return None
    index = torch.cuda.current_device()
    props = torch.cuda.get_device_properties(index)
    return {"name": props.name, "capability": tuple(torch.cuda.get_device_capability(index)),
            "memory_bytes": props.total_memory, "arch_list": list(torch.cuda.get_arch_list()),
            "torch": torch.__version__, "count": torch.cuda.device_count()}


def require_supported_gpu() -> None:
    """Entry points call this first: on a GPU the installed torch has no kernels for, stop with the fix."""
    device = current_device()
    if device is None:
        return
    problem = arch_problem(device["arch_list"], device["capability"], device["name"], device["torch"])
    if problem:
        raise UnsupportedGpuError(problem)


MIB = 2**20


class MemoryPeaks:
    """The caching allocator's peaks as status fields (pure): each reading is the peak since the previous one
    (the caller resets the allocator's counters after reading), and the run's peak is kept across readings."""

    def __init__(self):
        self.run_allocated = 0
        self.run_reserved = 0

    def fields(self, peak_allocated: int, peak_reserved: int) -> dict:
        """Bytes since the last reading -> ``peak_allocated_mb``, ``peak_reserved_mb`` and the run's peaks."""
        self.run_allocated = max(self.run_allocated, peak_allocated)
        self.run_reserved = max(self.run_reserved, peak_reserved)
        return {"peak_allocated_mb": round(peak_allocated / MIB), "peak_reserved_mb": round(peak_reserved / MIB),
                "run_peak_allocated_mb": round(self.run_allocated / MIB),
                "run_peak_reserved_mb": round(self.run_reserved / MIB)}


class GpuReader:
    """This process's GPU for the status file, read when the file is about to be written: name, utilisation
    (NVML), memory in use on the device, and the allocator's peaks since the previous reading, whose counters
    are then reset, so a short phase (a checkpoint, a validation) between two writes still shows its peak.
    None on CPU. Never raises."""

    def __init__(self):
        self.peaks = MemoryPeaks()
        self._available: bool | None = None

    def __call__(self) -> dict | None:
        try:
            import torch

            if self._available is None:
                self._available = torch.cuda.is_available()
            if not self._available:
                return None
            device = torch.cuda.current_device()
            free, total = torch.cuda.mem_get_info(device)
            try:
                util = torch.cuda.utilization(device)
            except Exception:  # pynvml missing or not permitted
                util = None
            peaks = self.peaks.fields(torch.cuda.max_memory_allocated(device), torch.cuda.max_memory_reserved(device))
            torch.cuda.reset_peak_memory_stats(device)
            return {"name": torch.cuda.get_device_name(device), "util_pct": util,
                    "mem_used_mb": round((total - free) / MIB), "mem_total_mb": round(total / MIB), **peaks}
        except Exception:
            return None
