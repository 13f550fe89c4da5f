"""The doctor's checks: each returns a ``Check`` (ok / warn / fail / skip, what was found, the fix).

Host checks read this machine (GPUs, torch, /dev/shm, open-file limit, disks, model files, metadata,
ffmpeg); the memory and speed estimates use the GPU found here or the one named by ``--assume``.
"""

from __future__ import annotations

import dataclasses
import os
import resource
import shutil
from pathlib import Path

from diffsynth_mbc.gpu import GpuSpec, arch_problem, attention_kernel, resolve_precision, sm
from diffsynth_mbc.models.model_files import MODELSCOPE_ID
from diffsynth_mbc.training.plan import memory

OK, WARN, FAIL, SKIP = "ok", "warn", "fail", "skip"
GIB = 1024 ** 3
OPEN_FILES_WANTED = 4096


@dataclasses.dataclass
class Check:
    name: str
    status: str
    detail: str
    fix: str = ""


@dataclasses.dataclass
class Target:
    """The GPU the plan is for: this machine's device 0, or an assumed one (``--assume``)."""
    spec: GpuSpec | None
    count: int
    assumed: bool
    arch_list: list[str]
    torch_version: str
    rates_from: str | None = None    # the KNOWN_GPUS entry whose TFLOPS and bandwidth apply; None: unknown
    cudnn_version: int | None = None  # this machine's torch's cuDNN (decides cuDNN vs flash attention on sm90)
    assumptions: list[str] = dataclasses.field(default_factory=list)   # how the count was decided, when assumed


ACCELERATE_CONFIGS = Path(__file__).resolve().parents[2] / "configs" / "accelerate"


def launcher_gpus(deepspeed: bool = False) -> tuple[int, str]:
    """(GPUs per node, where that comes from) of a launch on a machine that is not here: the processes per node
    of the launchers' accelerate settings (``num_processes`` / ``num_machines``), else 1."""
    import yaml

    path = ACCELERATE_CONFIGS / ("deepspeed_zero2.yaml" if deepspeed else "ddp.yaml")
    try:
        settings = yaml.safe_load(path.read_text(encoding="utf-8"))
        count = int(settings["num_processes"]) // max(1, int(settings.get("num_machines", 1)))
    except (OSError, ValueError, KeyError, TypeError, yaml.YAMLError):
        return 1, f"1 (--gpus not given, and no num_processes in {path})"
    return max(1, count), f"{max(1, count)} (--gpus not given: num_processes of configs/accelerate/{path.name})"


# Device nodes through which a GPU reaches torch: NVIDIA's, AMD's (ROCm), WSL2's. With none, torch finds no GPU.
GPU_DEVICE_NODES = ("/dev/nvidia[0-9]*", "/dev/kfd", "/dev/dxg")


def no_gpu_device() -> bool:
    """True when this machine has no GPU device node at all: no torch can see a GPU here, which is known without
    importing torch (1.5 s of every CPU launch's preflight)."""
    import glob

    return not any(glob.glob(pattern) for pattern in GPU_DEVICE_NODES)


def installed_torch_version() -> str:
    """``torch.__version__`` (e.g. ``2.10.0+cu128``) read from torch/version.py, without importing torch; the
    package's version when that file says otherwise."""
    import importlib.util
    import re
    from importlib.metadata import PackageNotFoundError, version

    spec = importlib.util.find_spec("torch")
    if spec is None or not spec.submodule_search_locations:
        return "not installed"
    try:
        text = (Path(list(spec.submodule_search_locations)[0]) / "version.py").read_text(encoding="utf-8")
        return re.search(r"^__version__\s*=\s*['\"]([^'\"]+)['\"]", text, re.MULTILINE).group(1)
    except (OSError, AttributeError):
        try:
            return version("torch")
        except PackageNotFoundError:
            return "not installed"


def find_target(assume: str | None, gpus: int | None, deepspeed: bool = False) -> Target:
    if not assume and no_gpu_device():
        return Target(None, 0, False, [], installed_torch_version())
    import torch

    from diffsynth_mbc.gpu import current_device, known_gpu, spec_for_device

    arch_list = (torch._C._cuda_getArchFlags() or "").split() if torch.version.cuda else []
    if assume:
        spec = known_gpu(assume)
        count, why = (gpus, f"{gpus} (--gpus)") if gpus else launcher_gpus(deepspeed)
        return Target(spec, count, True, arch_list, torch.__version__, spec.name,
                      assumptions=[f"GPUs per node: {why}"])
    device = current_device()
    if device is None:
        return Target(None, 0, False, arch_list, torch.__version__)
    spec, rates_from = spec_for_device(device["name"], device["capability"], device["memory_bytes"])
    return Target(spec, gpus or device["count"], False, device["arch_list"], torch.__version__, rates_from,
                  torch.backends.cudnn.version())


def assume_hint() -> str:
    """The --assume names of every V100 the doctor knows (from KNOWN_GPUS), and where the rest are listed."""
    from diffsynth_mbc.gpu import KNOWN_GPUS

    volta = [name for name, spec in KNOWN_GPUS.items() if spec.capability == (7, 0)]
    return (f"plan with --assume NAME: {', '.join(volta)} (every known GPU: python -m diffsynth_mbc.doctor --help)")


def gpu_check(target: Target) -> Check:
    if target.spec is None:
        return Check("GPU", WARN, "no CUDA GPU on this machine: only the CPU demo can train here",
                     f"run the doctor on the training machine, or {assume_hint()}")
    spec = target.spec
    where = "found"
    if target.assumed:
        where = f"assumed (not this machine's; {'; '.join(target.assumptions) or 'GPUs per node: --gpus'})"
    rates = (f"rates of {target.rates_from}: {spec.fp16_tflops:g} TFLOPS fp16, {spec.bandwidth_gbs:g} GB/s"
             if target.rates_from else "rates unknown (no speed estimate; --probe N measures it)")
    return Check("GPU", OK, f"{target.count} x {spec.name} {where}: {sm(spec.capability)}, {spec.memory_gib:.0f} GiB, "
                            f"native bf16 {'yes' if spec.native_bf16 else 'no'}; {rates}")


def arch_check(target: Target) -> Check:
    if target.spec is None:
        return Check("torch kernels", SKIP, f"torch {target.torch_version}: no GPU to check against")
    if not target.arch_list:
        return Check("torch kernels", FAIL, f"torch {target.torch_version} is a CPU-only build",
                     "install a CUDA build of torch (docs/install.md)")
    problem = arch_problem(target.arch_list, target.spec.capability, target.spec.name, target.torch_version)
    if problem:
        detail, _, fix = problem.partition(" Fix: ")
        return Check("torch kernels", FAIL, detail, fix)
    return Check("torch kernels", OK, f"torch {target.torch_version} ships {' '.join(target.arch_list)}")


def precision_check(target: Target, choice: str) -> tuple[Check, str]:
    capability = target.spec.capability if target.spec else None
    try:
        precision, why = resolve_precision(choice, capability)
    except ValueError as exc:
        return Check("precision", FAIL, str(exc), "--mixed_precision auto"), "no"
    kernel = attention_kernel(capability, precision, target.cudnn_version)
    slow_bf16 = capability is not None and precision == "bf16" and capability < (8, 0)
    status = WARN if slow_bf16 or (capability is not None and kernel == "math") else OK
    fix = "--mixed_precision fp16 (or auto)" if status == WARN else ""
    return Check("precision", status, f"{why}; attention kernel: {kernel} (PyTorch's SDPA rule for "
                                      f"{sm(capability) if capability else 'the CPU'}; not measured here)", fix), precision


def nccl_check(target: Target, quick: bool) -> Check:
    if target.assumed or target.count < 2:
        return Check("NCCL", SKIP, "needs two or more GPUs on this machine")
    import torch

    p2p = all(torch.cuda.can_device_access_peer(a, b) for a in range(target.count) for b in range(target.count) if a != b)
    detail = f"PCIe/NVLink peer access {'on' if p2p else 'off'} between the {target.count} GPUs"
    if quick:
        return Check("NCCL", OK, detail + " (all-reduce bandwidth: run without --quick)")
    from diffsynth_mbc.doctor.nccl import all_reduce_bandwidth

    gbps = all_reduce_bandwidth(target.count)
    status = OK if gbps >= 5 else WARN
    fix = "" if status == OK else "check configs/nccl_pcie.env (NCCL_P2P_DISABLE, NCCL_IB_DISABLE) and the PCIe topology"
    return Check("NCCL", status, f"{detail}; all-reduce bus bandwidth {gbps:.1f} GB/s", fix)


def shm_check(options) -> Check:
    workers = options.dataset_num_workers
    if workers == 0:
        return Check("/dev/shm", OK, "no data-loader workers (--dataset_num_workers 0)")
    per_sample = (memory.tokens(options.height, options.width, options.num_frames) * 48 * 4 * 4 if options.cache
                  else options.num_frames * options.height * options.width * 3 * 4)
    needed = workers * 2 * options.batch_size * per_sample   # two batches in flight per worker
    try:
        free = shutil.disk_usage("/dev/shm").total
    except OSError:
        return Check("/dev/shm", WARN, "no /dev/shm", "data-loader workers pass tensors through shared memory")
    detail = f"{free / GIB:.1f} GiB; {workers} workers need about {needed / GIB:.2f} GiB"
    if free < needed:
        return Check("/dev/shm", FAIL, detail, "docker run --shm-size=16g, or lower --dataset_num_workers")
    return Check("/dev/shm", OK if free >= 2 * needed else WARN, detail,
                 "" if free >= 2 * needed else "a larger /dev/shm (docker --shm-size) leaves room")


def open_files_check() -> Check:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    detail = f"soft {soft}, hard {hard}"
    if soft != resource.RLIM_INFINITY and soft < OPEN_FILES_WANTED:
        return Check("open files", WARN, detail + f" (data-loader workers and NCCL want {OPEN_FILES_WANTED}+)",
                     f"ulimit -n {min(hard, 65536) if hard != resource.RLIM_INFINITY else 65536}")
    return Check("open files", OK, detail)


def download_command(model_id: str | None, folder: str) -> str:
    """The command that puts the release's files into ``folder`` (ModelScope's own client)."""
    return f"modelscope download --model {model_id or MODELSCOPE_ID} --local_dir {folder}"


def model_check(options) -> Check:
    if options.demo:
        return Check("model files", OK, "demo: a tiny random model, no files needed")
    model_id = options.model_id or MODELSCOPE_ID
    if not options.model_dir:
        return Check("model files", WARN, f"--model_id {model_id}: downloaded from ModelScope at start (about 30 GB)",
                     f"download once ({download_command(model_id, './Wan2.2-TI2V-5B')}), then pass "
                     "--model_dir ./Wan2.2-TI2V-5B")
    from diffsynth_mbc.models.model_files import ModelFileError, locate_model_files

    try:
        files = locate_model_files(options.model_dir)
    except ModelFileError as exc:
        return Check("model files", FAIL, str(exc),
                     f"get the files with `{download_command(model_id, options.model_dir)}` (about 30 GB), or leave "
                     f"out --model_dir and pass --model_id {model_id} to download them at start")
    return Check("model files", OK, f"{options.model_dir}: {len(files.dit_shards)} DiT shard(s), T5, VAE, tokenizer readable")


DECODE_WORKING_COPIES = 4   # decoded RGB frames, the resized copy, the crop and the tensor a row becomes


def available_memory_bytes() -> int | None:
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def decode_memory_problem(width: int, height: int, num_frames: int, available: int | None) -> str | None:
    """Why decoding one row at this size would not fit in memory (checked before decoding), or None."""
    needed = DECODE_WORKING_COPIES * width * height * 3 * num_frames
    if available is not None and needed > available // 2:
        return (f"decoding one row at {width}x{height}x{num_frames} needs about {needed / 2**30:.1f} GiB, more "
                f"than half of the {available / 2**30:.1f} GiB free here")
    return None


def bad_size_cell(options) -> str | None:
    """Under aspect buckets, a width/height cell that is no size or not its file's (the training and the plan
    refuse it), else None. The files' sizes come from the run's size table (read once per run)."""
    if options.buckets != "aspect":
        return None
    from diffsynth_mbc.errors import MetadataError
    from diffsynth_mbc.training.plan.step_plan import sized_rows_of_metadata

    try:
        sized_rows_of_metadata(options)   # the projection's bucket counts read the same, once
    except MetadataError as exc:
        return str(exc)
    return None


def metadata_check(options, quick: bool) -> tuple[Check, tuple[int, int] | None]:
    """The metadata's rows as (videos, images), and whether the first rows decode at the training size."""
    from diffsynth_mbc.training.plan.run_length import count_media

    path = options.dataset_metadata_path
    if not os.path.isfile(path):
        return Check("metadata", FAIL, f"not found: {path}", "python -m diffsynth_mbc.convert CATALOG.csv ..."), None
    media = count_media(path)
    rows = sum(media)
    if rows == 0:
        return Check("metadata", FAIL, f"{path}: no rows", "re-run the converter"), media
    counted = f"{path}: {rows:,} rows ({media[0]:,} videos, {media[1]:,} images)"
    bad_size = bad_size_cell(options)
    if bad_size:
        return Check("metadata", FAIL, f"{counted}; {bad_size}", "fix or empty the cell"), media
    if quick or options.cache:
        return Check("metadata", OK, counted), media
    too_big = decode_memory_problem(options.width, options.height, options.num_frames, available_memory_bytes())
    if too_big:
        return Check("metadata", FAIL, f"{counted}; not decoded: {too_big}",
                     "train at a smaller --height/--width/--num_frames"), media
    from diffsynth_mbc.data.dataset import MBCVideoDataset

    dataset = MBCVideoDataset(options.dataset_base_path, path, decoder=options.decoder, num_frames=options.num_frames,
                              height=options.height, width=options.width)
    first = min(3, rows)
    if options.buckets == "aspect":   # the rows decoded here at their buckets: their sizes only, not every row's
        from diffsynth_mbc.data.media.row_buckets import row_buckets
        from diffsynth_mbc.data.media.size_table import table_path_in

        dataset.row_buckets[:first] = row_buckets(dataset.data[:first], options.dataset_base_path, options.height,
                                                  options.width, table_path=table_path_in(options.output_path))
    shapes = []
    for index in range(first):
        try:
            sample = dataset[index]
        except Exception as exc:  # noqa: BLE001 - any decoding failure is the finding
            return Check("metadata", FAIL, f"{path}: row {index + 1} does not decode: {exc}",
                         "re-run the converter with --probe"), media
        if sample is None:
            return Check("metadata", FAIL, f"{path}: row {index + 1} does not decode",
                         "re-run the converter with --probe"), media
        frames = sample["video"]
        shapes.append(f"{frames[0].size[0]}x{frames[0].size[1]}x{len(frames)}")
    at = (f"at {', '.join(dict.fromkeys(shapes))} (their aspect buckets)" if options.buckets == "aspect"
          else f"at {options.width}x{options.height}x{options.num_frames}")
    return Check("metadata", OK, f"{counted}; the first {first} decode {at}"), media


def frame_rate_check(options, media: tuple[int, int] | None) -> Check:
    """The clips' frame rates (the metadata's fps column, from ``convert --probe``) and what the run does with them;
    a warning when clips train at a rate off the model's 24 fps (their motion sped up or slowed)."""
    from diffsynth_mbc.data.media.frame_selection import MODEL_FPS, describe_frame_rates, rates_off_the_model
    from diffsynth_mbc.training.plan.run_length import metadata_media

    if not media or not media[0]:
        return Check("frame rates", SKIP, "no clips in the metadata")
    found = metadata_media(options.dataset_metadata_path)
    detail = describe_frame_rates(found.frame_rates, found.unknown_rate, options.source_fps, options.num_frames)
    detail = detail.removeprefix("frame rates: ")
    known = found.frame_rates or options.source_fps is not None
    if known and rates_off_the_model(found.frame_rates, options.source_fps):
        return Check("frame rates", WARN, detail, f"--source_fps {MODEL_FPS:g} (the presets set it)")
    return Check("frame rates", OK, detail)


def ffmpeg_needed_by(options) -> list[str]:
    """What in this run calls ffmpeg: writing sample clips, DiffSynth's own reader. The fast decoder (PyAV) needs
    it only for the odd clip it cannot show as ffmpeg does."""
    needed = []
    if options is not None and options.sample_prompts:
        needed.append("--sample_prompts (the sample clips are written with ffmpeg)")
    if options is not None and options.decoder == "diffsynth":
        needed.append("--decoder diffsynth")
    return needed


def ffmpeg_check(options=None) -> Check:
    try:
        import imageio_ffmpeg

        exe, why = imageio_ffmpeg.get_ffmpeg_exe(), ""   # IMAGEIO_FFMPEG_EXE comes back as given: looked up below
    except Exception as exc:  # noqa: BLE001
        exe, why = shutil.which("ffmpeg"), str(exc)
    if not exe or not shutil.which(exe):
        problem = f"no ffmpeg at {exe} (not an executable)" if exe else f"no ffmpeg ({why})"
        needed = ffmpeg_needed_by(options)
        if needed:
            return Check("ffmpeg", FAIL, f"{problem}; needed by {', '.join(needed)}",
                         "pip install imageio-ffmpeg (or unset IMAGEIO_FFMPEG_EXE)")
        return Check("ffmpeg", WARN, f"{problem}; this run does not need it (no --sample_prompts, PyAV decoder), "
                                     "but a clip that needs ffmpeg's reader (one PyAV cannot show as ffmpeg does) "
                                     "will not decode",
                     "pip install imageio-ffmpeg")
    try:
        import av

        return Check("ffmpeg", OK, f"{exe}; PyAV {av.__version__}")
    except ImportError:
        return Check("ffmpeg", WARN, f"{exe}; PyAV missing (slower DiffSynth decoder)", "pip install av")
