"""The memory model (training/plan/memory.py): parameter counts against DiffSynth's own classes, H100 peaks,
``--gradient_checkpointing auto`` and the V100 / H100 verdicts."""

from __future__ import annotations

import pytest

from diffsynth_mbc.errors import OptionsError
from diffsynth_mbc.gpu import attention_kernel, known_gpu
from diffsynth_mbc.training.plan import memory
from diffsynth_mbc.training.plan.memory import GIB, Plan, blocks_to_recompute, changes_that_fit, estimate, fits, total

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


@pytest.mark.slow
def test_the_demo_models_widths_and_lora_are_the_tiny_dits():
    """The doctor sizes a demo run's checkpoints and cache by ``DEMO_DIT``: the tiny model the demo builds."""
    import torch
    from diffsynth.models.wan_video_dit import WanModel
    from peft import LoraConfig, inject_adapter_in_model

    from diffsynth_mbc.models.pipeline import TINY_DIT, TINY_TEXT_ENCODER, TINY_TEXT_LEN

    assert {key: TINY_DIT[key] for key in ("dim", "ffn_dim", "num_layers", "num_heads", "text_dim", "freq_dim")} == \
        {key: memory.DEMO_DIT[key] for key in ("dim", "ffn_dim", "num_layers", "num_heads", "text_dim", "freq_dim")}
    assert TINY_TEXT_ENCODER["dim"] == memory.DEMO_DIT["text_dim"] and TINY_TEXT_LEN == memory.DEMO_TEXT_TOKENS
    dims = {key: memory.DEMO_DIT[key] for key in ("dim", "ffn_dim", "num_layers")}
    with torch.device("meta"):
        dit = inject_adapter_in_model(LoraConfig(r=4, lora_alpha=4, target_modules=TARGETS), WanModel(**TINY_DIT))
    assert sum(p.numel() for n, p in dit.named_parameters() if "lora_" in n) == memory.lora_params(4, TARGETS, **dims)


def v100_plan(**changes):
    return Plan(704, 1280, 17, precision="fp16", attention=attention_kernel((7, 0), "fp16")).but(**changes)


# Peaks measured on one H100 80GB (torch.cuda.max_memory_allocated), 1280x704x17 = 4,400 tokens, batch 1,
# LoRA rank 32 on q,k,v,o,ffn.0,ffn.2: (plan, GiB). "as built" is the LoRA in fp32.
AS_BUILT = Plan(704, 1280, 17, precision="bf16", attention="cudnn", cached=True, lora_dtype="fp32")
MEASURED_ON_H100 = [
    ("cached, every block recomputed", AS_BUILT, 12.8),
    ("cached, memory-efficient attention", AS_BUILT.but(attention="mem_efficient"), 12.8),
    ("cached, no block recomputed", AS_BUILT.but(recomputed_blocks=0), 50.3),
    ("encoding every step, every block", AS_BUILT.but(cached=False), 26.0),
    ("encoding every step, no block", AS_BUILT.but(cached=False, recomputed_blocks=0), 62.2),
    ("cached, math attention", AS_BUILT.but(attention="math"), 18.6),
    ("LoRA bf16", AS_BUILT.but(lora_dtype="base"), 11.9),
    ("LoRA bf16, compiled, no block", AS_BUILT.but(lora_dtype="base", compiled=True, recomputed_blocks=0), 35.0),
    ("one image (880 tokens)", AS_BUILT.but(num_frames=1), 11.0),
]


@pytest.mark.parametrize("name, plan, measured_gib", MEASURED_ON_H100, ids=[row[0] for row in MEASURED_ON_H100])
def test_estimates_are_within_10_percent_of_the_peaks_measured_on_an_h100(name, plan, measured_gib):
    assert memory.peak_allocated(plan) / GIB == pytest.approx(measured_gib, rel=0.10)


def test_each_block_kept_instead_of_recomputed_costs_about_1_25_gib_at_4400_tokens():
    for recomputed in (1, 12, 29):
        kept_one_more = memory.peak_allocated(AS_BUILT.but(recomputed_blocks=recomputed - 1))
        assert (kept_one_more - memory.peak_allocated(AS_BUILT.but(recomputed_blocks=recomputed))) / GIB == \
            pytest.approx(1.25, rel=0.05)
    # the first block kept is free at the peak: backward frees it before the first recomputation
    assert memory.peak_allocated(AS_BUILT.but(recomputed_blocks=29)) < memory.peak_allocated(AS_BUILT)
    # it scales with tokens x batch: five images of 880 tokens keep what one 4,400-token clip keeps, less the clip's
    # per-token time modulation (images take one per sample), plus the four more samples' text contexts
    images = AS_BUILT.but(num_frames=1, batch_size=5, conditioned=False)
    clip_kept = memory.peak_allocated(AS_BUILT.but(recomputed_blocks=0)) - memory.peak_allocated(AS_BUILT)
    modulation = 29 * memory.MODULATION_PER_TOKEN * 4400 * 2
    contexts = 29 * memory.CONTEXT_PER_TEXT_TOKEN * memory.TEXT_TOKENS * 4 * 2
    assert memory.peak_allocated(images.but(recomputed_blocks=0)) - memory.peak_allocated(images) == \
        pytest.approx(clip_kept - modulation + contexts, rel=0.01)


def test_images_and_t2v_clips_keep_no_per_token_modulation_as_measured_on_the_h100_box():
    """benchmarks/results/2026-11-28-h100.json: compiled, no block recomputed, bf16, from the cache."""
    compiled = Plan(704, 1280, 17, precision="bf16", attention="cudnn", cached=True, recomputed_blocks=0,
                    compiled=True)
    for plan, measured in ((compiled, 35.7), (compiled.but(conditioned=False), 29.6),
                           (compiled.but(num_frames=1, batch_size=5, conditioned=False), 30.6),
                           (compiled.but(num_frames=1, height=960, width=960, batch_size=5, conditioned=False), 31.1),
                           (compiled.but(num_frames=1, conditioned=False), 14.5)):
        assert memory.peak_allocated(plan) / GIB == pytest.approx(measured, rel=0.05), plan


def test_on_a_v100_with_fp16_from_the_cache_auto_keeps_12_to_14_blocks():
    v100 = int(known_gpu("V100-32GB").memory_gib * GIB)
    choice = memory.checkpointing_choice(v100_plan(cached=True), v100)
    assert choice.fits and 16 <= choice.recomputed_blocks <= 18
    assert blocks_to_recompute(v100_plan(cached=True), v100) == choice.recomputed_blocks
    assert choice.estimate_bytes <= 0.9 * v100 < total(estimate(v100_plan(cached=True).but(
        recomputed_blocks=choice.recomputed_blocks - 1)))
    # compiled blocks keep less (35.0 GiB instead of about 49 without recomputation, measured): more are kept
    assert blocks_to_recompute(v100_plan(cached=True, compiled=True), v100) < choice.recomputed_blocks


def test_on_an_h100_auto_recomputes_nothing_cached_or_not():
    h100 = int(known_gpu("H100-80GB").memory_gib * GIB)
    assert blocks_to_recompute(AS_BUILT.but(lora_dtype="base"), h100) == 0
    assert blocks_to_recompute(AS_BUILT.but(lora_dtype="base", cached=False), h100) == 0


def test_when_even_every_block_recomputed_does_not_fit_auto_says_so():
    v100_16 = int(known_gpu("V100-16GB").memory_gib * GIB)
    choice = memory.checkpointing_choice(v100_plan(), v100_16)   # encoding every step: the encoders alone are 11.9 GiB
    assert choice.recomputed_blocks == 30 and not choice.fits
    assert "still does not fit" in choice.describe()


def test_auto_fits_the_larger_of_the_clip_batch_and_the_image_batch():
    v100 = int(known_gpu("V100-32GB").memory_gib * GIB)
    clips = v100_plan(cached=True)
    images = clips.but(num_frames=1, batch_size=10)   # 8,800 tokens per forward
    assert blocks_to_recompute([clips, images], v100) == blocks_to_recompute(images, v100) > \
        blocks_to_recompute(clips, v100)


def test_the_option_values_map_to_recomputed_blocks():
    v100 = int(known_gpu("V100-32GB").memory_gib * GIB)
    plan = v100_plan(cached=True)
    assert memory.recomputed_from_option("all", plan, v100) == (30, "all")
    assert memory.recomputed_from_option("none", plan, v100) == (0, "none")
    assert memory.recomputed_from_option("12", plan, v100)[0] == 12
    with pytest.raises(OptionsError, match="--gradient_checkpointing 45: the DiT has 30 blocks"):
        memory.recomputed_from_option("45", plan, v100)   # what the training says, not a silent 30
    assert memory.recomputed_from_option("auto", plan, v100)[0] == blocks_to_recompute(plan, v100)
    assert memory.recomputed_from_option("auto", plan, None) == (30, "auto: all (no GPU)")


def test_the_default_image_batch_holds_a_clips_tokens():
    assert memory.default_image_batch(704, 1280, 17) == 5
    assert memory.default_image_batch(704, 1280, 17, batch_size=2) == 10
    assert memory.default_image_batch(704, 1280, 1) == 1


def test_on_a_v100_without_recomputation_the_cheapest_fix_is_auto_then_recomputing_every_block():
    v100 = int(known_gpu("V100-32GB").memory_gib * GIB)
    assert not fits(v100_plan(recomputed_blocks=0), v100)
    assert fits(v100_plan(), v100)        # encoding every step fits with every block recomputed (26.0 GiB measured)
    # asked for bf16 on a V100: every suggestion also moves to fp16 (bf16 is emulated there)
    bf16 = Plan(704, 1280, 17, precision="bf16", attention="math", recomputed_blocks=0)
    found = changes_that_fit(bf16, v100, native_bf16=False, attention_for=lambda p: attention_kernel((7, 0), p))
    (auto_flags, auto), (flags, plan) = found[:2]
    # the fewest recomputed blocks that fit (what the training's auto picks) before all of them
    fp16 = bf16.but(precision="fp16", attention="mem_efficient")
    assert auto_flags == "--mixed_precision fp16 + --gradient_checkpointing auto"
    assert auto.recomputed_blocks == blocks_to_recompute(fp16, v100) < 30 and fits(auto, v100)
    assert flags == "--mixed_precision fp16 + --gradient_checkpointing all"
    assert plan.precision == "fp16" and plan.attention == "mem_efficient" and plan.recomputed_blocks == 30


def test_offloading_is_suggested_only_when_nothing_else_fits():
    """The doctor recommended --use_gradient_checkpointing_offload (slower) where recomputing fewer blocks fit."""
    v100 = int(known_gpu("V100-32GB").memory_gib * GIB)
    found = changes_that_fit(v100_plan(recomputed_blocks=0, cached=True), v100, native_bf16=False,
                             attention_for=lambda p: attention_kernel((7, 0), p))
    assert found and not any("offload" in flags or plan.checkpointing_offload for flags, plan in found)
    assert found[0][0] == "--gradient_checkpointing auto"


def test_the_items_add_up_and_the_math_kernel_costs_the_score_matrices():
    items = dict(estimate(v100_plan(cached=True)))
    assert "text encoder (UMT5-XXL)" not in items and items["DiT weights"] == memory.dit_params() * 2
    assert items["AdamW state (fp32 m, v)"] == 80_609_280 * 8       # the LoRA's AdamW state stays fp32
    assert items["LoRA weights cast to fp16 under autocast"] == 80_609_280 * 2
    assert total(estimate(v100_plan(cached=True))) == sum(items.values())
    flash = total(estimate(v100_plan(cached=True)))
    math_kernel = total(estimate(v100_plan(cached=True, attention="math")))
    scores = 24 * 4400 ** 2 * 2                 # one score matrix per head, fp16
    assert math_kernel - flash == pytest.approx(memory.MATH_SCORES_IN_FLIGHT * scores, rel=1e-3)
    kept = total(estimate(v100_plan(cached=True, recomputed_blocks=0, attention="math")))
    assert kept - total(estimate(v100_plan(cached=True, recomputed_blocks=0))) == pytest.approx(
        (memory.MATH_SCORES_IN_FLIGHT + 30 * memory.MATH_SCORES_KEPT) * scores, rel=1e-3)


def test_zero2_shards_only_the_lora_gradients_and_optimizer_state():
    single = dict(estimate(v100_plan(cached=True)))
    sharded = dict(estimate(v100_plan(cached=True, zero2_world_size=2)))
    assert sharded["AdamW state (fp32 m, v), 1/2"] == single["AdamW state (fp32 m, v)"] // 2
    assert sharded["DiT weights"] == single["DiT weights"]


def test_pairs_of_changes_that_set_the_same_field_are_combined():
    """Two suggestions both set the recomputed blocks; pairing them used to raise TypeError."""
    v100 = int(known_gpu("V100-32GB").memory_gib * GIB)
    found = changes_that_fit(v100_plan(recomputed_blocks=0), v100, native_bf16=False,
                             attention_for=lambda p: attention_kernel((7, 0), p))
    flags = [label for label, _ in found]
    assert "--cache (encode once, train without the text encoder and VAE) + --gradient_checkpointing all" in flags
    assert not any(label.count("--gradient_checkpointing all") > 1 for label in flags)


def test_the_fp32_residual_stream_counts_its_fp32_values_and_auto_recomputes_one_more_block_on_a_v100():
    """Per kept block its three norms' inputs, each recomputed block's input and backward's gradient of the stream
    are fp32 instead of fp16: 2 more bytes each, per token and value of the width (3,072)."""
    plan = v100_plan(cached=True, recomputed_blocks=10)
    with_fp32 = plan.but(fp32_residual=True)
    (name, extra), = [item for item in estimate(with_fp32) if item[0].startswith("fp32 residual stream")]
    assert extra == (20 * 3 + 1 + 10) * 3072 * 4400 * 2 and "20 kept blocks" in name
    assert total(estimate(with_fp32)) == total(estimate(plan)) + extra
    assert not [item for item in estimate(plan) if item[0].startswith("fp32 residual")]   # DiffSynth's forward
    assert not [item for item in estimate(with_fp32.but(precision="no", attention="math"))
                if item[0].startswith("fp32 residual")]   # fp32 training: nothing is wider
    assert blocks_to_recompute(plan.but(compiled=True), 32 * GIB) == 10
    assert blocks_to_recompute(with_fp32.but(compiled=True), 32 * GIB) == 11


def test_the_run_plans_keep_the_stream_in_fp32_as_the_training_chooses_it():
    from diffsynth_mbc.training.options import resolve_options
    from diffsynth_mbc.training.plan.estimates import run_plans

    options = resolve_options(["--dataset_base_path", "data", "--dataset_metadata_path", "data/metadata.csv"])
    for precision, fp32_residual, expected in (("fp16", "auto", True), ("bf16", "auto", True), ("no", "auto", False),
                                               ("fp16", "off", False)):
        plans = run_plans(options.replace(fp32_residual=fp32_residual), precision, "mem_efficient", True, True)
        assert {plan.fp32_residual for plan in plans.values()} == {expected}, (precision, fp32_residual)
