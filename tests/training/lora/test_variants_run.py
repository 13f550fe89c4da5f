"""DoRA and LoRA+ on 2 real CPU ranks (DDP, gloo): the run's LoRA file and checkpoints carry the magnitudes."""

from __future__ import annotations


import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from diffsynth_mbc.data.demo import prepare
from diffsynth_mbc.models.pipeline import build_demo_pipeline
from e2e_helpers import demo_flags, read_status
from forked_ranks import run_training
from test_file_format import comfyui_merge, dit_output

pytestmark = pytest.mark.slow


def test_dora_with_loraplus_trains_on_two_ranks_and_writes_a_comfyui_dora_file(tmp_path):
    root = tmp_path / "demo"
    prepare(root, num_videos=3, num_images=2)
    flags = [*demo_flags(root, num_epochs=1, lora_variant="dora", loraplus_lr_ratio=4,
                                             checkpoint_steps=2)]
    result = run_training(tmp_path, flags, timeout=540, OMP_NUM_THREADS=1)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    for rank in (0, 1):
        assert read_status(root / "logs", rank)["status"] == "finished"
    path = root / "lora" / "lora.safetensors"
    lora = load_file(str(path))
    assert safe_open(str(path), framework="pt").metadata()["lora_variant"] == "dora"
    scales = [key for key in lora if key.endswith(".dora_scale")]
    assert len(scales) == 20 and all(lora[key].shape[1] == 1 for key in scales)
    dit = build_demo_pipeline(load_encoders=False).dit
    with torch.no_grad():
        base = dit_output(dit)
        assert comfyui_merge(dit, lora) == set()
        assert not torch.allclose(dit_output(dit), base, atol=1e-4)   # the trained DoRA changes the DiT
    # The checkpoint holds the trained magnitudes beside A and B (what a resume restores).
    saved = load_file(str(root / "lora" / "checkpoints" / "step-00000002" / "model.safetensors"))
    magnitudes = [key for key in saved if "lora_magnitude_vector" in key]
    assert len(magnitudes) == 20
