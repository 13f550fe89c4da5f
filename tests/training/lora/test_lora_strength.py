"""The LoRA at a strength for sample clips (training/lora/strength.py): 0 is the base model bit for bit, s scales
what the LoRA (or DoRA) adds, and afterwards the module is exactly as it was."""

from __future__ import annotations

import pytest
import torch

from diffsynth_mbc.models.pipeline import build_demo_pipeline
from diffsynth_mbc.training.lora.strength import lora_strength
from test_variants import dit_output, lora_module, randomise


def state(module) -> dict:
    """Every parameter and each LoRA layer's scaling and hooks: what must come back unchanged."""
    from peft.tuners.lora.layer import LoraLayer

    layers = {name: (dict(m.scaling), len(m._forward_hooks),
                     sum(len(d._forward_hooks) for d in m.lora_magnitude_vector.values()))
              for name, m in module.named_modules() if isinstance(m, LoraLayer)}
    return {"parameters": {n: p.detach().clone() for n, p in module.named_parameters()}, "layers": layers}


def assert_same_state(before, after):
    assert before["layers"] == after["layers"]
    assert before["parameters"].keys() == after["parameters"].keys()
    for name, value in before["parameters"].items():
        assert torch.equal(value, after["parameters"][name]), name


@pytest.mark.parametrize("variant", ["lora", "dora"])
def test_strength_0_is_the_base_model_and_1_the_lora_as_trained(variant):
    module = lora_module(variant)
    randomise(module)
    dit = module.pipe.dit
    base = build_demo_pipeline(load_encoders=False).dit
    before = state(module)
    with torch.no_grad():
        trained = dit_output(dit)
        assert not torch.equal(trained, dit_output(base))
        with lora_strength(dit, 0.0):
            assert torch.equal(dit_output(dit), dit_output(base))
        with lora_strength(dit, 1.0):
            assert torch.equal(dit_output(dit), trained)
        assert torch.equal(dit_output(dit), trained)
    assert_same_state(before, state(module))


@pytest.mark.parametrize("variant", ["lora", "dora"])
def test_a_strength_scales_what_each_layer_adds(variant):
    """Per layer: base + s * (trained - base), for plain LoRA and DoRA alike (DoRA's weight change W' - W)."""
    from peft.tuners.lora.layer import Linear as LoraLinear

    module = lora_module(variant)
    randomise(module)
    layer = next(m for m in module.pipe.dit.modules() if isinstance(m, LoraLinear))
    x = torch.randn(3, layer.in_features, generator=torch.Generator().manual_seed(1))
    before = state(module)
    with torch.no_grad():
        base, trained = layer.base_layer(x), layer(x)
        for strength in (0.5, 2.0, -1.0):
            with lora_strength(module.pipe.dit, strength):
                torch.testing.assert_close(layer(x), base + strength * (trained - base), rtol=1e-5, atol=1e-6)
        assert torch.equal(layer(x), trained)
    assert_same_state(before, state(module))


def test_the_strength_comes_back_even_on_error():
    module = lora_module("dora")
    before = state(module)
    with pytest.raises(RuntimeError), lora_strength(module.pipe.dit, 0.5):
        raise RuntimeError("a failed clip")
    assert_same_state(before, state(module))
    lora = lora_module("lora")
    before = state(lora)
    with pytest.raises(RuntimeError), lora_strength(lora.pipe.dit, 0.5):
        assert state(lora)["layers"] != before["layers"]
        raise RuntimeError("a failed clip")
    assert_same_state(before, state(lora))


def test_compiled_blocks_run_uncompiled_inside_and_get_their_compiled_form_back():
    module = lora_module("lora")
    block = module.pipe.dit.blocks[0]
    marker = object()
    block._compiled_call_impl = marker   # what Module.compile sets; never called here
    with lora_strength(module.pipe.dit, 0.5):
        assert block._compiled_call_impl is None
    assert block._compiled_call_impl is marker
    with lora_strength(module.pipe.dit, 1.0):   # the trained strength changes nothing
        assert block._compiled_call_impl is marker
    block._compiled_call_impl = None
