"""The run's ``Accelerator``: precision chosen for this GPU, the process group (gloo on CPU, NCCL's timeout),
DeepSpeed's clipping from ``--max_grad_norm``, trackers, and one run id for every rank; and the plainer one of a
command that only evaluates a run's LoRA files (``python -m diffsynth_mbc.sample``), with the same precision and
process group."""

from __future__ import annotations

import os

from diffsynth_mbc.errors import OptionsError
from diffsynth_mbc.run_layout import TRACKING_FOLDER
from diffsynth_mbc.training.distributed.collectives import broadcast_from_main
from diffsynth_mbc.training.reporting.status_writer import RankStatusWriter


def this_gpu() -> tuple[int, int] | None:
    """This process's GPU's compute capability (None on the CPU); a torch build without its kernels is refused here,
    naming the fix."""
    import torch

    from diffsynth_mbc.gpu import require_supported_gpu

    require_supported_gpu()
    return tuple(torch.cuda.get_device_capability()) if torch.cuda.is_available() else None


def run_precision(options, capability: tuple[int, int] | None) -> tuple[str, str]:
    """(accelerate's precision, why) for ``--mixed_precision`` on a GPU of ``capability`` (None: the CPU)."""
    from diffsynth_mbc.gpu import resolve_precision

    try:
        return resolve_precision(options.mixed_precision, capability)
    except ValueError as exc:
        raise OptionsError(str(exc)) from None


def process_group_handlers(options, world_size: int) -> list:
    """accelerate's kwargs for a process group of ``world_size`` processes: ``--dist_backend`` (else NCCL on GPUs,
    gloo on CPUs) with NCCL_TIMEOUT as its timeout; none for one process."""
    import datetime

    import torch
    from accelerate.utils import InitProcessGroupKwargs

    if (world_size > 1 and not torch.cuda.is_available()
            and os.environ.get("ACCELERATE_USE_DEEPSPEED", "").lower() != "true"):
        # Without this, accelerate on a machine with no GPU shards the data over the processes but
        # wraps nothing in DDP: every rank would silently train a model of its own.
        os.environ.setdefault("ACCELERATE_USE_CPU", "1")
    if world_size <= 1:
        return []
    # NCCL_TIMEOUT is not read by NCCL itself; it becomes the process group's timeout here.
    timeout = datetime.timedelta(seconds=int(os.environ.get("NCCL_TIMEOUT", "1800")))
    backend = options.dist_backend or ("nccl" if torch.cuda.is_available() else "gloo")
    return [InitProcessGroupKwargs(backend=backend, timeout=timeout)]


def start_evaluation_accelerator(options):
    """The ``Accelerator`` of a command that evaluates LoRA files with a run's options: the run's precision on this
    GPU and the training's process group; one process, or each process of ``accelerate launch``."""
    from accelerate import Accelerator

    precision, _ = run_precision(options, this_gpu())
    return Accelerator(mixed_precision=precision,
                       kwargs_handlers=process_group_handlers(options, int(os.environ.get("WORLD_SIZE", "1"))))


def start_accelerator(options, status: RankStatusWriter):
    import torch
    from accelerate import Accelerator
    from accelerate.utils import DataLoaderConfiguration, DistributedDataParallelKwargs, DistributedType

    from diffsynth_mbc.gpu import attention_kernel

    capability = this_gpu()   # a torch build without this GPU's kernels: stop now, naming the fix
    precision, precision_why = run_precision(options, capability)
    if os.environ.get("ACCELERATE_USE_DEEPSPEED", "").lower() == "true":
        # The engine clips, not us: hand it --max_grad_norm (0 disables) instead of the config's fixed value.
        os.environ["ACCELERATE_GRADIENT_CLIPPING"] = str(float(options.max_grad_norm))
        if not torch.cuda.is_available():
            skip_deepspeed_cpu_inference_kernel()
    status.update(phase="joining the process group", mixed_precision=precision, precision_reason=precision_why,
                  attention_kernel=attention_kernel(capability, precision))
    handlers = [DistributedDataParallelKwargs(find_unused_parameters=options.find_unused_parameters),
                *process_group_handlers(options, status.state["world_size"])]
    tracking = {} if options.report_to == "none" else {
        "log_with": options.report_to, "project_dir": os.path.join(options.output_path, TRACKING_FOLDER)}
    accelerator = Accelerator(
        mixed_precision=precision, gradient_accumulation_steps=options.gradient_accumulation_steps,
        kwargs_handlers=handlers,
        dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True, data_seed=options.seed), **tracking)
    if accelerator.state.deepspeed_plugin is not None:
        status.update(deepspeed_gradient_clipping=accelerator.state.deepspeed_plugin.deepspeed_config.get(
            "gradient_clipping"))
    if accelerator.num_processes != status.state["world_size"]:
        status.update(world_size=accelerator.num_processes)
    # One run id for the whole run, rank 0's: nodes launched seconds or minutes apart each proposed their own.
    run_id = broadcast_from_main(accelerator, status.state["run_id"], status, what="rank 0's run id")
    if run_id != status.state["run_id"]:
        status.update(run_id=run_id, phase=f"joined run {run_id}")
    if accelerator.num_processes > 1 and accelerator.distributed_type == DistributedType.NO:
        raise OptionsError(f"{accelerator.num_processes} processes were launched but accelerate set up no distributed "
                           "training, so gradients would never be averaged; check the accelerate config "
                           "(distributed_type) and that the GPUs are visible")
    return accelerator


DEEPSPEED_CPU_INFERENCE_KERNEL = "deepspeed_shm_comm"


def skip_deepspeed_cpu_inference_kernel() -> None:
    """On CPU ranks DeepSpeed's process group compiles a shared-memory all-reduce (C++: about 30 s and a compiler,
    once per machine) that only its tensor-parallel inference calls; ZeRO's training collectives go through the
    process group (gloo). Marking the kernel unavailable lets a CPU run start without building it."""
    import deepspeed.ops

    deepspeed.ops.__compatible_ops__[DEEPSPEED_CPU_INFERENCE_KERNEL] = False


def unwrapped_model(accelerator, model):
    """The training module inside what ``accelerator.prepare`` wrapped it in. Under DeepSpeed, accelerate's own
    ``unwrap_model``; otherwise DDP's ``.module`` is taken off here, because accelerate's ``unwrap_model`` imports
    DeepSpeed whenever it is installed (to test for its engine: 0.4 s of a DDP rank's start here) and looks the
    package up on every call (0.8 ms; the step unwraps once per micro-batch)."""
    from accelerate.utils import DistributedType
    from torch.nn.parallel import DataParallel, DistributedDataParallel

    if accelerator.distributed_type == DistributedType.DEEPSPEED:
        return accelerator.unwrap_model(model)
    while isinstance(model, (DistributedDataParallel, DataParallel)):
        model = model.module
    return model
