"""benchmarks/random_release.py: a release folder with random weights that the real loading path takes as the
real one. DiffSynth recognises a file by the hash of its key names and shapes, so the full-size check runs on
the meta device; the writing runs at tiny size."""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from diffsynth.models.utils import load_state_dict

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import random_release  # noqa: E402

from diffsynth_mbc.models.model_files import locate_model_files  # noqa: E402
from diffsynth_mbc.models.pipeline import TINY_DIT, TINY_TEXT_ENCODER, build_tiny_vae  # noqa: E402


def test_diffsynth_recognises_every_full_size_file_and_not_a_renamed_key():
    assert random_release.check() == []
    with torch.device("meta"):
        _, _, build_vae = random_release.release_models()[2]
        vae = build_vae()
    state = vae.state_dict()   # the module's own names, with the "model." prefix the release's file lacks
    assert random_release.recognised_as(state) == []
    assert random_release.recognised_as(random_release.file_state_dict(vae, "Wan2.2_VAE.pth")) == ["wan_video_vae"]


def test_the_written_folder_passes_the_trainings_file_checks_and_holds_the_models_tensors(tmp_path):
    torch.manual_seed(0)
    models = random_release.release_models(TINY_DIT, dict(vocab=64, **TINY_TEXT_ENCODER), build_tiny_vae)
    written = random_release.write_release(tmp_path, "cpu", torch.bfloat16, models)
    files = locate_model_files(tmp_path)
    assert [p.name for p in files.dit_shards] == [f"diffusion_pytorch_model-0000{i}-of-00003.safetensors"
                                                  for i in (1, 2, 3)]
    assert set(written) == {*files.dit_shards, files.text_encoder, files.vae, files.tokenizer_dir}
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]   # no temp file left
    dit = {}
    for shard in files.dit_shards:
        dit.update(load_state_dict(str(shard)))
    with torch.device("meta"):
        expected = models[0][2]().state_dict()
    assert {k: (v.shape, v.dtype) for k, v in dit.items()} == {k: (v.shape, torch.bfloat16) for k, v in
                                                                 expected.items()}
    vae = load_state_dict(str(files.vae))
    assert vae and not any(key.startswith("model.") for key in vae)
    assert all(v.dtype == torch.bfloat16 for v in load_state_dict(str(files.text_encoder)).values())
