"""The DiT's residual stream in fp32 (``training/step/fp32_residual.py``), on the demo's DiT and on the same DiT with
two residual channels driven to 80,000, past fp16's 65,504 (``plant_massive_activations``): DiffSynth's fp16 forward
overflows there; the fp32 stream matches an fp32 forward and backward, trains where DiffSynth's skips every step,
and one block computes what Wan2.2's reference block computes."""

from __future__ import annotations

import types

import pytest
import torch
import torch.nn.functional as F

from diffsynth_mbc.models.pipeline import build_demo_pipeline, plant_massive_activations
from diffsynth_mbc.training.lora.module import WanTI2VLoraModule
from diffsynth_mbc.training.plan.residual_policy import FP16_MAX, decide_fp32_residual
from diffsynth_mbc.training.step.batch_loss import dit_forward, sample_mse
from diffsynth_mbc.training.step.fp32_residual import keep_residual_in_fp32, residual_in_fp32
from diffsynth_mbc.training.components.guards import NonFiniteGuard
from tiny_step import SEED, scaled_step

LOSS_SCALE = 2.0 ** 16   # where torch's GradScaler starts: fp16 gradients this small would underflow unscaled
# Measured (benchmarks/bench_fp32_residual.py, tiny_massive, fp16): 0.04% and 0.08%; the bounds leave 10x.
PREDICTION_TOLERANCE, GRADIENT_TOLERANCE = 0.005, 0.01


def massive_module(dtype, fp32_residual: bool, massive: bool = True) -> WanTI2VLoraModule:
    """The demo's DiT (its residual channels 3 and 40 driven to 80,000 when ``massive``) in ``dtype``, with a LoRA
    whose B is drawn so that it has an effect."""
    pipe = build_demo_pipeline(device="cpu", torch_dtype=torch.float32, seed=SEED, load_encoders=False)
    if massive:
        plant_massive_activations(pipe.dit)
    pipe = pipe.to(dtype=dtype)
    pipe.torch_dtype = dtype
    torch.manual_seed(0)
    module = WanTI2VLoraModule(pipe, lora_rank=4, fp32_residual=fp32_residual)
    for name, parameter in module.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(parameter, std=0.02)
    return module


def clip_inputs(dtype, timestep: float = 512.0) -> dict:
    """A 3-latent-frame clip conditioned on its first frame, noised in fp32, its latents and text embedding rounded to
    ``dtype`` (held in fp32): the fp32 model gets the very inputs the ``dtype`` one does."""
    generator = torch.Generator().manual_seed(1)
    clean = torch.randn((1, 48, 3, 8, 8), generator=generator)
    noise = torch.randn(clean.shape, generator=generator)
    noise[:, :, :1] = clean[:, :, :1]
    sigma = timestep / 1000
    return {"latents": ((1 - sigma) * clean + sigma * noise).to(dtype).float(), "target": noise - clean,
            "context": torch.randn((1, 32, 32), generator=generator).to(dtype).float(),
            "timestep": torch.tensor([timestep])}


def forward_backward(module, inputs: dict, largest: list | None = None):
    """(prediction, LoRA gradients) of the DiT on ``inputs``, the loss scaled before backward and the gradients
    unscaled, as the loss scaler does; ``largest`` collects each block's largest output magnitude."""
    dtype = module.pipe.torch_dtype
    hooks = [block.register_forward_hook(lambda _m, _i, out: largest.append(float(out.detach().abs().max())))
             for block in module.pipe.dit.blocks] if largest is not None else []
    try:
        prediction = dit_forward(module.pipe.dit, inputs["latents"].to(dtype), inputs["timestep"].to(dtype),
                                 inputs["context"].to(dtype), module.blocks, [True])
    finally:
        for hook in hooks:
            hook.remove()
    (sample_mse(prediction, inputs["target"], skip_first_frame=True) * LOSS_SCALE).backward()
    gradients = torch.cat([p.grad.float().flatten() / LOSS_SCALE for p in module.parameters() if p.requires_grad])
    return prediction.detach().float(), gradients


def relative(got: torch.Tensor, expected: torch.Tensor) -> float:
    return float((got - expected).norm() / expected.norm())


def test_diffsynths_fp16_forward_overflows_on_massive_activations_and_the_fp32_stream_matches_fp32():
    inputs = clip_inputs(torch.float16)
    expected, expected_gradients = forward_backward(massive_module(torch.float32, False), inputs)
    largest: list = []
    module = massive_module(torch.float16, False)
    plain, plain_gradients = forward_backward(module, inputs, largest)
    assert not torch.isfinite(plain).all() and not torch.isfinite(plain_gradients).all()
    assert largest[-1] == float("inf")   # the last block's residual add passed 65,504
    assert module.blocks.take_largest_residual() == float("inf")   # what the status file and the probe say
    largest = []
    module = massive_module(torch.float16, True)
    kept, kept_gradients = forward_backward(module, inputs, largest)
    assert FP16_MAX < max(largest) < 81000   # the stream reached 80,000 and stayed finite, in fp32
    assert module.blocks.take_largest_residual() == max(largest)
    assert relative(kept, expected) < PREDICTION_TOLERANCE
    assert relative(kept_gradients, expected_gradients) < GRADIENT_TOLERANCE


def test_without_massive_activations_the_fp32_stream_is_at_least_as_close_to_fp32_as_diffsynths():
    for dtype in (torch.float16, torch.bfloat16):
        inputs = clip_inputs(dtype)
        expected, expected_gradients = forward_backward(massive_module(torch.float32, False, massive=False), inputs)
        errors = {}
        for on in (False, True):
            got, gradients = forward_backward(massive_module(dtype, on, massive=False), inputs)
            errors[on] = (relative(got, expected), relative(gradients, expected_gradients))
        assert errors[True][0] <= errors[False][0] * 1.05 and errors[True][1] <= errors[False][1] * 1.05, errors


def test_in_fp32_the_fp32_stream_computes_what_diffsynths_forward_does(entries):
    videos, images = entries
    for sample in (videos[0], images[0]):
        losses = []
        for on in (False, True):
            module = massive_module(torch.float32, on, massive=False)
            assert residual_in_fp32(module.pipe.dit) is on
            torch.manual_seed(7)
            losses.append(module([dict(sample)]))
        torch.testing.assert_close(losses[1], losses[0], rtol=1e-5, atol=1e-7)


def reference_block(block, x, context, e, freqs, compute):
    """Wan2.2's ``WanAttentionBlock.forward`` as the reference computes it, written from its description: ``e`` (the
    time projection, per token) in fp32; the modulation added to it in fp32; the norms in fp32; the modulated inputs
    to the self-attention, cross-attention and FFN in the compute dtype; every residual add in fp32."""
    assert e.dtype == torch.float32
    e = (block.modulation.float().unsqueeze(0) + e).chunk(6, dim=2)
    e = [part.squeeze(2) for part in e]

    def norm(layer, value):
        weight = None if layer.weight is None else layer.weight.float()
        bias = None if layer.bias is None else layer.bias.float()
        return F.layer_norm(value.float(), layer.normalized_shape, weight, bias, layer.eps)

    y = block.self_attn((norm(block.norm1, x) * (1 + e[1]) + e[0]).to(compute), freqs)
    x = x.float() + y.float() * e[2]
    x = x + block.cross_attn(norm(block.norm3, x).to(compute), context).float()
    y = block.ffn((norm(block.norm2, x) * (1 + e[4]) + e[3]).to(compute))
    return x + y.float() * e[5]


@pytest.mark.parametrize("compute", [torch.float32, torch.float16])
def test_one_block_computes_what_wan22s_reference_block_computes(compute):
    module = massive_module(compute, True)
    dit, block = module.pipe.dit, module.pipe.dit.blocks[1]
    generator = torch.Generator().manual_seed(3)
    tokens, (f, h, w) = 3 * 4 * 4, (3, 4, 4)
    x = torch.randn((1, tokens, dit.dim), generator=generator) * 100   # an fp32 stream, as block 0 leaves it
    x[..., 3] = 50000.0                                              # a massive channel the fp16 cap would lose
    context = torch.randn((1, 32, dit.dim), generator=generator).to(compute)
    e = torch.randn((1, tokens, 6, dit.dim), generator=generator)   # per token, fp32: as the reference asserts
    freqs = torch.cat([dit.freqs[0][:f].view(f, 1, 1, -1).expand(f, h, w, -1),
                       dit.freqs[1][:h].view(1, h, 1, -1).expand(f, h, w, -1),
                       dit.freqs[2][:w].view(1, 1, w, -1).expand(f, h, w, -1)], dim=-1).reshape(tokens, 1, -1)
    with torch.no_grad():
        ours = block(x, context, e, freqs)
        theirs = reference_block(block, x, context, e, freqs, compute)
    assert ours.dtype == torch.float32 and ours[..., 3].max() > FP16_MAX   # past fp16's range, finite
    torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=1e-6)


def test_the_time_embedding_and_the_heads_modulation_run_in_fp32_and_the_head_answers_in_the_models_dtype():
    module = massive_module(torch.float16, True)
    dit = module.pipe.dit
    steps = torch.tensor([999.0, 3.0])
    from diffsynth.models.wan_video_dit import sinusoidal_embedding_1d

    t = dit.time_embedding(sinusoidal_embedding_1d(dit.freq_dim, steps))
    assert t.dtype == torch.float32 and dit.time_projection(t).dtype == torch.float32
    reference = massive_module(torch.float32, False).pipe.dit
    expected = reference.time_embedding(sinusoidal_embedding_1d(reference.freq_dim, steps))
    torch.testing.assert_close(t, expected, rtol=1e-3, atol=1e-3)   # fp16 weights, fp32 arithmetic
    x = torch.full((2, 4, dit.dim), 1.0)
    x[..., 3] = 70000.0   # past fp16's range: the head's norm reads it in fp32
    out = dit.head(x, t)
    assert out.dtype == torch.float16 and bool(torch.isfinite(out).all())


def test_diffsynths_own_sampling_forward_runs_on_the_fp32_stream_and_stays_finite():
    """Sample clips go through DiffSynth's ``model_fn_wan_video`` with the same modules: in fp16 it overflows on the
    massive model unless the stream is fp32, and it still answers in the model's dtype."""
    outputs = {}
    for on in (False, True):
        pipe = massive_module(torch.float16, on).pipe
        latents = torch.randn((1, 48, 3, 8, 8), generator=torch.Generator().manual_seed(5)).half()
        with torch.no_grad():
            outputs[on] = pipe.model_fn(dit=pipe.dit, latents=latents, timestep=torch.tensor([500.0]).half(),
                                        context=torch.randn((1, 32, 32)).half(), fuse_vae_embedding_in_latents=True)
    assert not torch.isfinite(outputs[False]).all()
    assert outputs[True].dtype == torch.float16 and bool(torch.isfinite(outputs[True]).all())


def short_fp16_run(entries, fp32_residual: bool, steps: int = 4):
    """What the training does for ``steps`` optimizer steps under fp16 on a GPU, on the CPU: the DiT in fp16 (as the
    training loads it), fp32 LoRA weights, autocast to fp16 (accelerate's), torch's loss scaler, AdamW, clipping at
    1.0 and the non-finite guard; clips and images of the demo's cache in turns, each trained as the loop trains it.
    Returns (losses, skipped steps, the guard, whether the LoRA changed)."""
    videos, images = entries
    module = massive_module(torch.float16, fp32_residual)
    trainable = [p for p in module.parameters() if p.requires_grad]
    before = [p.detach().clone() for p in trainable]
    optimizer = torch.optim.AdamW(trainable, lr=1e-3)
    scaler = torch.amp.GradScaler("cpu")
    guard = NonFiniteGuard(max_in_a_row=steps + 1, precision="fp16")
    losses, skipped = [], []
    torch.manual_seed(11)
    for step in range(1, steps + 1):
        batch = [dict(videos[step % len(videos)])] if step % 2 else [dict(s) for s in images[:2]]
        with torch.autocast("cpu", dtype=torch.float16):
            loss = module(batch)
        losses.append(float(loss.detach()))
        skipped.append(scaled_step(loss, scaler, optimizer, trainable, guard, step))
    changed = not all(torch.equal(p, b) for p, b in zip(trainable, before))
    return losses, skipped, guard, changed


def test_a_short_fp16_run_trains_on_the_massive_model_where_diffsynths_forward_skips_every_step(entries):
    losses, skipped, guard, changed = short_fp16_run(entries, fp32_residual=True)
    assert all(torch.isfinite(torch.tensor(losses))) and not any(skipped) and guard.total == 0 and changed
    losses, skipped, guard, changed = short_fp16_run(entries, fp32_residual=False)
    assert all(skipped) and guard.total == len(skipped) and not changed   # every step inf/NaN: nothing trained


def test_auto_keeps_the_stream_in_fp32_under_fp16_and_bf16_and_leaves_fp32_alone():
    assert decide_fp32_residual("auto", "fp16").on and decide_fp32_residual("auto", "bf16").on
    assert not decide_fp32_residual("auto", "no").on
    assert not decide_fp32_residual("off", "fp16").on and "65,504" in decide_fp32_residual("off", "fp16").reason
    assert decide_fp32_residual("on", "no").on
    with pytest.raises(ValueError, match="--fp32_residual must be one of auto, on, off"):
        decide_fp32_residual("yes", "fp16")


def test_the_forwards_are_the_modules_own_and_the_parameter_names_do_not_change():
    module = massive_module(torch.float16, False)
    names = [name for name, _ in module.named_parameters()]
    assert keep_residual_in_fp32(module.pipe.dit) == 2
    assert [name for name, _ in module.named_parameters()] == names
    assert all(isinstance(block.forward, types.MethodType) for block in module.pipe.dit.blocks)
