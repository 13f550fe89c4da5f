"""A run's options on a GPU -> memory per GPU, seconds per step, run length (what the doctor and the plan show).

Turns the training options and the target GPU into the pure models' inputs (``memory.Plan`` for the clip
batch and the image batch), resolves what the training decides at start the way it will (compile,
``--gradient_checkpointing auto``) and labels every assumption it makes. No torch.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

from diffsynth_mbc.training.plan import memory

from diffsynth_mbc.training.plan import run_length

from diffsynth_mbc.training.plan import speed

GIB = 1024 ** 3


def resolve_compile(choice: str, capability: tuple[int, int] | None) -> tuple[bool, str]:
    """``--compile auto|on|off`` -> (compiled, why), as the training decides it at start; torch's Triton check
    (which needs the GPU) is assumed to pass on sm70+, and said so."""
    from diffsynth_mbc.training.plan.compile_policy import decide_compile

    triton_ok = capability is not None and capability >= (7, 0)
    decision = decide_compile(choice, capability is not None, capability, triton_ok)
    assumed = " (assumed: torch can compile for sm70+; the training decides at start)" if decision.compile else ""
    return decision.compile, decision.reason + assumed


def nodes_from_environment() -> int:
    try:
        return max(1, int(os.environ.get("NUM_MACHINES", "1")))
    except ValueError:
        return 1


def image_batch(options) -> int:
    return options.image_batch_size or memory.default_image_batch(options.height, options.width, options.num_frames,
                                                                  options.batch_size)


def run_plans(options, precision: str, attention: str, cached: bool, compiled: bool, zero2_world_size: int = 1,
              media: tuple[int, int] | None = None) -> dict:
    """{"video": Plan, "image": Plan} for the media the run has (both when the counts are not known)."""
    base = memory.Plan(options.height, options.width, options.num_frames, options.batch_size, options.lora_rank,
                       tuple(options.lora_target_modules.split(",")), precision, cached, memory.DIT["num_layers"],
                       options.use_gradient_checkpointing_offload, attention, zero2_world_size, compiled)
    plans = {"video": base, "image": base.but(num_frames=1, batch_size=image_batch(options))}
    if media is not None:
        plans = {kind: plan for kind, plan, count in zip(("video", "image"), plans.values(), media) if count} or plans
    return plans


def with_checkpointing(options, plans: dict, gpu_bytes: int | None) -> tuple[dict, str]:
    """The plans with the recomputed blocks the training will use, and how that number was decided."""
    recomputed, how = memory.recomputed_from_option(options.gradient_checkpointing, list(plans.values()), gpu_bytes)
    return {kind: plan.but(recomputed_blocks=recomputed) for kind, plan in plans.items()}, how


def memory_summary(plans: dict, gpu_bytes: int) -> dict:
    """The larger of the clip and image batch's estimates, itemised, against the GPU."""
    totals = {kind: memory.total(memory.estimate(plan)) for kind, plan in plans.items()}
    kind = max(totals, key=totals.get)
    plan = plans[kind]
    items = memory.estimate(plan)
    return {"batch": kind, "plan": {**vars(plan), "lora_targets": list(plan.lora_targets), "tokens": plan.tokens},
            "items": [{"item": name, "bytes": size} for name, size in items], "total_bytes": totals[kind],
            "totals_by_batch": totals, "gpu_bytes": gpu_bytes, "limit_bytes": int(memory.FITS_BELOW * gpu_bytes),
            "fits": all(memory.fits(p, gpu_bytes) for p in plans.values())}


def cache_to_build(options, cached_launch: bool) -> bool:
    """Whether the run starts by building the latent cache (the launcher's --cached, or an unfinished --cache)."""
    from diffsynth_mbc.data.cache.index import INDEX_FILE

    if cached_launch:
        return True
    return bool(options.cache) and not (Path(options.cache) / INDEX_FILE).is_file()


@dataclasses.dataclass
class RunEstimate:
    """What the training will run on the GPU, how fast, for how long, and what was assumed to say so."""
    plans: dict                     # {"video": Plan, "image": Plan}, with the recomputed blocks resolved
    speed: dict                     # per batch kind: StepEstimate.as_dict(); "projection"; or {"unknown": why}
    projection: run_length.Projection | None
    assumptions: list[str]


def estimate_run(options, spec, rates_from: str | None, precision: str, *, cudnn_version: int | None = None,
                 gpus: int = 1, nodes: int | None = None, cached_launch: bool = False,
                 media: tuple[int, int] | None = None, zero2_world_size: int = 1, plan=None) -> RunEstimate:
    """The run's plans on ``spec`` (a ``GpuSpec``, or None without a GPU), its speed and projected length; ``plan``:
    the step plan already worked out for these rows (``step_plan``), else worked out here."""
    from diffsynth_mbc.gpu import attention_kernel

    capability = spec.capability if spec is not None else None
    attention = attention_kernel(capability, precision, cudnn_version)
    compiled, compile_why = resolve_compile(options.compile, capability)
    build_cache = cache_to_build(options, cached_launch)
    plans = run_plans(options, precision, attention, bool(options.cache) or cached_launch, compiled,
                      zero2_world_size, media)
    gpu_bytes = int(spec.memory_gib * GIB) if spec is not None else None
    plans, checkpointing_how = with_checkpointing(options, plans, gpu_bytes)
    nodes_given = nodes is not None
    nodes = nodes or nodes_from_environment()
    assumptions = [compile_why, f"gradient checkpointing {checkpointing_how}",
                   f"attention kernel {attention}: PyTorch's SDPA rule, not measured here",
                   "LoRA and its AdamW state in the training precision (in fp32 they cost about 0.9 GiB and, "
                   "on the H100, 0.22 s/step more: measured)",
                   f"image batch {image_batch(options)}" + ("" if options.image_batch_size else
                                                           " (default: a clip's tokens in images)"),
                   f"{gpus} GPU(s) per node x {nodes} node(s)" + ("" if nodes_given else " (nodes: NUM_MACHINES, else 1)")]
    if build_cache:
        assumptions.append("the latent cache is built first (--cached, or --cache without a finished cache)")
    speed_figures, run = speed_summary(options, spec, rates_from, plans, media, gpus, nodes, build_cache, plan)
    return RunEstimate(plans, speed_figures, run, assumptions)


def speed_summary(options, spec, rates_from: str | None, plans: dict, media: tuple[int, int] | None, gpus: int,
                  nodes: int, build_cache: bool, plan=None) -> tuple[dict, run_length.Projection | None]:
    """Seconds per step per batch kind, where each figure comes from, and the run's length when the rows are known."""
    if spec is None:
        return {"unknown": "no GPU: the speed model covers GPUs (plan with --assume NAME, or measure this machine "
                           "with --probe N)"}, None
    if rates_from is None:
        return {"unknown": f"no rates for {spec.name}: plan with --assume NAME of a similar GPU, or measure it with "
                           "--probe N"}, None
    steps = {kind: speed.seconds_per_step(batch, spec, rates_from, options.gradient_accumulation_steps)
             for kind, batch in plans.items()}
    out = {"rates_from": rates_from, "flop_convention": f"{speed.STEP_FLOPS:.3g} FLOPs per 4,400-token step",
           **{kind: estimate.as_dict() for kind, estimate in steps.items()}}
    run = None
    if media is not None:
        run = project(options, steps, plans, spec, run_shape(options, media, gpus, nodes, plan), build_cache)
        out["projection"] = run.as_dict()
    return out, run


def project(options, steps: dict, plans: dict, spec, shape: run_length.RunShape,
            build_cache: bool) -> run_length.Projection:
    encode = {}
    if build_cache:
        tensor_ratio = speed.gpu_ratios(spec, plans[next(iter(plans))].precision)[0]
        for kind, batch in run_plans(options, "bf16", "cudnn", False, False).items():
            encode[kind] = speed.encode_seconds(batch.but(batch_size=1), tensor_ratio)
    seconds = {kind: estimate.seconds for kind, estimate in steps.items()}
    kind = "measured" if all(e.measured for e in steps.values()) and not build_cache else "estimate"
    return run_length.project(shape, seconds.get("video"), seconds.get("image"), encode.get("video"),
                              encode.get("image"), kind=kind)


def step_plan(options, media: tuple[int, int], world_size: int):
    """The training's step plan for these rows on ``world_size`` GPUs (every node's): the one function the training,
    ``python -m diffsynth_mbc.plan`` and the status files plan with; several catalogues count their own repeats."""
    from diffsynth_mbc.data.dataset_list import metadata_counts
    from diffsynth_mbc.training.plan.step_plan import bucket_samples_of_metadata, plan_from_options

    counts = metadata_counts(options) if options.datasets else ()
    return plan_from_options(options, rows=media[0] + media[1], images=media[1], world_size=max(1, world_size),
                             datasets=counts, bucket_samples=bucket_samples_of_metadata(options))


def run_shape(options, media: tuple[int, int], gpus: int, nodes: int, plan=None,
              unit: str = "GPU") -> run_length.RunShape:
    """The run's shape: ``plan`` (the step plan already printed), else the step plan of ``gpus`` x ``nodes``."""
    nodes = max(1, nodes)
    return run_length.RunShape(plan or step_plan(options, media, max(1, gpus) * nodes), nodes, unit)
