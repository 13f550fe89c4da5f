"""``Checkpoints`` with a real accelerate state on one CPU process: what is written, and what never is."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from diffsynth_mbc.models.pipeline import build_demo_pipeline
from diffsynth_mbc.training.checkpoint_integrity import damage
from diffsynth_mbc.training.checkpoints import Checkpoints, Position, find_latest, read_manifest
from diffsynth_mbc.training.lora_format import NonFiniteLoraError
from diffsynth_mbc.training.lora_module import WanTI2VLoraModule
from diffsynth_mbc.training.options import resolve_options
from diffsynth_mbc.training.status_writer import RankStatusWriter


@pytest.fixture
def checkpoints(tmp_path):
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState

    options = resolve_options(["--demo", "--dataset_base_path", str(tmp_path), "--dataset_metadata_path",
                               str(tmp_path / "m.csv"), "--output_path", str(tmp_path / "out"), "--lora_rank", "4",
                               "--keep_checkpoints", "1"])
    accelerator = Accelerator(cpu=True)
    module = WanTI2VLoraModule(build_demo_pipeline(load_encoders=False), lora_rank=4, use_gradient_checkpointing=False)
    optimizer = torch.optim.AdamW([p for p in module.parameters() if p.requires_grad], lr=1e-3)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    module, optimizer = accelerator.prepare(module, optimizer)
    status = RankStatusWriter(options.log_dir, "run-test", 0, 0, 1)
    try:
        yield Checkpoints(accelerator, module, scheduler, options, status, fingerprint={"lora_rank": 4})
    finally:
        status.close()
        AcceleratorState._reset_state(reset_partial_state=True)


def poison(checkpoints, value=float("nan")) -> str:
    """One LoRA weight of the live model set to ``value``, as a run gone wrong would hold it; returns its file key."""
    model = checkpoints.accelerator.unwrap_model(checkpoints.module)
    name = next(n for n, p in model.named_parameters() if p.requires_grad and "blocks.1.self_attn.k.lora_B" in n)
    with torch.no_grad():
        dict(model.named_parameters())[name].view(-1)[3] = value
    return "diffusion_model.blocks.1.self_attn.k.lora_B.weight"


def test_a_lora_holding_nan_is_never_written_and_the_last_good_checkpoint_stays(checkpoints):
    good = checkpoints.save(Position(step=2))
    checkpoints.save_lora("lora.safetensors", 2)
    lora_file = checkpoints.options.output_path + "/lora.safetensors"
    before = load_file(lora_file)
    key = poison(checkpoints)
    with pytest.raises(NonFiniteLoraError, match=r"refusing to write .*step-00000004") as error:
        checkpoints.save(Position(step=4))
    message = str(error.value)
    assert f"1 of 40 LoRA tensors hold NaN or infinite values: {key} (1 NaN, 0 inf of" in message
    assert str(good) in message and "--resume latest" in message
    # Nothing of step 4 exists, the kept-1 pruning never ran, and step 2 is whole.
    assert find_latest(checkpoints.root) == good
    assert sorted(p.name for p in checkpoints.root.iterdir()) == ["step-00000002"]
    assert damage(good, read_manifest(good)) is None
    with pytest.raises(NonFiniteLoraError, match=r"refusing to write .*lora\.safetensors"):
        checkpoints.save_lora("lora.safetensors", 4)
    after = load_file(lora_file)
    assert after.keys() == before.keys() and all(torch.equal(after[k], before[k]) for k in before)


def test_an_infinite_value_is_named_too(checkpoints):
    key = poison(checkpoints, float("inf"))
    with pytest.raises(NonFiniteLoraError, match=rf"{key} \(0 NaN, 1 inf of"):
        checkpoints.save_lora("epoch-0.safetensors", 1)
    assert not (checkpoints.root.parent / "epoch-0.safetensors").exists()
