"""DoRA (--lora_variant dora) and LoRA+ (--loraplus_lr_ratio): options, optimizer groups, the DoRA layers."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from diffsynth_mbc.errors import OptionsError
from diffsynth_mbc.models.pipeline import build_demo_pipeline
from diffsynth_mbc.training.checkpoints.fingerprint import apply_run_settings
from diffsynth_mbc.training.lora.module import WanTI2VLoraModule
from diffsynth_mbc.training.lora.variants import check_adapter_shape, optimizer_groups
from diffsynth_mbc.training.options import load_preset, resolve_options

REQUIRED = ["--dataset_base_path", "data", "--dataset_metadata_path", "data/metadata.csv"]


def dit_output(dit, dtype=torch.float32):
    generator = torch.Generator().manual_seed(7)
    x = torch.randn(1, 48, 2, 4, 4, generator=generator).to(dtype)
    context = torch.randn(1, 8, 32, generator=generator).to(dtype)
    return dit(x, timestep=torch.tensor([500.0]).to(dtype), context=context).float()


def lora_module(variant="lora", dtype=torch.float32):
    pipe = build_demo_pipeline(load_encoders=False)
    pipe.dit.to(dtype)
    torch.manual_seed(0)   # peft draws lora_A from the global generator: the same LoRA for every module built here
    return WanTI2VLoraModule(pipe, lora_rank=4, lora_alpha=8.0, use_gradient_checkpointing=False,
                             lora_variant=variant)


def randomise(module, seed=3):
    """Trained-looking LoRA weights: non-zero B, magnitudes moved off the base norms."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in module.pipe.dit.named_parameters():
            if "lora_B" in name:
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.05)
            elif "lora_magnitude_vector" in name:
                parameter.mul_(1 + 0.1 * torch.randn(parameter.shape, generator=generator))


# -- options ----------------------------------------------------------------------------------------------


def test_both_are_off_by_default_and_read_from_flags_and_presets(tmp_path):
    options = resolve_options(REQUIRED)
    assert options.lora_variant == "lora" and options.loraplus_lr_ratio is None
    options = resolve_options(REQUIRED + ["--lora-variant", "dora", "--loraplus_lr_ratio", "16"])
    assert options.lora_variant == "dora" and options.loraplus_lr_ratio == 16.0
    preset = tmp_path / "p.yaml"
    preset.write_text("lora_variant: dora\nloraplus_lr_ratio: '8'\n")
    assert load_preset(preset) == {"lora_variant": "dora", "loraplus_lr_ratio": 8.0}
    assert resolve_options(["--config", str(preset)] + REQUIRED).loraplus_lr_ratio == 8.0


@pytest.mark.parametrize("flags, named", [
    (["--lora_variant", "qlora"], "--lora_variant must be one of lora, dora"),
    (["--loraplus_lr_ratio", "0"], "--loraplus_lr_ratio must be a finite number above 0"),
    (["--loraplus_lr_ratio", "nan"], "--loraplus_lr_ratio must be a finite number above 0"),
    (["--lora_variant", "dora", "--lora_format", "diffsynth"], "--lora_variant dora needs --lora_format comfyui"),
])
def test_bad_values_name_the_flag(flags, named):
    with pytest.raises(OptionsError, match=named):
        resolve_options(REQUIRED + flags)


# -- LoRA+ ------------------------------------------------------------------------------------------------


def one_adam_step(module, ratio, learning_rate=1e-3):
    randomise(module)
    optimizer = torch.optim.AdamW(optimizer_groups(module.named_parameters(), learning_rate, ratio),
                                  lr=learning_rate, weight_decay=0.0)
    before = {name: p.detach().clone() for name, p in module.named_parameters() if p.requires_grad}
    dit_output(module.pipe.dit).square().mean().backward()
    optimizer.step()
    return {name: (p.detach() - before[name]) for name, p in module.named_parameters() if p.requires_grad}, optimizer


def test_loraplus_moves_lora_b_ratio_times_further_and_a_as_before():
    plain, _ = one_adam_step(lora_module(), None)
    plus, optimizer = one_adam_step(lora_module(), 16.0)
    assert [group["lr"] for group in optimizer.param_groups] == [1e-3, 16e-3]
    for name, step in plain.items():
        expected = step * 16 if ".lora_B." in name else step
        torch.testing.assert_close(plus[name], expected, rtol=1e-3, atol=1e-9)
    # The schedule scales both groups by the same factor.
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 0.5)
    assert scheduler.get_last_lr() == [0.5e-3, 8e-3]


def test_without_loraplus_the_optimizer_is_todays_bit_for_bit():
    """The default hands AdamW the plain parameter list it always had: the same weights after the same steps."""
    module, reference = lora_module(), lora_module()
    randomise(module), randomise(reference)
    trainable = [p for p in reference.parameters() if p.requires_grad]
    ours = torch.optim.AdamW(optimizer_groups(module.named_parameters(), 1e-3, None), lr=1e-3, weight_decay=0.01)
    theirs = torch.optim.AdamW(trainable, lr=1e-3, weight_decay=0.01)
    assert len(ours.param_groups) == 1
    for _ in range(3):
        for model, optimizer in ((module, ours), (reference, theirs)):
            optimizer.zero_grad()
            dit_output(model.pipe.dit).square().mean().backward()
            optimizer.step()
    for (name, mine), theirs_p in zip(module.lora_state_dict().items(), reference.lora_state_dict().values()):
        assert torch.equal(mine, theirs_p), name


def test_force_resume_gives_lora_b_this_runs_ratio():
    module = lora_module()
    optimizer = torch.optim.AdamW(optimizer_groups(module.named_parameters(), 1e-3, 16.0), lr=1e-3)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 0.5)
    applied = apply_run_settings(scheduler, SimpleNamespace(learning_rate=2e-3, weight_decay=0.0, lr_scheduler="x",
                                                            warmup_steps=0, max_grad_norm=1.0, loraplus_lr_ratio=4.0))
    assert [group["lr"] for group in optimizer.param_groups] == [1e-3, 4e-3]
    assert scheduler.base_lrs == [2e-3, 8e-3] and "loraplus_lr_ratio 4" in applied


def test_turning_dora_or_loraplus_on_or_off_on_resume_is_refused_naming_the_flag():
    check_adapter_shape({"lora_variant": "lora", "loraplus_lr_ratio": 4.0},
                        {"lora_variant": "lora", "loraplus_lr_ratio": 8.0})   # another ratio: --force_resume's
    check_adapter_shape({}, {"lora_variant": "dora", "loraplus_lr_ratio": None})   # not recorded: not compared
    with pytest.raises(OptionsError, match="--lora_variant: the checkpoint was trained with 'lora'"):
        check_adapter_shape({"lora_variant": "lora"}, {"lora_variant": "dora"})
    with pytest.raises(OptionsError, match="--loraplus_lr_ratio: the checkpoint was trained with None"):
        check_adapter_shape({"loraplus_lr_ratio": None}, {"loraplus_lr_ratio": 16.0})


# -- DoRA ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_untrained_dora_is_the_base_model(dtype):
    """peft sets the magnitudes from a bf16 norm but divides by an fp32 one: one bf16 digit off, unless reset."""
    base = build_demo_pipeline(load_encoders=False).dit.to(dtype)
    with torch.no_grad():
        assert torch.equal(dit_output(lora_module("dora", dtype).pipe.dit, dtype), dit_output(base, dtype))


def test_dora_in_bf16_matches_fp32_within_bf16_precision():
    """The same trained DoRA on a bf16 DiT (the GPU case) and on an fp32 copy of those bf16 weights."""
    low, high = lora_module("dora", torch.bfloat16), lora_module("dora")
    with torch.no_grad():
        for (name, a), (_, b) in zip(low.pipe.dit.named_parameters(), high.pipe.dit.named_parameters()):
            b.copy_(a.float())
    randomise(low), randomise(high)
    with torch.no_grad():
        reference = dit_output(high.pipe.dit)
        output = dit_output(low.pipe.dit, torch.bfloat16)
        assert not torch.equal(reference, dit_output(build_demo_pipeline(load_encoders=False).dit))
    torch.testing.assert_close(output, reference, rtol=2e-2, atol=2e-2)


def test_dora_trains_its_magnitudes_and_exports_them():
    module = lora_module("dora")
    randomise(module)
    trainable = dict((name, p) for name, p in module.named_parameters() if p.requires_grad)
    magnitudes = [name for name in trainable if "lora_magnitude_vector" in name]
    assert len(magnitudes) == 20 and all(trainable[name].dtype == torch.float32 for name in magnitudes)
    dit_output(module.pipe.dit).square().mean().backward()
    assert all(trainable[name].grad is not None and trainable[name].grad.abs().sum() > 0 for name in magnitudes)
    saved = module.lora_state_dict()
    assert "blocks.0.self_attn.q.lora_magnitude_vector.default.weight" in saved and len(saved) == 3 * 20
