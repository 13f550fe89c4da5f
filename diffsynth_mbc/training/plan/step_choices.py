"""What the fast step does on this machine: how many blocks recompute, whether blocks compile, whether the DiT's
residual stream is fp32. Said in the status file (``compile``, ``recompute_blocks``, ``fp32_residual`` and their
reasons) and printed by rank 0 beside the precision."""

from __future__ import annotations

from diffsynth_mbc.training.plan.residual_policy import decide_fp32_residual


def step_choices(options, status, accelerator, num_blocks: int) -> tuple[int, bool]:
    """(blocks that recompute, compile or not) for this GPU, each said in the status file and by rank 0."""
    import torch

    from diffsynth_mbc.training.plan.recompute import recompute_blocks
    from diffsynth_mbc.training.plan.compile_policy import decide_compile

    cuda = accelerator.device.type == "cuda"
    capability = tuple(torch.cuda.get_device_capability(accelerator.device)) if cuda else None
    triton_ok = False
    if cuda:
        from torch.utils._triton import has_triton
        triton_ok = has_triton()
    decision = decide_compile(options.compile, cuda, capability, triton_ok)
    auto_blocks = auto_recompute_blocks(options, accelerator, num_blocks, decision.compile) if cuda else None
    recompute, why = recompute_blocks(options.gradient_checkpointing, num_blocks, auto_blocks)
    status.update(compile=decision.compile, compile_reason=decision.reason, recompute_blocks=recompute,
                  gradient_checkpointing_reason=why)
    return recompute, decision.compile


def auto_recompute_blocks(options, accelerator, num_blocks: int, compiled: bool) -> int | None:
    """``--gradient_checkpointing auto``: the memory model's fewest recomputed blocks for this GPU, for
    the run's clip batch and image batch (the larger decides)."""
    if options.gradient_checkpointing != "auto":
        return None
    import torch

    from diffsynth_mbc.training.plan import memory
    from diffsynth_mbc.training.plan.estimates import run_plans
    from diffsynth_mbc.gpu import attention_kernel

    capability = tuple(torch.cuda.get_device_capability(accelerator.device))
    precision = accelerator.mixed_precision
    plans = run_plans(options, precision, attention_kernel(capability, precision), bool(options.cache), compiled)
    total = torch.cuda.get_device_properties(accelerator.device).total_memory
    return min(num_blocks, memory.blocks_to_recompute(list(plans.values()), total))


def residual_choice(options, status, precision: str) -> bool:
    """``--fp32_residual`` for this run's precision (accelerate's value), said in the status file."""
    decision = decide_fp32_residual(options.fp32_residual, precision)
    status.update(fp32_residual=decision.on, fp32_residual_reason=decision.reason)
    return decision.on
