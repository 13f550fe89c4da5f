"""The LoRA health's norms (training/components/lora_health.py): |BA|_F from r x r products, DoRA's exact |W' - W|_F,
per-block gradient norms before clipping, and the records, status and terminal lines of ``LoraHealth``."""

from __future__ import annotations

import json

import pytest
import torch
from peft import LoraConfig, inject_adapter_in_model
from torch import nn

from diffsynth_mbc.training.components import lora_health
from diffsynth_mbc.training.components.lora_health import (LoraHealth, dora_update_norm, grad_norms, lora_layers,
                                                          lora_update_norm, update_norms)
from diffsynth_mbc.training.components.protocol import StepContext, StepResult
from diffsynth_mbc.training.lora.variants import add_dora
from diffsynth_mbc.training.reporting.status_writer import RankStatusWriter


@pytest.mark.parametrize("out_features, in_features, rank", [(20, 30, 4), (64, 16, 8), (7, 5, 1)])
def test_the_norm_from_rank_by_rank_products_is_the_norm_of_b_times_a(out_features, in_features, rank):
    generator = torch.Generator().manual_seed(out_features)
    down = torch.randn(rank, in_features, generator=generator)
    up = torch.randn(out_features, rank, generator=generator)
    expected = torch.linalg.norm(0.5 * (up.double() @ down.double()))
    torch.testing.assert_close(lora_update_norm(down, up, 0.5), expected, rtol=1e-12, atol=0)
    assert float(lora_update_norm(down, torch.zeros_like(up), 2.0)) == 0.0


class Block(nn.Module):
    def __init__(self, dtype=torch.float64):
        super().__init__()
        self.q = nn.Linear(30, 20, dtype=dtype)
        self.ffn = nn.Sequential(nn.Linear(30, 50, dtype=dtype), nn.GELU(), nn.Linear(50, 30, dtype=dtype))
        self.norm = nn.LayerNorm(30, dtype=dtype)   # not a target


def adapted(variant: str, dtype=torch.float64, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    targets = ["q", "ffn.0", "ffn.2"]
    if variant == "dora":
        return add_dora(Block(dtype), targets, lora_rank=4, lora_alpha=8)
    return inject_adapter_in_model(LoraConfig(r=4, lora_alpha=8, target_modules=targets), Block(dtype))


def trained(block: nn.Module, seed: int = 1) -> nn.Module:
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in block.parameters():
            if parameter.requires_grad:
                parameter.add_(0.1 * torch.randn(parameter.shape, generator=generator, dtype=parameter.dtype))
    return block


def measured_change(layer) -> torch.Tensor:
    """|W' - W|_F as the layer computes it: its output on the identity minus the base layer's."""
    module = layer.module
    eye = torch.eye(module.get_base_layer().in_features, dtype=module.get_base_layer().weight.dtype)
    with torch.no_grad():
        return torch.linalg.norm((module(eye) - module.get_base_layer()(eye)).double())


@pytest.mark.parametrize("variant", ["lora", "dora"])
def test_each_layer_s_norm_is_the_measured_change_of_its_weight(variant):
    block = trained(adapted(variant))
    layers = lora_layers(block)
    assert len(layers) == 3
    assert all((layer.magnitude is not None) == (variant == "dora") for layer in layers)
    for layer in layers:
        torch.testing.assert_close(layer.update_norm(), measured_change(layer), rtol=1e-10, atol=1e-12)
    bases = [torch.linalg.norm(layer.module.get_base_layer().weight).item() for layer in layers]
    expected = sum(measured_change(layer).item() / base for layer, base in zip(layers, bases))
    assert update_norms([layers]) == [pytest.approx(expected, rel=1e-5)]


@pytest.mark.parametrize("variant", ["lora", "dora"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_an_untrained_lora_or_dora_measures_exactly_zero(variant, dtype):
    assert update_norms([lora_layers(adapted(variant, dtype))]) == [0.0]


def test_dora_in_row_chunks_is_the_same(monkeypatch):
    layer = lora_layers(trained(adapted("dora")))[1]
    whole = layer.update_norm()
    monkeypatch.setattr(lora_health, "ROW_CHUNK_ELEMENTS", 30 * 7)   # 7 rows at a time
    module = layer.module
    chunked = dora_update_norm(module.get_base_layer().weight, module.lora_A["default"].weight,
                               module.lora_B["default"].weight, module.scaling["default"], layer.magnitude,
                               layer.row_norms)
    torch.testing.assert_close(chunked, whole, rtol=1e-12, atol=0)


def test_block_gradient_norms_are_taken_before_clipping():
    blocks = [trained(adapted("lora", torch.float32, seed)) for seed in (0, 1)]
    parameters = [[p for p in block.parameters() if p.requires_grad] for block in blocks]
    assert grad_norms(parameters, None, 1.0) is None   # no gradients (DeepSpeed dropped them): null
    x = torch.randn(8, 30)
    sum(block.ffn(block.q(x).sum() * x).pow(2).sum() for block in blocks).backward()
    before = [torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in group])).item() for group in parameters]
    total = torch.nn.utils.clip_grad_norm_([p for group in parameters for p in group], 0.5).item()
    assert total > 0.5
    assert grad_norms(parameters, total, 0.5) == [pytest.approx(value, rel=1e-5) for value in before]
    assert grad_norms(parameters, total, float("inf")) == [pytest.approx(value * 0.5 / total, rel=1e-5)
                                                            for value in before]


class Printer:
    def __init__(self):
        self.lines = []

    def event(self, text):
        self.lines.append(text)


def test_records_at_step_0_every_n_steps_and_at_the_end_with_flags_said_once(tmp_path):
    status = RankStatusWriter(tmp_path, "run", 0, 0, 1, min_interval_s=0)
    blocks = [adapted("lora", torch.float32, seed) for seed in (0, 1, 2)]
    printer = Printer()
    health = LoraHealth(blocks, status, printer, every=3, total_steps=7, warmup_steps=0)
    health.at_start(StepContext(step=0, epoch=0, total_steps=7))
    for step in range(1, 8):
        status.append_history({"step": step, "loss": 1.0, "grad_norm": 1.0})
        health.after_step(StepContext(step=step, epoch=0, total_steps=7, result=StepResult(
            loss=1.0, lr=1e-4, grad_norm=1.0, skipped=False, samples=1, tokens=1)))
    health.record_last(7)
    health.record_last(7)   # once
    status.close()
    records = [json.loads(line) for line in status.history_file.read_text().splitlines()]
    health_records = [record for record in records if record.get("kind") == "lora_health"]
    assert [record["step"] for record in health_records] == [0, 3, 6, 7]
    assert all(record["update_norm_by_block"] == [0.0, 0.0, 0.0] for record in health_records)
    assert all(record["grad_norm_by_block"] is None and record["seconds"] >= 0 for record in health_records)
    # never trained: still from the first record after step 0, said once on the terminal
    assert [[flag["flag"] for flag in record["flags"]] for record in health_records] == [[], ["still"], ["still"],
                                                                                        ["still"]]
    assert len(printer.lines) == 1 and printer.lines[0].startswith("LoRA health at step 3: still:")
    state = json.loads(status.status_file.read_text())
    assert state["health"]["step"] == 7 and state["health"]["max_update_norm"] == 0.0
    assert [flag["flag"] for flag in state["health"]["flags"]] == ["still"]


def test_off_with_health_steps_0(tmp_path):
    status = RankStatusWriter(tmp_path, "run", 0, 0, 1)
    health = LoraHealth([adapted("lora")], status, Printer(), every=0, total_steps=5, warmup_steps=0)
    assert health.record(0) is None and not health.due(5) and status.history_listeners == []
    health.after_step(StepContext(step=5, epoch=0, total_steps=5, result=StepResult(
        loss=1.0, lr=1e-4, grad_norm=1.0, skipped=False, samples=1, tokens=1)))
    health.record_last(5)
    status.close()
    assert not status.history_file.exists() or status.history_file.read_text() == ""
