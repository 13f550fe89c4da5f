"""Memory per GPU of a Wan2.2-TI2V-5B LoRA training, itemised (pure Python, no torch).

Parameter counts follow the architecture (DiffSynth's ``WanModel`` with the TI2V-5B config, the
UMT5-XXL encoder, the Wan2.2 VAE); the tests recount them from DiffSynth's own classes. Activations
follow the saved tensors of one DiT block (self-attention, cross-attention, FFN) per token; the math
attention kernel adds the full score matrix per head. The figures are estimates for planning: the
README compares them with measured peaks.
"""

from __future__ import annotations

import dataclasses
import math

GIB = 1024 ** 3

DIT = dict(dim=3072, ffn_dim=14336, num_layers=30, num_heads=24, in_dim=48, out_dim=48, text_dim=4096,
           freq_dim=256, patch=(1, 2, 2))
TEXT_ENCODER_PARAMS = 5_680_910_336   # UMT5-XXL encoder (models_t5_umt5-xxl-enc-bf16.pth)
VAE_PARAMS = 704_688_668              # Wan2.2 VAE (Wan2.2_VAE.pth)
TEXT_TOKENS = 512                     # DiffSynth pads every prompt to 512 tokens
VAE_SPATIAL, VAE_TEMPORAL, VAE_CHANNELS = 16, 4, 48
VAE_WORK_CHANNELS = 160               # the VAE's widest full-resolution feature map
CUDA_CONTEXT_BYTES = int(0.6 * GIB)   # CUDA context, cuBLAS/cuDNN workspaces (outside PyTorch's allocator)
ALLOCATOR_OVERHEAD = 0.10             # fragmentation and cached blocks on top of live tensors
FITS_BELOW = 0.95                     # the estimate must stay under this share of the GPU's memory
BYTES = {"bf16": 2, "fp16": 2, "no": 4}


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


@dataclasses.dataclass(frozen=True)
class Plan:
    """What decides the memory of one training process."""
    height: int
    width: int
    num_frames: int
    batch_size: int = 1
    lora_rank: int = 32
    lora_targets: tuple[str, ...] = ("q", "k", "v", "o", "ffn.0", "ffn.2")
    precision: str = "bf16"              # accelerate's value: bf16, fp16 or no (fp32)
    cached: bool = False                 # training from the latent cache: no text encoder, no VAE
    gradient_checkpointing: bool = True
    checkpointing_offload: bool = False  # checkpoints kept in CPU memory
    attention: str = "flash"             # flash | mem_efficient | math
    zero2_world_size: int = 1            # DeepSpeed ZeRO-2 shards grads and optimizer state over this many

    def but(self, **changes) -> "Plan":
        return dataclasses.replace(self, **changes)


def block_activation_elements(s: int, batch: int, attention: str) -> int:
    """Tensors one DiT block keeps for its backward pass, in elements."""
    d, f, heads, t = DIT["dim"], DIT["ffn_dim"], DIT["num_heads"], TEXT_TOKENS
    self_attention = 9 * s * d       # modulated input, q k v, normed q k, rotated q k, output
    cross_attention = 5 * s * d + 2 * t * d + heads * s * t   # normed input, q, normed q, output, o input; k v; probs
    ffn = 2 * s * d + 2 * s * f      # modulated input, gate/residual; ffn.0 output, GELU output
    scores = 2 * heads * s * s if attention == "math" else 0  # scores + softmax, only in the math kernel
    return batch * (self_attention + cross_attention + ffn + scores)


def estimate(plan: Plan) -> list[tuple[str, int]]:
    """[(item, bytes)] for one GPU; the total is their sum."""
    weight = BYTES[plan.precision]
    s = tokens(plan.height, plan.width, plan.num_frames)
    lora = lora_params(plan.lora_rank, list(plan.lora_targets))
    shard = max(1, plan.zero2_world_size)
    items = [("DiT weights", dit_params() * weight)]
    if not plan.cached:
        items += [("text encoder (UMT5-XXL)", TEXT_ENCODER_PARAMS * weight),
                  ("VAE", VAE_PARAMS * weight),
                  ("VAE encoding (one chunk of 4 frames)",
                   4 * plan.height * plan.width * VAE_WORK_CHANNELS * weight * 4 * plan.batch_size)]
    items += [("LoRA parameters (fp32)", lora * 4),
              ("LoRA gradients (fp32)" + (f", 1/{shard}" if shard > 1 else ""), lora * 4 // shard),
              ("AdamW state (fp32 m, v)" + (f", 1/{shard}" if shard > 1 else ""), lora * 8 // shard)]
    per_block = block_activation_elements(s, plan.batch_size, plan.attention) * weight
    layers = DIT["num_layers"]
    if plan.gradient_checkpointing:
        kept = 0 if plan.checkpointing_offload else layers * plan.batch_size * s * DIT["dim"] * weight
        items += [(f"activations: block inputs ({s} tokens x {layers} blocks)"
                   + (", offloaded to CPU" if plan.checkpointing_offload else ""), kept),
                  (f"activations: one block recomputed ({plan.attention} attention)", per_block)]
    else:
        items += [(f"activations: {layers} blocks ({s} tokens, {plan.attention} attention)", layers * per_block)]
    items.append(("backward: one block's activation gradients", per_block))
    live = sum(size for _, size in items)
    items += [("allocator overhead (10%)", int(live * ALLOCATOR_OVERHEAD)),
              ("CUDA context and workspaces", CUDA_CONTEXT_BYTES)]
    return items


def total(items: list[tuple[str, int]]) -> int:
    return sum(size for _, size in items)


def fits(plan: Plan, memory_bytes: int) -> bool:
    return total(estimate(plan)) <= FITS_BELOW * memory_bytes


def changes_that_fit(plan: Plan, memory_bytes: int, native_bf16: bool,
                     attention_for) -> list[tuple[str, Plan]]:
    """Single changes, then pairs, cheapest first, that make the plan fit: [(flags, plan)].

    ``attention_for(precision)`` gives the attention kernel of the GPU for a precision. On a GPU without
    native bf16 every candidate also uses fp16 (bf16 there is emulated and several times slower).
    """
    base = plan
    if not native_bf16 and plan.precision == "bf16":
        base = plan.but(precision="fp16", attention=attention_for("fp16"))
    prefix = "--mixed_precision fp16 + " if base is not plan else ""
    steps = []
    if not base.cached:
        steps.append(("--cache (encode once, train without the text encoder and VAE)", {"cached": True}))
    if not base.gradient_checkpointing:
        steps.append(("--use_gradient_checkpointing", {"gradient_checkpointing": True}))
    if base.precision == "no":
        precision = "bf16" if native_bf16 else "fp16"
        steps.append((f"--mixed_precision {precision}", {"precision": precision, "attention": attention_for(precision)}))
    if not base.checkpointing_offload:
        steps.append(("--use_gradient_checkpointing_offload",
                      {"gradient_checkpointing": True, "checkpointing_offload": True}))
    found = []
    if prefix and fits(base, memory_bytes):
        found.append(("--mixed_precision fp16", base))
    for label, change in steps:
        candidate = base.but(**change)
        if fits(candidate, memory_bytes):
            found.append((prefix + label, candidate))
    for i, (label_a, change_a) in enumerate(steps):
        for label_b, change_b in steps[i + 1:]:
            candidate = base.but(**{**change_a, **change_b})   # both may set the same field
            if fits(candidate, memory_bytes):
                found.append((prefix + label_a + " + " + label_b, candidate))
    return found
