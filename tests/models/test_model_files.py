"""Checking the Wan2.2-TI2V-5B release files before anything loads, and the real loading path on tiny files."""

import json
import struct
import subprocess
import sys

import pytest
import torch
from safetensors.torch import save_file

from diffsynth_mbc.models.model_files import ModelFileError, locate_model_files
from e2e_helpers import isolated_env


def make_release(folder, shards=3):
    """A folder laid out like the release, with tiny but well-formed files."""
    folder.mkdir(parents=True, exist_ok=True)
    for index in range(1, shards + 1):
        save_file({"w": torch.zeros(2)}, str(folder / f"diffusion_pytorch_model-{index:05d}-of-{shards:05d}.safetensors"))
    torch.save({"w": torch.zeros(2)}, folder / "models_t5_umt5-xxl-enc-bf16.pth")
    torch.save({"w": torch.zeros(2)}, folder / "Wan2.2_VAE.pth")
    from diffsynth_mbc.models.pipeline import _write_demo_tokenizer
    _write_demo_tokenizer(folder / "google" / "umt5-xxl")
    return folder


def test_a_complete_release_is_found(tmp_path):
    files = locate_model_files(make_release(tmp_path / "m"))
    assert len(files.dit_shards) == 3 and files.vae.name == "Wan2.2_VAE.pth"


@pytest.mark.parametrize("damage,named", [
    (lambda m: (m / "diffusion_pytorch_model-00002-of-00003.safetensors").unlink(), "00002-of-00003"),
    (lambda m: (m / "Wan2.2_VAE.pth").unlink(), "missing VAE"),
    (lambda m: (m / "models_t5_umt5-xxl-enc-bf16.pth").write_bytes(b""), "empty text encoder"),
    (lambda m: (m / "Wan2.2_VAE.pth").write_bytes(b"<html>login page</html>"), "Wan2.2_VAE.pth: not a PyTorch"),
    (lambda m: (m / "diffusion_pytorch_model-00001-of-00003.safetensors").write_bytes(
        struct.pack("<Q", 999) + b"{not json"), "00001-of-00003.safetensors: not a readable safetensors"),
    (lambda m: (m / "google" / "umt5-xxl" / "tokenizer.json").unlink(), "tokenizer folder"),
])
def test_each_bad_file_is_named(tmp_path, damage, named):
    release = make_release(tmp_path / "m")
    damage(release)
    with pytest.raises(ModelFileError, match=named):
        locate_model_files(release)


def test_missing_folder_is_named(tmp_path):
    with pytest.raises(ModelFileError, match="model directory not found"):
        locate_model_files(tmp_path / "nowhere")


def test_real_loader_refuses_files_diffsynth_does_not_recognise(tmp_path):
    """The real path (DiffSynth's from_pretrained) runs on the files; DiffSynth only prints when it cannot
    tell what a file is, so the pipeline would have no DiT: that must be an error naming the folder."""
    from diffsynth_mbc.models.pipeline import load_pipeline

    release = make_release(tmp_path / "m")
    with pytest.raises(ModelFileError, match=f"did not recognise the dit, text_encoder, vae weights in {release}"):
        load_pipeline(str(release), None, device="cpu", torch_dtype=torch.float32)


@pytest.mark.slow
def test_training_with_a_broken_release_fails_before_loading_anything(tmp_path):
    release = make_release(tmp_path / "m")
    (release / "Wan2.2_VAE.pth").unlink()
    result = subprocess.run([sys.executable, "-m", "diffsynth_mbc.train", "--model_dir", str(release),
                             "--dataset_base_path", str(tmp_path), "--dataset_metadata_path", str(tmp_path / "x.csv"),
                             "--log_dir", str(tmp_path / "logs"), "--output_path", str(tmp_path / "out")],
                            env=isolated_env(tmp_path), capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert f"missing VAE: {release / 'Wan2.2_VAE.pth'}" in result.stderr
    state = json.loads((tmp_path / "logs" / "training_gpu0.json").read_text())
    assert state["status"] == "failed" and state["error"]["type"] == "ModelFileError"
    assert "loading models" not in state["phase"]
