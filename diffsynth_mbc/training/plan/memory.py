"""Memory per GPU of a Wan2.2-TI2V-5B LoRA training, itemised (pure Python, no torch).

Parameter counts follow the architecture (DiffSynth's ``WanModel`` with the TI2V-5B config, the
UMT5-XXL encoder, the Wan2.2 VAE); the tests recount them from DiffSynth's own classes. The working
sets are calibrated on peaks measured on one H100 80GB (torch 2.11, diffsynth 1.1.8, full-size
TI2V-5B with random weights, 1280x704x17 = 4,400 tokens, batch 1, LoRA rank 32 on q,k,v,o,ffn.0,ffn.2,
``torch.cuda.max_memory_allocated``):

    LoRA fp32, cached, every block recomputed          12.8 GiB   (memory-efficient attention: the same)
    LoRA fp32, cached, no block recomputed             50.3 GiB
    LoRA fp32, encoding every step, every block        26.0 GiB   (the peak is while the VAE encodes)
    LoRA fp32, encoding every step, no block           62.2 GiB
    LoRA fp32, cached, every block, math attention     18.6 GiB
    LoRA bf16, cached, every block                     11.9 GiB
    LoRA bf16, cached, compiled blocks, none           35.0 GiB
    LoRA fp32, cached, one image (880 tokens)          11.0 GiB

Activations scale with tokens x batch (the math kernel's score matrices with tokens squared x batch). The figures
above are clips conditioned on their first frame (i2v), whose time modulation is per token: a block keeps it for
backward. An image (t2i) or a t2v clip takes one modulation per sample instead, and each sample of a batch keeps
its own text context for the cross-attention's backward. Measured on one H100 80GB (2026-11-28,
``benchmarks/bench_rows.py --full-size``, compiled, no block recomputed, benchmarks/results/2026-11-28-h100.json):

    1280x704x17 clip, i2v                              35.7 GiB
    1280x704x17 clip, t2v                              29.6 GiB   (6.1 GiB less: the per-token modulation)
    5 images 1280x704 in one forward (t2i)             30.6 GiB   (4 more samples' text contexts: +1.0 GiB)
    5 images 960x960                                   31.1 GiB
``tests/training/plan/test_memory.py`` holds the model to these figures, all of them DiffSynth's forward.

The fp32 residual stream (``--fp32_residual``, ``training/step/fp32_residual.py``) keeps more: in each block that
keeps its activations, the inputs of its three norms (which their backward reads) are fp32 instead of the training
precision; the input a recomputed block keeps is fp32; backward carries the stream's gradient in fp32. Its modulation
costs what DiffSynth's does (four fp32 chunks kept instead of the six chunks' one tensor in fp16/bf16). Counted from
what autograd saves (``benchmarks/bench_fp32_residual.py``, on the CPU: 2 bytes more for 3.2 values of the stream's
width per token and kept block on the demo's DiT, 3.0 on a 384-wide one), not yet measured on a GPU.
"""

from __future__ import annotations

import dataclasses
import math

from diffsynth_mbc.training.plan.recompute import parse_choice, recompute_blocks

GIB = 1024 ** 3

DIT = dict(dim=3072, ffn_dim=14336, num_layers=30, num_heads=24, in_dim=48, out_dim=48, text_dim=4096,
           freq_dim=256, patch=(1, 2, 2))
# --demo's tiny model (models/pipeline.py TINY_DIT; its text encoder's width is text_dim, its text 32 tokens long)
DEMO_DIT = dict(DIT, dim=64, ffn_dim=128, num_layers=2, num_heads=2, text_dim=32, freq_dim=32)
DEMO_TEXT_TOKENS = 32
TEXT_ENCODER_PARAMS = 5_680_910_336   # UMT5-XXL encoder (models_t5_umt5-xxl-enc-bf16.pth)
VAE_PARAMS = 704_688_668              # Wan2.2 VAE (Wan2.2_VAE.pth)
TEXT_TOKENS = 512                     # DiffSynth pads every prompt to 512 tokens
VAE_SPATIAL, VAE_TEMPORAL, VAE_CHANNELS = 16, 4, 48
BYTES = {"bf16": 2, "fp16": 2, "no": 4}

# Calibrated on the H100 figures above (values of the training precision's size):
KEPT_PER_TOKEN = 52.4 * DIT["dim"]      # one block's activations kept for backward, per token
BACKWARD_PER_TOKEN = 2.4 * DIT["dim"]   # what backward holds besides them, per token
VAE_PER_PIXEL = 2050                    # the VAE encoder's working set, per pixel of a frame (one sample)
MODULATION_PER_TOKEN = 12.8 * DIT["dim"]   # of KEPT_PER_TOKEN: the per-token time modulation (i2v only)
CONTEXT_PER_TEXT_TOKEN = 4.5 * DIT["dim"]  # a block keeps per text token of each sample (cross-attention)
MATH_SCORES_IN_FLIGHT = 6.7             # score-matrix-sized tensors of the block in backward (math kernel)
MATH_SCORES_KEPT = 1                    # ... kept per block that is not recomputed (its softmax; not measured)
COMPILED_KEPT_SHARE = 0.63              # a compiled block keeps this share of an eager block's activations
FP32_RESIDUAL_KEPT_PER_TOKEN = 3 * DIT["dim"]   # values a kept block holds in fp32 instead (its three norms' inputs)
FP32_RESIDUAL_BACKWARD_PER_TOKEN = DIT["dim"]   # the stream's gradient, in fp32 instead
# Assumed, not measured here:
CUDA_CONTEXT_BYTES = int(0.6 * GIB)     # CUDA context, cuBLAS/cuDNN workspaces (outside PyTorch's allocator)
FITS_BELOW = 0.90                       # the rest is for the allocator's cached blocks (H100: 15.9 GiB
                                        # reserved at a 12.8 GiB peak) and fragmentation


def dit_params(dim=DIT["dim"], ffn_dim=DIT["ffn_dim"], num_layers=DIT["num_layers"], in_dim=DIT["in_dim"],
               out_dim=DIT["out_dim"], text_dim=DIT["text_dim"], freq_dim=DIT["freq_dim"], patch=DIT["patch"]) -> int:
    patch_volume = math.prod(patch)
    linear = lambda fan_in, fan_out: fan_in * fan_out + fan_out  # noqa: E731 - weight + bias
    attention = 4 * linear(dim, dim) + 2 * dim                   # q, k, v, o + RMSNorm of q and k
    block = 2 * attention + 2 * dim + linear(dim, ffn_dim) + linear(ffn_dim, dim) + 6 * dim  # + norm3, modulation
    return (in_dim * dim * patch_volume + dim                     # patch embedding (Conv3d)
            + linear(text_dim, dim) + linear(dim, dim)            # text embedding
            + linear(freq_dim, dim) + linear(dim, dim)            # time embedding
            + linear(dim, 6 * dim)                                # time projection
            + num_layers * block
            + linear(dim, out_dim * patch_volume) + 2 * dim)      # head + its modulation


def lora_params(rank: int, targets: list[str], dim=DIT["dim"], ffn_dim=DIT["ffn_dim"],
                num_layers=DIT["num_layers"]) -> int:
    """LoRA A (rank x in) + B (out x rank) on every Linear whose name ends with a target, as DiffSynth matches."""
    shapes = {"q": (dim, dim), "k": (dim, dim), "v": (dim, dim), "o": (dim, dim),
              "ffn.0": (dim, ffn_dim), "ffn.2": (ffn_dim, dim)}
    per_attention = sum(rank * sum(shapes[t]) for t in targets if t in ("q", "k", "v", "o"))
    per_ffn = sum(rank * sum(shapes[t]) for t in targets if t in ("ffn.0", "ffn.2"))
    return num_layers * (2 * per_attention + per_ffn)   # self- and cross-attention both match q, k, v, o


def tokens(height: int, width: int, num_frames: int) -> int:
    latent_frames = (num_frames - 1) // VAE_TEMPORAL + 1
    patch = DIT["patch"]
    return latent_frames * (height // VAE_SPATIAL // patch[1]) * (width // VAE_SPATIAL // patch[2])


def default_image_batch(height: int, width: int, num_frames: int, batch_size: int = 1) -> int:
    """``--image_batch_size`` when not given, as the training takes it (``training.batches``): as many images as
    ``batch_size`` clips have tokens (5 at 1280x704x17)."""
    from diffsynth_mbc.training.plan.batches import default_image_batch_size

    return default_image_batch_size(batch_size, num_frames)


@dataclasses.dataclass(frozen=True)
class Plan:
    """What decides the memory of one training process (one forward: a batch of clips, or of images)."""
    height: int
    width: int
    num_frames: int
    batch_size: int = 1
    lora_rank: int = 32
    lora_targets: tuple[str, ...] = ("q", "k", "v", "o", "ffn.0", "ffn.2")
    precision: str = "bf16"              # accelerate's value: bf16, fp16 or no (fp32)
    cached: bool = False                 # training from the latent cache: no text encoder, no VAE
    recomputed_blocks: int = DIT["num_layers"]   # DiT blocks that recompute their activations in backward
    checkpointing_offload: bool = False  # the recomputed blocks' inputs kept in CPU memory
    attention: str = "cudnn"             # cudnn | flash | mem_efficient | math (diffsynth_mbc.gpu.attention_kernel)
    zero2_world_size: int = 1            # DeepSpeed ZeRO-2 shards grads and optimizer state over this many
    compiled: bool = False               # every DiT block torch.compile'd
    # master (the training): LoRA weights and AdamW state fp32, computed in the training precision;
    # fp32: the same storage computed in fp32 (peft's upcast; measured as built before); base: all in the
    # training precision (measured for comparison)
    lora_dtype: str = "master"
    # a sample conditioned on its first frame (i2v: the DiT's time modulation per token) is in the batch; images
    # (t2i) and t2v clips take one modulation per sample
    conditioned: bool = True
    # the DiT's residual stream in fp32 (--fp32_residual); False: DiffSynth's forward, as every figure was measured
    fp32_residual: bool = False

    def but(self, **changes) -> "Plan":
        return dataclasses.replace(self, **changes)

    @property
    def tokens(self) -> int:
        return tokens(self.height, self.width, self.num_frames)


def _lora_items(plan: Plan) -> list[tuple[str, int]]:
    count = lora_params(plan.lora_rank, list(plan.lora_targets))
    fp32 = plan.lora_dtype in ("fp32", "master") or plan.precision == "no"
    size, name = (4, "fp32") if fp32 else (BYTES[plan.precision], plan.precision)
    shard = max(1, plan.zero2_world_size)
    part = f", 1/{shard}" if shard > 1 else ""
    items = [(f"LoRA parameters ({name})", count * size),
             (f"LoRA gradients ({name}){part}", count * size // shard),
             (f"AdamW state ({name} m, v){part}", 2 * count * size // shard)]
    if fp32 and plan.precision != "no":
        items.append((f"LoRA weights cast to {plan.precision} under autocast", count * BYTES[plan.precision]))
    return items


def _activation_items(plan: Plan) -> list[tuple[str, int]]:
    """The first ``recomputed_blocks`` blocks recompute, the rest keep their activations. Backward runs from
    the last block, so the kept blocks are freed before the first recomputation: the block being recomputed
    adds only what it holds beyond them."""
    size, layers, s, batch = BYTES[plan.precision], DIT["num_layers"], plan.tokens, plan.batch_size
    recomputed = max(0, min(layers, plan.recomputed_blocks))
    kept = layers - recomputed
    scores = DIT["num_heads"] * s * s * batch * size if plan.attention == "math" else 0
    per_token = KEPT_PER_TOKEN - (0 if plan.conditioned else MODULATION_PER_TOKEN)
    block = int(per_token * s * batch * size + CONTEXT_PER_TEXT_TOKEN * TEXT_TOKENS * (batch - 1) * size)
    kept_block = int(block * (COMPILED_KEPT_SHARE if plan.compiled else 1.0)) + MATH_SCORES_KEPT * scores
    items = []
    if kept:
        items.append((f"activations: {kept} blocks kept ({s} tokens x {batch}"
                      + (", compiled" if plan.compiled else "") + f", {plan.attention} attention)", kept * kept_block))
    if recomputed:
        inputs = 0 if plan.checkpointing_offload else recomputed * s * batch * DIT["dim"] * size
        items.append((f"activations: inputs of {recomputed} recomputed blocks"
                      + (", offloaded to CPU" if plan.checkpointing_offload else ""), inputs))
        if block > kept * kept_block:
            items.append(("activations: the block being recomputed" + (" (beyond the kept blocks, freed by then)"
                                                                       if kept else ""), block - kept * kept_block))
    items.append(("backward: activation gradients and the model's inputs",
                  int(BACKWARD_PER_TOKEN * s * batch * size + MATH_SCORES_IN_FLIGHT * scores)))
    if plan.fp32_residual and size < 4:
        items.append(_fp32_residual_item(plan, kept, recomputed))
    return items


def _fp32_residual_item(plan: Plan, kept: int, recomputed: int) -> tuple[str, int]:
    """What the fp32 residual stream adds to the activations: the values it holds in fp32 rather than the training
    precision, in the kept blocks (or the one being recomputed), the recomputed blocks' inputs and the gradient
    backward carries."""
    extra, tokens = 4 - BYTES[plan.precision], plan.tokens * plan.batch_size
    holding = kept * (COMPILED_KEPT_SHARE if plan.compiled else 1.0) if kept else min(recomputed, 1)
    values = (holding * FP32_RESIDUAL_KEPT_PER_TOKEN + FP32_RESIDUAL_BACKWARD_PER_TOKEN
              + (0 if plan.checkpointing_offload else recomputed * DIT["dim"])) * tokens
    return (f"fp32 residual stream: {kept} kept blocks' norm inputs, {recomputed} recomputed blocks' inputs and the "
            "gradient in fp32", int(values * extra))


def estimate(plan: Plan) -> list[tuple[str, int]]:
    """[(item, bytes)] for one GPU at its peak; the total is their sum (``total``)."""
    size = BYTES[plan.precision]
    items = [("DiT weights", dit_params() * size)]
    if not plan.cached:
        items += [("text encoder (UMT5-XXL)", TEXT_ENCODER_PARAMS * size), ("VAE", VAE_PARAMS * size)]
    items += _lora_items(plan)
    activations = _activation_items(plan)
    items += activations
    if not plan.cached:   # the encoders run before the DiT's forward: the larger of the two working sets counts
        encoding = VAE_PER_PIXEL * plan.height * plan.width * size   # DiffSynth's VAE encodes one sample at a time
        above = encoding - sum(b for _, b in activations)
        if above > 0:
            items.append(("VAE encoding: working set above the DiT's (the peak is while encoding)", above))
    items.append(("CUDA context and workspaces (assumed)", CUDA_CONTEXT_BYTES))
    return items


def total(items: list[tuple[str, int]]) -> int:
    return sum(size for _, size in items)


def peak_allocated(plan: Plan) -> int:
    """What ``torch.cuda.max_memory_allocated`` should report: the estimate without the CUDA context."""
    return total(estimate(plan)) - CUDA_CONTEXT_BYTES


def fits(plan: Plan, memory_bytes: int) -> bool:
    return total(estimate(plan)) <= FITS_BELOW * memory_bytes


@dataclasses.dataclass(frozen=True)
class CheckpointingChoice:
    """``--gradient_checkpointing auto``: how many blocks recompute, and whether even that fits."""
    recomputed_blocks: int
    fits: bool
    estimate_bytes: int
    limit_bytes: int

    def describe(self) -> str:
        gib = f"{self.estimate_bytes / GIB:.1f} of {self.limit_bytes / GIB:.1f} GiB"
        if not self.fits:
            return f"all {self.recomputed_blocks} blocks recomputed and it still does not fit ({gib})"
        return f"{self.recomputed_blocks} of {DIT['num_layers']} blocks recomputed ({gib})"


def checkpointing_choice(plans, gpu_memory_bytes: int) -> CheckpointingChoice:
    """The fewest recomputed blocks (0..30) whose estimate fits under ``FITS_BELOW`` of the GPU for every plan.

    ``plans`` is one ``Plan`` or several (a run's clip batch and image batch): the larger estimate decides.
    When even 30 recomputed blocks do not fit, the choice is 30 with ``fits`` False.
    """
    plans = [plans] if isinstance(plans, Plan) else list(plans)
    limit = int(FITS_BELOW * gpu_memory_bytes)
    largest = 0
    for recomputed in range(DIT["num_layers"] + 1):
        largest = max(total(estimate(p.but(recomputed_blocks=recomputed))) for p in plans)
        if largest <= limit:
            return CheckpointingChoice(recomputed, True, largest, limit)
    return CheckpointingChoice(DIT["num_layers"], False, largest, limit)


def blocks_to_recompute(plans, gpu_memory_bytes: int) -> int:
    """``--gradient_checkpointing auto`` for the training: the number of the 30 DiT blocks to recompute.

    ``plans``: the ``Plan`` of the run's clip batch (and of its image batch, when it has images), with
    the GPU's precision, attention kernel, compile choice, LoRA rank and targets, cache or not. The
    answer is the fewest recomputed blocks whose estimate stays under 90% of ``gpu_memory_bytes``; 30
    when even that does not fit (``checkpointing_choice`` says so).
    """
    return checkpointing_choice(plans, gpu_memory_bytes).recomputed_blocks


def recomputed_from_option(value: str, plans, gpu_memory_bytes: int | None) -> tuple[int, str]:
    """``--gradient_checkpointing all|none|auto|N`` -> (recomputed blocks, how it was decided)."""
    layers, choice = DIT["num_layers"], parse_choice(value)
    if choice == "auto":
        if gpu_memory_bytes is None:
            return layers, "auto: all (no GPU)"
        fitted = checkpointing_choice(plans, gpu_memory_bytes)
        return fitted.recomputed_blocks, "auto: " + fitted.describe()
    blocks, _ = recompute_blocks(choice, layers)   # a number above the DiT's blocks: the training's own error
    return blocks, choice if isinstance(choice, str) else f"{blocks} as asked"


def changes_that_fit(plan: Plan, memory_bytes: int, native_bf16: bool,
                     attention_for) -> list[tuple[str, Plan]]:
    """Single changes, then pairs, cheapest first, that make the plan fit: [(flags, plan)].

    ``attention_for(precision)`` gives the attention kernel of the GPU for a precision. On a GPU without
    native bf16 every candidate also uses fp16 (bf16 there is emulated and several times slower).
    ``--gradient_checkpointing auto`` (the fewest recomputed blocks that fit) comes before recomputing all of
    them, and offloading the recomputed blocks' inputs (slower still) only when nothing else fits.
    """
    base = plan
    if not native_bf16 and plan.precision == "bf16":
        base = plan.but(precision="fp16", attention=attention_for("fp16"))
    prefix = "--mixed_precision fp16 + " if base is not plan else ""
    steps, singles = [], []
    if not base.cached:
        steps.append(("--cache (encode once, train without the text encoder and VAE)", {"cached": True}))
    if base.recomputed_blocks < DIT["num_layers"]:
        auto = checkpointing_choice(base, memory_bytes)
        if auto.fits and base.recomputed_blocks < auto.recomputed_blocks < DIT["num_layers"]:
            singles.append(("--gradient_checkpointing auto", {"recomputed_blocks": auto.recomputed_blocks}))
        steps.append(("--gradient_checkpointing all", {"recomputed_blocks": DIT["num_layers"]}))
    if base.precision == "no":
        precision = "bf16" if native_bf16 else "fp16"
        steps.append((f"--mixed_precision {precision}", {"precision": precision, "attention": attention_for(precision)}))
    if not base.checkpointing_offload:
        all_blocks = "--gradient_checkpointing all " if base.recomputed_blocks < DIT["num_layers"] else ""
        steps.append((all_blocks + "--use_gradient_checkpointing_offload true",
                      {"recomputed_blocks": DIT["num_layers"], "checkpointing_offload": True}))
    found = []
    if prefix and fits(base, memory_bytes):
        found.append(("--mixed_precision fp16", base))
    for label, change in singles + steps:   # auto is a single change: paired, its block count would not be auto's
        candidate = base.but(**change)
        if fits(candidate, memory_bytes):
            found.append((prefix + label, candidate))
    for i, (label_a, change_a) in enumerate(steps):
        for label_b, change_b in steps[i + 1:]:
            if change_a.items() <= change_b.items() or change_b.items() <= change_a.items():
                continue   # one already includes the other
            candidate = base.but(**{**change_a, **change_b})   # both may set the same field
            if fits(candidate, memory_bytes):
                found.append((prefix + label_a + " + " + label_b, candidate))
    without_offload = [item for item in found if not item[1].checkpointing_offload]
    return without_offload or found
