"""The doctor's memory model: parameter counts against DiffSynth's own classes, and the V100 / A100 verdicts."""

from __future__ import annotations

import pytest

from diffsynth_mbc.doctor import memory
from diffsynth_mbc.doctor.memory import GIB, Plan, changes_that_fit, estimate, fits, total
from diffsynth_mbc.gpu import attention_kernel, known_gpu

TARGETS = ["q", "k", "v", "o", "ffn.0", "ffn.2"]


def test_hand_worked_figures():
    assert memory.dit_params() == 4_999_787_712
    assert memory.lora_params(32, TARGETS) == 80_609_280   # 30 x (2 x 4 x 32 x 6144 + 2 x 32 x 17408)
    assert memory.tokens(704, 1280, 17) == 4_400           # 5 latent frames x 22 x 40 patches
    assert memory.TEXT_ENCODER_PARAMS == 5_680_910_336


@pytest.mark.slow
def test_counts_equal_diffsynths_classes_built_on_the_meta_device():
    import torch
    from diffsynth.models.wan_video_dit import WanModel
    from diffsynth.models.wan_video_text_encoder import WanTextEncoder
    from diffsynth.models.wan_video_vae import WanVideoVAE38
    from peft import LoraConfig, inject_adapter_in_model

    from diffsynth_mbc.models.pipeline import TI2V_5B_DIT

    count = lambda module: sum(p.numel() for p in module.parameters())  # noqa: E731
    with torch.device("meta"):
        dit = WanModel(**TI2V_5B_DIT)
        assert count(dit) == memory.dit_params()
        assert count(WanTextEncoder()) == memory.TEXT_ENCODER_PARAMS
        assert count(WanVideoVAE38()) == memory.VAE_PARAMS
        dit = inject_adapter_in_model(LoraConfig(r=32, lora_alpha=32, target_modules=TARGETS), dit)
    assert sum(p.numel() for n, p in dit.named_parameters() if "lora_" in n) == memory.lora_params(32, TARGETS)


def v100_plan(**changes):
    return Plan(704, 1280, 17, precision="fp16", attention=attention_kernel((7, 0), "fp16")).but(**changes)


def test_on_a_v100_encoding_every_step_does_not_fit_and_the_cache_with_fp16_does():
    v100 = int(known_gpu("V100-32GB").memory_gib * GIB)
    assert not fits(v100_plan(), v100)
    assert fits(v100_plan(cached=True), v100)
    # asked for bf16 on a V100: every suggestion also moves to fp16 (bf16 is emulated there)
    bf16 = Plan(704, 1280, 17, precision="bf16", attention="math")
    found = changes_that_fit(bf16, v100, native_bf16=False, attention_for=lambda p: attention_kernel((7, 0), p))
    flags, plan = found[0]
    assert flags.startswith("--mixed_precision fp16 + --cache") and plan.precision == "fp16" and plan.cached


def test_the_items_add_up_and_the_math_kernel_costs_the_score_matrices():
    items = dict(estimate(v100_plan(cached=True)))
    assert "text encoder (UMT5-XXL)" not in items and items["DiT weights"] == memory.dit_params() * 2
    assert items["AdamW state (fp32 m, v)"] == 80_609_280 * 8
    flash = total(estimate(v100_plan(cached=True)))
    math_kernel = total(estimate(v100_plan(cached=True, attention="math")))
    scores = 2 * 24 * 4400 ** 2 * 2                 # scores + softmax, fp16, for the one recomputed block
    assert math_kernel - flash == pytest.approx(2 * scores * 1.1, rel=1e-3)   # + its gradients, + 10 % overhead


def test_without_checkpointing_every_block_keeps_its_activations():
    with_ckpt = total(estimate(v100_plan(cached=True)))
    without = total(estimate(v100_plan(cached=True, gradient_checkpointing=False)))
    assert without - with_ckpt > 15 * GIB
    a100 = int(known_gpu("A100-80GB").memory_gib * GIB)
    assert fits(Plan(704, 1280, 17, precision="bf16", attention="flash"), a100)


def test_zero2_shards_only_the_lora_gradients_and_optimizer_state():
    single = dict(estimate(v100_plan(cached=True)))
    sharded = dict(estimate(v100_plan(cached=True, zero2_world_size=2)))
    assert sharded["AdamW state (fp32 m, v), 1/2"] == single["AdamW state (fp32 m, v)"] // 2
    assert sharded["DiT weights"] == single["DiT weights"]


def test_pairs_of_changes_that_set_the_same_field_are_combined():
    """Without checkpointing, two suggestions both turn it on; pairing them used to raise TypeError."""
    v100 = int(known_gpu("V100-32GB").memory_gib * GIB)
    found = changes_that_fit(v100_plan(gradient_checkpointing=False), v100, native_bf16=False,
                             attention_for=lambda p: attention_kernel((7, 0), p))
    flags = [label for label, _ in found]
    assert any("--cache" in label and "--use_gradient_checkpointing" in label for label in flags)
