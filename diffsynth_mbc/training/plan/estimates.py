"""A run's options on a GPU -> memory per GPU, seconds per step, run length (what the doctor and the plan show).

Turns the training options and the target GPU into the pure models' inputs (``memory.Plan`` for the clip
batch and the image batch), resolves what the training decides at start the way it will (compile,
``--gradient_checkpointing auto``) and labels every assumption it makes. No torch.
"""

from __future__ import annotations

import dataclasses
import math
import os
from pathlib import Path

from diffsynth_mbc.training.plan import memory, run_length, speed
from diffsynth_mbc.training.plan.residual_policy import decide_fp32_residual
from diffsynth_mbc.training.plan.evaluation_cost import evaluation_cost

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


def bucket_tokens(bucket) -> int:
    """DiT tokens of one latent frame at ``bucket`` (sides / 32: the VAE's 16 x the patch's 2)."""
    return memory.tokens(bucket.height, bucket.width, 1)


def largest_bucket(buckets):
    """The bucket with the most tokens (buckets of one area differ by the 32-pixel rounding); at equal tokens the
    squarest, then the wider (landscape, as --width x --height mostly is): the choice does not hang on the order."""
    return max(buckets, key=lambda b: (bucket_tokens(b), -abs(math.log(b.aspect)), b.width))


def sizing_buckets(options, bucket_samples=()) -> dict | None:
    """``--buckets aspect``: {media kind: the bucket with the most tokens} among the buckets that kind's rows use
    (``bucket_samples``' keys, ``video@1280x704``), else among every bucket of --height x --width (the rows' buckets
    not known); None with ``off``: the memory and speed are at --height x --width."""
    if options.buckets != "aspect":
        return None
    from diffsynth_mbc.data.media.buckets import bucket_of_key, bucket_set, media_kind

    every = bucket_set(options.height, options.width)
    used: dict = {}
    for key, _ in bucket_samples:
        bucket = bucket_of_key(key)
        if bucket is not None:
            used.setdefault(media_kind(key), []).append(bucket)
    return {kind: largest_bucket(used.get(kind) or every) for kind in ("video", "image")}


def run_plans(options, precision: str, attention: str, cached: bool, compiled: bool, zero2_world_size: int = 1,
              media: tuple[int, int] | None = None, sizing: dict | None = None) -> dict:
    """{"video": Plan, "image": Plan} for the media the run has (both when the counts are not known). With
    ``--buckets aspect`` each at its kind's bucket of ``sizing`` (``sizing_buckets``; without it the largest of every
    bucket: what the training's ``--gradient_checkpointing auto`` sizes for before it has read its rows)."""
    base = memory.Plan(options.height, options.width, options.num_frames, options.batch_size, options.lora_rank,
                       tuple(options.lora_target_modules), precision, cached, memory.DIT["num_layers"],
                       options.use_gradient_checkpointing_offload, attention, zero2_world_size, compiled,
                       fp32_residual=decide_fp32_residual(options.fp32_residual, precision).on)
    plans = {"video": base.but(conditioned=conditioned(options, "video")),
             "image": base.but(num_frames=1, batch_size=image_batch(options), conditioned=conditioned(options, "image"))}
    sizing = sizing or sizing_buckets(options)
    if sizing:
        plans = {kind: plan.but(height=sizing[kind].height, width=sizing[kind].width) for kind, plan in plans.items()}
    if media is not None:
        plans = {kind: plan for kind, plan, count in zip(("video", "image"), plans.values(), media) if count} or plans
    return plans


def conditioned(options, kind: str) -> bool:
    """Whether a batch of ``kind`` may hold a sample conditioned on its first frame (i2v: the per-token time
    modulation, the larger memory): every sample under ``--objective diffsynth``, else clips with an i2v chance."""
    return options.objective == "diffsynth" or (kind == "video" and options.i2v_probability > 0)


def bucket_plan(plans: dict, key: str, options) -> memory.Plan:
    """The plan of one bucket key (``video@1280x704``): its kind's plan at the bucket's size."""
    from diffsynth_mbc.data.media.buckets import bucket_of_key, media_kind

    kind = media_kind(key)
    plan = plans.get(kind) or next(iter(plans.values())).but(
        num_frames=1 if kind == "image" else options.num_frames,
        batch_size=image_batch(options) if kind == "image" else options.batch_size,
        conditioned=conditioned(options, kind))
    bucket = bucket_of_key(key)
    return plan if bucket is None else plan.but(height=bucket.height, width=bucket.width)


def with_checkpointing(options, plans: dict, gpu_bytes: int | None) -> tuple[dict, str]:
    """The plans with the recomputed blocks the training will use, and how that number was decided."""
    recomputed, how = memory.recomputed_from_option(options.gradient_checkpointing, list(plans.values()), gpu_bytes)
    return {kind: plan.but(recomputed_blocks=recomputed) for kind, plan in plans.items()}, how


def memory_summary(plans: dict, gpu_bytes: int, buckets: dict | None = None) -> dict:
    """The larger of the clip and image batch's estimates, itemised, against the GPU; with ``buckets``
    (``RunEstimate.buckets``) the bucket it is sized for, and why that one."""
    totals = {kind: memory.total(memory.estimate(plan)) for kind, plan in plans.items()}
    kind = max(totals, key=totals.get)
    plan = plans[kind]
    items = memory.estimate(plan)
    summary = {"batch": kind, "plan": {**vars(plan), "lora_targets": list(plan.lora_targets), "tokens": plan.tokens},
               "items": [{"item": name, "bytes": size} for name, size in items], "total_bytes": totals[kind],
               "totals_by_batch": totals, "gpu_bytes": gpu_bytes, "limit_bytes": int(memory.FITS_BELOW * gpu_bytes),
               "fits": all(memory.fits(p, gpu_bytes) for p in plans.values())}
    if buckets:
        summary["bucket"] = buckets["sized_for"][kind]
        summary["bucket_note"] = sizing_note(buckets, kind)
    return summary


def sizing_note(buckets: dict, kind: str) -> str:
    """``sized for the largest bucket 960x960 of the 3 the rows use``: what the memory of ``kind``'s batch is for."""
    name = buckets["sized_for"][kind]
    if buckets["in_use"]:
        names = {key.partition("@")[2] for key in buckets["in_use"]}
        return f"sized for the largest bucket {name} of the {len(names)} the rows use"
    return (f"sized for the largest bucket {name} of all {buckets['every']} at --height x --width, the rows' "
            "buckets not read")


def buckets_of(options, sizing: dict | None, bucket_samples) -> dict | None:
    """What the estimate says of the buckets (None with --buckets off): the ones in use, the one sized for per kind."""
    if not sizing:
        return None
    from diffsynth_mbc.data.media.buckets import bucket_set

    return {"in_use": [key for key, _ in bucket_samples], "every": len(bucket_set(options.height, options.width)),
            "sized_for": {kind: bucket.name for kind, bucket in sizing.items()}}


def cache_to_build(options, cached_launch: bool) -> bool:
    """Whether the run starts by building the latent cache (the launcher's --cached, or an unfinished --cache)."""
    from diffsynth_mbc.run_layout import CACHE_INDEX

    if cached_launch:
        return True
    return bool(options.cache) and not (Path(options.cache) / CACHE_INDEX).is_file()


@dataclasses.dataclass
class RunEstimate:
    """What the training will run on the GPU, how fast, for how long, and what was assumed to say so."""
    plans: dict                     # {"video": Plan, "image": Plan}, with the recomputed blocks resolved
    speed: dict                     # per batch kind: StepEstimate.as_dict(); "projection"; or {"unknown": why}
    projection: run_length.Projection | None
    assumptions: list[str]
    buckets: dict | None = None     # --buckets aspect: "in_use" keys, "sized_for" {kind: bucket name}, "every"
    step_plan: object = None        # the step plan the projection used (None: no rows known)


def estimate_run(options, spec, rates_from: str | None, precision: str, *, cudnn_version: int | None = None,
                 gpus: int = 1, nodes: int | None = None, cached_launch: bool = False,
                 media: tuple[int, int] | None = None, zero2_world_size: int = 1, plan=None,
                 stages: bool = True) -> RunEstimate:
    """The run's plans on ``spec`` (a ``GpuSpec``, or None without a GPU), its speed and projected length; ``plan``:
    the step plan already worked out for these rows (``step_plan``), else worked out here."""
    from diffsynth_mbc.gpu import attention_kernel

    capability = spec.capability if spec is not None else None
    attention = attention_kernel(capability, precision, cudnn_version)
    compiled, compile_why = resolve_compile(options.compile, capability)
    build_cache = cache_to_build(options, cached_launch)
    nodes_given = nodes is not None
    nodes = nodes or nodes_from_environment()
    if plan is None and media is not None and options.buckets == "aspect":   # the buckets in use size the memory
        plan = step_plan(options, media, max(1, gpus) * nodes)
    sizing = sizing_buckets(options, plan.bucket_samples if plan is not None else ())
    plans = run_plans(options, precision, attention, bool(options.cache) or cached_launch, compiled,
                      zero2_world_size, media, sizing)
    gpu_bytes = int(spec.memory_gib * GIB) if spec is not None else None
    plans, checkpointing_how = with_checkpointing(options, plans, gpu_bytes)
    buckets = buckets_of(options, sizing, plan.bucket_samples if plan is not None else ())
    assumptions = [compile_why, f"gradient checkpointing {checkpointing_how}",
                   f"attention kernel {attention}: PyTorch's SDPA rule, not measured here",
                   "LoRA and its AdamW state in the training precision (in fp32 they cost about 0.9 GiB and, "
                   "on the H100, 0.22 s/step more: measured)",
                   f"image batch {image_batch(options)}" + ("" if options.image_batch_size else
                                                           " (default: a clip's tokens in images)"),
                   f"{gpus} GPU(s) per node x {nodes} node(s)" + ("" if nodes_given else " (nodes: NUM_MACHINES, else 1)")]
    if build_cache:
        assumptions.append("the latent cache is built first (--cached, or --cache without a finished cache)")
    if buckets:
        sized = ", ".join(f"{'clips' if kind == 'video' else 'images'} at {buckets['sized_for'][kind]}" for kind in plans)
        source = (f"the largest of the {len({key.partition('@')[2] for key in buckets['in_use']})} buckets the rows use"
                  if buckets["in_use"] else f"the largest of all {buckets['every']} buckets: the rows' not read")
        assumptions.append(f"--buckets aspect: memory sized for {sized} ({source}); seconds per step at each "
                           "bucket's tokens")
    speed_figures, run = speed_summary(options, spec, rates_from, plans, media, gpus, nodes, build_cache, plan)
    if run is not None and stages:   # --resolution_stages: each stage's steps at its size; a plain plan's alternative
        at_sizes = dict(spec=spec, rates_from=rates_from, precision=precision, cudnn_version=cudnn_version, gpus=gpus,
                        nodes=nodes, cached_launch=cached_launch, media=media, zero2_world_size=zero2_world_size)
        run = staged(options, run, at_sizes)
        speed_figures["projection"] = run.as_dict()
    return RunEstimate(plans, speed_figures, run, assumptions, buckets,
                       run.shape.plan if run is not None else plan)


def stage_latents_seconds(at_stage, at_sizes: dict) -> float:
    """A stage's part of the cache build: its latents (its rows' VAE encode at its size); the captions are encoded
    once, for the final size's entries."""
    if at_stage.cache_build_seconds is None:
        return 0.0
    shape, ratio = at_stage.shape, speed.gpu_ratios(at_sizes["spec"], at_sizes["precision"])[0]
    rows = math.ceil(shape.videos / shape.gpus) + math.ceil(shape.images / shape.gpus)
    return max(0.0, at_stage.cache_build_seconds - rows * speed.CACHE_CAPTION_S * ratio)


SUGGESTED_SHARE = 0.7   # a plain plan's staged alternative: 70% of the steps at the lower size (Wan's 480p for 720p)


def suggested_stage(options):
    """The staged alternative the doctor shows a plain plan (a ``Stage``): Wan2.2's 832x480 under 1280x704, else two
    thirds of each side (multiples of 32), for 70% of the steps."""
    from diffsynth_mbc.data.media.stages import Stage, side

    if (options.width, options.height) == (1280, 704):
        return Stage(832, 480, None, SUGGESTED_SHARE)
    return Stage(side(options.width * 2 / 3), side(options.height * 2 / 3), None, SUGGESTED_SHARE)


def staged(options, run, at_sizes: dict):
    """``run`` with each --resolution_stages stage's training (the whole run's seconds at its size and its cache
    build, from the same model), or, for a plain plan, the length ``suggested_stage`` would give it."""
    stages, flag = options.resolution_stages, None
    if not stages:
        suggested = suggested_stage(options)
        if (suggested.width, suggested.height) == (options.width, options.height):
            return run
        stages, flag = (suggested,), f"{suggested.name}:{suggested.share:g}"
    measured = []
    for stage in stages:
        stage_options = options.replace(width=stage.width, height=stage.height, resolution_stages=None,
                                        num_frames=stage.num_frames or options.num_frames)
        at_stage = estimate_run(stage_options, stages=False, **at_sizes).projection
        if at_stage is None:
            return run
        measured.append((stage.name, stage.share, at_stage.final_size_seconds, stage_latents_seconds(at_stage, at_sizes)))
    if flag is None:
        return dataclasses.replace(run, stages=tuple(measured))
    alternative = dataclasses.replace(run, stages=tuple(measured))
    return dataclasses.replace(run, staged_alternative=(flag, alternative.total_seconds))


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
        shape = run_shape(options, media, gpus, nodes, plan)
        buckets = {key: speed.seconds_per_step(bucket_plan(plans, key, options), spec, rates_from,
                                               options.gradient_accumulation_steps)
                   for key, _ in shape.plan.bucket_samples}
        if buckets:
            out["buckets"] = {key: {"seconds_per_step": round(e.seconds, 3), "tokens": bucket_plan(plans, key, options)
                                    .tokens, "kind": "measured" if e.measured else "estimate"}
                              for key, e in buckets.items()}
        run = project(options, steps, plans, spec, shape, build_cache, buckets)
        out["projection"] = run.as_dict()
    return out, run


def project(options, steps: dict, plans: dict, spec, shape: run_length.RunShape,
            build_cache: bool, buckets: dict | None = None) -> run_length.Projection:
    """The run's length at ``steps``' seconds per step of each batch kind, or with ``buckets`` ({key: StepEstimate},
    --buckets aspect) at each bucket's."""
    tensor_ratio, bandwidth_ratio = speed.gpu_ratios(spec, plans[next(iter(plans))].precision)
    encode = {}
    if build_cache:   # each row at the size its kind's steps are estimated at
        encode = {kind: speed.cache_encode_seconds(plan, tensor_ratio) for kind, plan in plans.items()}
    seconds = {kind: estimate.seconds for kind, estimate in steps.items()}
    measured = all(e.measured for e in [*steps.values(), *(buckets or {}).values()])
    kind = "measured" if measured and not build_cache else "estimate"
    evaluation = evaluation_cost(options, shape.total_steps, shape.gpus, tensor_ratio, bandwidth_ratio,
                                 sample_prompts_of(options))
    return run_length.project(shape, seconds.get("video"), seconds.get("image"), encode.get("video"),
                              encode.get("image"), kind=kind,
                              bucket_seconds={key: e.seconds for key, e in buckets.items()} if buckets else None,
                              evaluation=evaluation)


def sample_prompts_of(options) -> list | None:
    """The run's sample prompts, as the training reads them; None without a readable --sample_prompts file (the
    doctor's checks name a bad one)."""
    if not options.sample_prompts:
        return None
    from diffsynth_mbc.errors import OptionsError
    from diffsynth_mbc.sample_prompts import load_sample_prompts

    try:
        return load_sample_prompts(options.sample_prompts, height=options.height, width=options.width,
                                   num_frames=options.num_frames, seed=options.seed)
    except (OptionsError, OSError):
        return None


def step_plan(options, media: tuple[int, int], world_size: int):
    """The training's step plan for these rows on ``world_size`` GPUs (every node's): the one function the training,
    ``python -m diffsynth_mbc.plan`` and the status files plan with; several catalogues count their own repeats."""
    from diffsynth_mbc.data.dataset_list import metadata_counts
    from diffsynth_mbc.training.plan.step_plan import plan_from_options

    counts = metadata_counts(options) if options.datasets else ()
    return plan_from_options(options, rows=media[0] + media[1], images=media[1], world_size=max(1, world_size),
                             datasets=counts, bucket_samples=readable_bucket_samples(options))


_BUCKET_SAMPLES: dict = {}


def readable_bucket_samples(options) -> tuple:
    """``bucket_samples_of_metadata``, once per metadata file and sizes (reading the rows' buckets may read every
    file's header); () when the metadata cannot be read: the estimate then sizes for every bucket."""
    from diffsynth_mbc.errors import MetadataError
    from diffsynth_mbc.training.plan.step_plan import bucket_samples_of_metadata

    if options.buckets != "aspect":
        return ()
    path = options.dataset_metadata_path
    try:
        stat = os.stat(path)
    except (OSError, TypeError, ValueError):
        return ()
    key = (path, stat.st_mtime_ns, stat.st_size, options.dataset_base_path, options.height, options.width,
           options.dataset_repeat, repr(options.datasets))
    if key not in _BUCKET_SAMPLES:
        try:
            _BUCKET_SAMPLES[key] = bucket_samples_of_metadata(options)
        except (OSError, MetadataError):
            return ()
    return _BUCKET_SAMPLES[key]


def run_shape(options, media: tuple[int, int], gpus: int, nodes: int, plan=None,
              unit: str = "GPU") -> run_length.RunShape:
    """The run's shape: ``plan`` (the step plan already printed), else the step plan of ``gpus`` x ``nodes``."""
    nodes = max(1, nodes)
    return run_length.RunShape(plan or step_plan(options, media, max(1, gpus) * nodes), nodes, unit)
