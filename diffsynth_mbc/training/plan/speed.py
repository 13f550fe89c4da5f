"""Seconds per optimizer step from step times measured on an H100, scaled to other GPUs (pure Python, no torch).

Measured on one H100 80GB SXM (torch 2.11, diffsynth 1.1.8, full-size TI2V-5B with random weights,
1280x704x17 = 4,400 tokens, batch 1, LoRA rank 32 on q,k,v,o,ffn.0,ffn.2, AdamW, from the latent cache):

    LoRA fp32, eager, every block recomputed, cuDNN attention        0.77 s
        ... memory-efficient attention                               0.95 s
        ... math attention                                           1.91 s
        ... no block recomputed                                      0.51 s
        ... one image (880 tokens)                                   0.61 s
    LoRA bf16, eager, every block recomputed                         0.55 s
    LoRA bf16, compiled blocks, every block recomputed               0.39 s
    LoRA bf16, compiled blocks, no block recomputed                  0.27 s
    fp16, LoRA fp16, compiled, every block, memory-efficient         0.57 s
    encoding every step (the launcher, bf16)                         1.44 s   (so encoding adds 0.67 s a clip)

How the rest follows (each figure says which rule made it):

- FLOPs: 1.56e14 per 4,400-token step (the convention of the MFU figures). Other sizes scale it by the
  forward pass's own split: the linear layers grow with tokens, self-attention with tokens squared
  (15% of it at 4,400 tokens); a batch multiplies it.
- Recomputed blocks: linear between every block (30) and none (0). Where only one end was measured,
  the other follows the measured ratio none/all (0.69 compiled, 0.66 eager).
- Attention kernel: flash is taken as fast as cuDNN; memory-efficient adds 0.18 s (measured twice),
  math 1.14 s, for every block recomputed; without recomputation 3/4 of that (forward + backward of
  attention, without its second forward).
- Tokens: a step is a part that does not grow with tokens plus a part that grows with the FLOPs. The
  one-image measurement gives the second part: 0.194 s of a 4,400-token step with every block recomputed
  (3/4 of it with none); the rest of each configuration's time is the first part.
- Other GPUs: the FLOP-bound part is scaled by the ratio of dense tensor-core TFLOPS in the training
  precision (fp32 CUDA-core TFLOPS for emulated bf16 and for fp32), the rest by the ratio of memory
  bandwidth where the GPU has less of it than the H100, and not at all where it has more: an H200
  (1.43x the bandwidth, the same tensor rate) measured the H100's step times, 0.40 / 0.27 / 0.55 / 0.58 s
  for the rows 0.39 / 0.27 / 0.55 / 0.57 above (2026-11-26, torch 2.11.0+cu130, bench_cache.py
  --full-size; benchmarks/results/2026-11-26-h200.json), so that part is launch and host time, not
  bytes. These are estimates; only the H100 rows above are measurements.
- Encoding every step: 0.67 s per 1280x704x17 clip on the H100, scaled by frames x pixels and by the
  tensor-rate ratio.
- Building the latent cache: measured directly on one H200 (2026-11-26, torch 2.11.0+cu130, bf16,
  ``benchmarks/bench_encode.py --full-size``; benchmarks/results/2026-11-26-h200-encode/), the cache builder's
  own encoder, one row at a time, at full size with random weights:

      one 1280x704x17 clip through the Wan2.2 VAE (the clip, then its first frame again)   0.353 s
      one 1280x704 image (the image, then again as its first frame)                         0.041 s
      one caption through umt5-xxl (512 tokens)                                             0.028 s

  so 0.0196 s per 1280x704 frame encoded (the image's 0.0205) plus 0.028 s per caption, scaled by pixels and
  by the tensor-rate ratio (the H200 has the H100's). A caption is counted per row: rows that share one
  encode it once, so the build is at most this long. The in-loop 0.67 s above is higher than the cache's 0.38
  s per video row: the training process encodes beside the DiT, not alone.

The real training loop measured 0.68 s/step for fp16 from the cache on that H100, where a bare loop of
the same step took 0.86 s: the figures above come from bare loops and are on the slow side.

The host's floor. A step is also Python on the CPU (the Accelerator, the LoRA module, 30 block calls and their
guards, AdamW over 600 tensors), which the GPU's work overlaps: a step takes the longer of the two, so a step
with little GPU work (one image, a low-resolution stage) costs the host's time whatever its tokens. Measured as
the one-image step (880 tokens: its GPU part is about a fifth of a clip's) on two boxes, compiled blocks
(``benchmarks/bench_rows.py --full-size``):

    box (results file)                              none recomputed   all 30 recomputed   one image + 4 more
    H200 (2026-11-26-h200.json)                     0.158 s           0.351 s             below the GPU's
    H100 (2026-11-28-h100.json)                     0.255 s           0.48 s (clip 0.47)  +0.03 to +0.04 s

so the floor is a part at no recomputed block, a part per recomputed block and a part per sample beyond the
first, x 1.36 uncompiled (the H200's eager/compiled one-image steps, 0.476 / 0.351 s). It is the CPU's, not the
GPU's: the H100 box's CPU was 1.6x slower than the H200 box's. An H200 takes the H200 box's floor, every other GPU
the H100 box's (the slower: a V100S's steps are far above it anyway); ``doctor --probe`` measures yours. The
GPU's part of a step grows with its tokens, the part that scales with FLOPs by the tensor rate and the rest by
the bandwidth where the GPU has less than the H100.
"""

from __future__ import annotations

import dataclasses

from diffsynth_mbc.training.plan import memory

REFERENCE_GPU = "H100-80GB"
REFERENCE_TFLOPS = 989.0          # dense bf16 tensor cores
REFERENCE_BANDWIDTH_GBS = 3350.0
REFERENCE_TOKENS = 4400
STEP_FLOPS = 1.56e14              # per 4,400-token training step, batch 1
LAYERS = memory.DIT["num_layers"]

# (lora_dtype, compiled, recomputed: "all" | "none", attention) -> seconds per step on the H100 at 4,400 tokens
H100_STEPS = {
    ("fp32", False, "all", "cudnn"): 0.77, ("fp32", False, "all", "mem_efficient"): 0.95,
    ("fp32", False, "all", "math"): 1.91, ("fp32", False, "none", "cudnn"): 0.51,
    ("base", False, "all", "cudnn"): 0.55, ("base", True, "all", "cudnn"): 0.39,
    ("base", True, "none", "cudnn"): 0.27, ("base", True, "all", "mem_efficient"): 0.57,
}
H100_ONE_IMAGE = 0.61             # LoRA fp32, eager, every block recomputed, cuDNN, 880 tokens
H100_ENCODE_STEP = 1.44           # the launcher encoding every step (bf16), against the cached 0.77
ATTENTION_EXTRA = {"cudnn": 0.0, "flash": 0.0, "mem_efficient": 0.18, "math": 1.14}
CACHE_VAE_FRAME_S = 0.0196        # the cache build: one 1280x704 frame through the VAE, bf16, H200 (= H100 rate)
CACHE_CAPTION_S = 0.028           # the cache build: one caption through umt5-xxl, 512 tokens
# The host's floor of a step, compiled blocks: (s with no block recomputed, s per recomputed block), per box
HOST_FLOOR = {"H200-141GB": (0.158, 0.0064), "H100-80GB": (0.255, 0.0075)}
HOST_FLOOR_OTHER = "H100-80GB"    # the slower box's, for every GPU not measured
HOST_PER_EXTRA_SAMPLE = 0.008     # s per sample of a batch beyond the first (5 images: +0.03 s on the H100 box)
HOST_EAGER_FACTOR = 1.36          # uncompiled blocks: the H200's one-image steps, 0.476 / 0.351 s


def attention_share(tokens: int = REFERENCE_TOKENS) -> float:
    """Self-attention's share of the forward FLOPs of one sample of ``tokens`` tokens."""
    d, f, text = memory.DIT["dim"], memory.DIT["ffn_dim"], memory.TEXT_TOKENS
    attention = 4 * tokens * tokens * d
    linear = 2 * tokens * (6 * d * d + 2 * d * f) + 4 * tokens * text * d + 4 * d * d * text
    return attention / (attention + linear)


def work(tokens: int, batch: int = 1) -> float:
    """FLOPs of a step of ``batch`` samples of ``tokens`` tokens, relative to one 4,400-token sample."""
    quadratic = attention_share()
    x = tokens / REFERENCE_TOKENS
    return batch * ((1 - quadratic) * x + quadratic * x * x)


def step_flops(tokens: int, batch: int = 1) -> float:
    return STEP_FLOPS * work(tokens, batch)


FLOP_BOUND_ALL = (0.77 - H100_ONE_IMAGE) / (1 - work(880))   # s of a 4,400-token step that scales with FLOPs


def _recompute_work(recomputed: int) -> float:
    """Compute of a step with ``recomputed`` blocks, relative to all 30 (forward 1 + backward 2 + recompute 1)."""
    return (3 + recomputed / LAYERS) / 4


def _h100_end(lora: str, compiled: bool, end: str) -> tuple[float, str]:
    """Seconds per 4,400-token step with cuDNN attention and every block (end 'all') or none recomputed."""
    key = (lora, compiled, end, "cudnn")
    if key in H100_STEPS:
        return H100_STEPS[key], "measured"
    if end == "all":   # compiled with an fp32 LoRA: the compiled time x what fp32 costs eager
        return H100_STEPS[("base", True, "all", "cudnn")] * 0.77 / 0.55, "compiled x (fp32 LoRA / bf16 LoRA eager)"
    ratio = 0.27 / 0.39 if compiled else 0.51 / 0.77
    return _h100_end(lora, compiled, "all")[0] * ratio, f"every block recomputed x {ratio:.2f} (measured none/all)"


def h100_seconds(plan: memory.Plan) -> tuple[float, float, list[str], bool]:
    """(seconds, FLOP-bound seconds, sources, measured) of a 4,400-token step on the H100 with ``plan``'s settings."""
    lora = "fp32" if plan.lora_dtype == "fp32" else "base"
    attention = plan.attention if plan.attention in ATTENTION_EXTRA else "cudnn"
    recomputed = max(0, min(LAYERS, plan.recomputed_blocks))
    exact = {0: "none", LAYERS: "all"}.get(recomputed)
    key = (lora, plan.compiled, exact, attention)
    what = (f"LoRA {'fp32' if lora == 'fp32' else 'in the training precision'}, "
            f"{'compiled' if plan.compiled else 'eager'}, {recomputed} of {LAYERS} blocks recomputed, "
            f"{attention} attention")
    flop_bound = FLOP_BOUND_ALL * _recompute_work(recomputed)
    extra = ATTENTION_EXTRA[attention] * _recompute_work(recomputed)
    if key in H100_STEPS:
        return H100_STEPS[key], flop_bound + extra, [f"H100 {what}: {H100_STEPS[key]} s measured"], True
    (all_s, all_how), (none_s, none_how) = (_h100_end(lora, plan.compiled, end) for end in ("all", "none"))
    seconds = none_s + (all_s - none_s) * recomputed / LAYERS + extra
    sources = [f"H100 {what}: {seconds:.2f} s derived from every block recomputed {all_s:.2f} s ({all_how}) "
               f"and none {none_s:.2f} s ({none_how})"
               + (f", + {extra:.2f} s for {attention} attention (measured difference)" if extra else "")]
    if attention == "flash":
        sources.append("flash attention taken as fast as cuDNN (not measured)")
    return seconds, flop_bound + extra, sources, False


@dataclasses.dataclass(frozen=True)
class StepEstimate:
    seconds: float                # one optimizer step (all accumulated micro-batches)
    flops: float                  # model FLOPs of that step (the 1.56e14 convention)
    mfu: float | None             # model-FLOPs utilisation against the GPU's tensor peak in the precision
    measured: bool                # True only for an H100 row measured as such
    sources: tuple[str, ...]

    def as_dict(self) -> dict:
        return {"seconds_per_step": round(self.seconds, 3), "model_tflop_per_step": round(self.flops / 1e12, 1),
                "mfu": None if self.mfu is None else round(self.mfu, 3),
                "kind": "measured" if self.measured else "estimate", "sources": list(self.sources)}


def gpu_ratios(spec, precision: str) -> tuple[float, float] | None:
    """(tensor-rate ratio, bandwidth ratio) of the H100 over ``spec`` in ``precision``; None without rates."""
    rate = spec.tensor_tflops(precision) if spec is not None else None
    if not rate or not spec.bandwidth_gbs:
        return None
    reference = REFERENCE_TFLOPS if precision in ("bf16", "fp16") else 67.0   # the H100's fp32 rate
    return reference / rate, REFERENCE_BANDWIDTH_GBS / spec.bandwidth_gbs


def encode_seconds(plan: memory.Plan, tensor_ratio: float = 1.0) -> float:
    """Encoding (VAE + text encoder) of one optimizer step's samples, from the H100's 0.67 s per 1280x704x17 clip."""
    per_clip = H100_ENCODE_STEP - H100_STEPS[("fp32", False, "all", "cudnn")]
    share = plan.num_frames * plan.height * plan.width / (17 * 704 * 1280)
    return per_clip * share * plan.batch_size * tensor_ratio


def cache_encode_seconds(plan: memory.Plan, tensor_ratio: float = 1.0) -> float:
    """Seconds to cache one row of ``plan``'s size (a clip when ``plan.num_frames`` > 1, else an image): its frames
    and its first frame again through the VAE, and its caption, measured on an H200 and scaled by pixels and by
    the tensor-rate ratio."""
    frames = plan.num_frames + 1   # the first frame is encoded a second time, as the clip's condition
    pixels = plan.height * plan.width / (704 * 1280)
    return (CACHE_VAE_FRAME_S * frames * pixels + CACHE_CAPTION_S) * tensor_ratio


def host_seconds(plan: memory.Plan, rates_from: str | None) -> tuple[float, str]:
    """The host's floor of one step of ``plan`` (seconds, which box it was measured on)."""
    box = rates_from if rates_from in HOST_FLOOR else HOST_FLOOR_OTHER
    base, per_block = HOST_FLOOR[box]
    recomputed = max(0, min(LAYERS, plan.recomputed_blocks))
    seconds = base + per_block * recomputed + HOST_PER_EXTRA_SAMPLE * (plan.batch_size - 1)
    return seconds * (1.0 if plan.compiled else HOST_EAGER_FACTOR), box


def seconds_per_step(plan: memory.Plan, spec, rates_from: str | None, accumulation: int = 1) -> StepEstimate | None:
    """Seconds per optimizer step of ``plan`` on ``spec`` (None when the GPU's rates are unknown)."""
    ratios = gpu_ratios(spec, plan.precision)
    if ratios is None:
        return None
    tensor_ratio, bandwidth_ratio = ratios
    reference, flop_bound, sources, measured = h100_seconds(plan)
    fixed = max(0.0, reference - flop_bound)
    attention = ATTENTION_EXTRA.get(plan.attention, 0.0) * _recompute_work(plan.recomputed_blocks)
    scale = work(plan.tokens, plan.batch_size)
    quadratic = plan.batch_size * (plan.tokens / REFERENCE_TOKENS) ** 2
    if plan.precision == "no":
        fixed *= 2   # twice the bytes
    linear = plan.batch_size * plan.tokens / REFERENCE_TOKENS
    by_bandwidth = fixed * linear * max(1.0, bandwidth_ratio)   # more bandwidth than the H100's buys nothing (H200)
    gpu = by_bandwidth + ((flop_bound - attention) * scale + attention * quadratic) * tensor_ratio
    host, box = host_seconds(plan, rates_from)
    seconds = max(gpu, host)
    if scale != 1:
        sources.append(f"{plan.tokens} tokens x batch {plan.batch_size}: {scale:.3f} of the FLOPs of 4,400 tokens, "
                       f"{linear:.3f} of the rest")
    if host > gpu:
        sources.append(f"host-bound: the CPU's {host:.2f} s per step (measured on the {box} box, "
                       f"{plan.recomputed_blocks} blocks recomputed) is above the GPU's {gpu:.2f} s; "
                       "doctor --probe measures this machine's")
        measured = False
    if not plan.cached:
        seconds += encode_seconds(plan, tensor_ratio)
        sources.append("encoding every step: 0.67 s per 1280x704x17 clip on the H100 (1.44 - 0.77 s measured), "
                       "scaled by frames x pixels")
    measured = measured and rates_from == REFERENCE_GPU and scale == 1 and plan.cached
    if rates_from != REFERENCE_GPU:
        bandwidth = (f"bandwidth {bandwidth_ratio:.1f}x lower than the H100" if bandwidth_ratio >= 1 else
                     "more bandwidth than the H100, taken as no faster (an H200 measured the H100's step times)")
        sources.append(f"scaled to {rates_from}: tensor rate {tensor_ratio:.1f}x lower, {bandwidth} (estimate)")
    seconds *= accumulation
    flops = step_flops(plan.tokens, plan.batch_size) * accumulation
    peak = spec.tensor_tflops(plan.precision)
    return StepEstimate(seconds, flops, flops / (seconds * peak * 1e12) if peak else None, measured, tuple(sources))
