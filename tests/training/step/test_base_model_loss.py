"""The LoRA off (scale 0: what validation's ``val_loss_base`` measures, ``WanTI2VLoraModule.lora_disabled``) is the
base model exactly, for a LoRA and a DoRA that moved; afterwards the LoRA is back, trainable as before."""

from __future__ import annotations

import pytest
import torch
from peft.tuners.lora.layer import Linear as LoraLinear

from tiny_step import make_module


def loss_of(module, sample, quantile: float, seed: int = 3) -> torch.Tensor:
    torch.manual_seed(seed)
    with torch.no_grad():
        return module.sample_loss(dict(sample), timestep_quantile=quantile)


def base_model():
    """The same tiny DiT with a LoRA whose B matrices are zero: base + 0, the base model's output bit for bit."""
    module = make_module()
    with torch.no_grad():
        for name, parameter in module.named_parameters():
            if "lora_B" in name:
                parameter.zero_()
    return module


@pytest.mark.parametrize("variant", ["lora", "dora"])
def test_the_lora_off_gives_exactly_the_base_models_loss(entries, variant):
    videos, images = entries
    trained, base = make_module(lora_variant=variant), base_model()
    with torch.no_grad():
        for name, parameter in trained.named_parameters():
            if "lora_magnitude_vector" in name:   # a DoRA's magnitudes moved too
                parameter.mul_(1.1)
    trainable = [name for name, parameter in trained.named_parameters() if parameter.requires_grad]
    for sample, quantile in ((videos[0], 0.3), (images[0], 0.7), ({**videos[1], "mode": "t2v"}, 0.5)):
        with_lora = loss_of(trained, sample, quantile)
        with trained.lora_disabled() as layers:
            assert layers == sum(isinstance(m, LoraLinear) for m in trained.modules()) == 20   # every one
            off = loss_of(trained, sample, quantile)
        expected = loss_of(base, sample, quantile)
        assert torch.equal(off, expected), (float(off), float(expected))
        assert not torch.equal(with_lora, expected)              # the LoRA moved: its loss is not the base's
        assert torch.equal(loss_of(trained, sample, quantile), with_lora)   # and it is back after
    assert [name for name, parameter in trained.named_parameters() if parameter.requires_grad] == trainable
