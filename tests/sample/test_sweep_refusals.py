"""``python -m diffsynth_mbc.sample`` refusing what it cannot use before any model loads, each refusal naming the
file or flag: a damaged run_options.json, a prompts file that is not UTF-8, --strengths nan, a LoRA file made for
another model or whose metadata and weights disagree."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from diffsynth_mbc.sample.cli import main as sample_main
from diffsynth_mbc.training.options.run_options import TrainOptions
from diffsynth_mbc.training.options.run_record import write_run_options
from e2e_helpers import run_main

RANK = 4


def demo_layers() -> dict[str, tuple[int, int]]:
    """{name: (in, out)} of the demo DiT's linear layers a LoRA trains (q, k, v, o, ffn.0, ffn.2), from DiffSynth's
    own WanModel built with the demo's config on the meta device."""
    import torch
    from diffsynth.models.wan_video_dit import WanModel

    from diffsynth_mbc.models.pipeline import TINY_DIT

    with torch.device("meta"):
        dit = WanModel(**TINY_DIT)
    return {name: (layer.in_features, layer.out_features) for name, layer in dit.named_modules()
            if isinstance(layer, torch.nn.Linear) and name.split(".")[-1] in ("q", "k", "v", "o", "0", "2")
            and name.startswith("blocks.")}


def lora_file(path: Path, layers: dict, rank: int = RANK, widen: int = 1, alphas: float | None = None,
              **metadata) -> Path:
    """A LoRA file of zero pairs on ``layers`` ({name: (in, out)}), ``widen`` times wider; ``alphas``: a ``.alpha``
    key per module; ``metadata``: over the run's (None: left out)."""
    from safetensors.torch import save_file
    import torch

    tensors = {}
    for name, (width_in, width_out) in layers.items():
        tensors[f"diffusion_model.{name}.lora_A.weight"] = torch.zeros(rank, width_in * widen)
        tensors[f"diffusion_model.{name}.lora_B.weight"] = torch.zeros(width_out * widen, rank)
        if alphas is not None:
            tensors[f"diffusion_model.{name}.alpha"] = torch.tensor(alphas)
    facts = {"lora_rank": str(rank), "lora_alpha": str(rank), "lora_target_modules": "q,k,v,o,ffn.0,ffn.2",
             **metadata}
    save_file(tensors, str(path), metadata={key: value for key, value in facts.items() if value is not None})
    return path


@pytest.fixture
def prompts(tmp_path):
    (tmp_path / "prompts.yaml").write_text("- prompt: a news anchor\n  steps: 2\n")
    return tmp_path / "prompts.yaml"


def sweep(tmp_path, prompts, lora, *more):
    return run_main(sample_main, [prompts, "--lora", lora, "--output", tmp_path / "out", "--demo", *more], tmp_path)


def test_a_lora_for_another_model_or_with_disagreeing_metadata_is_refused_before_the_model_loads(tmp_path, prompts):
    layers = demo_layers()
    extra = {**layers, "blocks.7.self_attn.q": (64, 64)}   # a model of more blocks
    norm = {**layers, "blocks.0.self_attn.norm_q": (64, 64)}
    cases = {
        "wider": (lora_file(tmp_path / "wider.safetensors", layers, widen=2),
                  "blocks.0.cross_attn.k: lora_A (4, 128), lora_B (128, 4), but Wan2.2-TI2V-5B (demo)'s layer there "
                  "takes 64 and gives 64 (lora_A (4, 64), lora_B (64, 4)): it is a LoRA for another model"),
        "rank": (lora_file(tmp_path / "rank.safetensors", layers, lora_rank="8"),
                 "rank 4, but the file says lora_rank 8"),
        "blocks": (lora_file(tmp_path / "blocks.safetensors", extra),
                   "it has LoRA weights for blocks.7.self_attn.q, which Wan2.2-TI2V-5B (demo) has no linear layer "
                   "for: it is a LoRA for another model"),
        "norm": (lora_file(tmp_path / "norm.safetensors", norm, lora_target_modules=None),
                 "it has LoRA weights for blocks.0.self_attn.norm_q, which Wan2.2-TI2V-5B (demo) has no linear"),
        "targets": (lora_file(tmp_path / "targets.safetensors", layers, lora_target_modules="q,k"),
                    "its lora_target_modules (q,k) and its weights disagree: it has weights for blocks.0.cross_attn.o"),
    }
    for name, (path, message) in cases.items():
        result = sweep(tmp_path, prompts, path)
        assert result.returncode == 2, (name, result.stderr[-2000:])
        assert result.stderr.startswith(f"error: {path}: ") and message in result.stderr, (name, result.stderr)
        assert "--lora_" not in result.stderr, name   # no flag the sweep does not have
        assert "sweep:" not in result.stderr and not (tmp_path / "out").exists(), name   # before anything loaded
    from diffsynth_mbc.sample.lora_files import sweep_files
    from diffsynth_mbc.sample.render import fitting_settings

    good = lora_file(tmp_path / "good.safetensors", layers)   # the same layers at their own widths: it fits
    assert fitting_settings(sweep_files([str(good)]), demo=True, model="demo")[str(good)]["rank"] == RANK
    # kohya's and ComfyUI's files say their alpha per module (.alpha keys): taken as the file's alpha, not refused
    # with a flag to set, unless the metadata says another
    keyed = lora_file(tmp_path / "keyed.safetensors", layers, lora_alpha=None, alphas=2.0)
    assert fitting_settings(sweep_files([str(keyed)]), demo=True, model="demo")[str(keyed)]["alpha"] == 2.0
    torn = lora_file(tmp_path / "torn.safetensors", layers, alphas=2.0)
    with pytest.raises(ValueError, match=r"torn.safetensors: its alphas disagree \(metadata lora_alpha 4.0, .alpha "
                                         r"keys 2\)"):
        fitting_settings(sweep_files([str(torn)]), demo=True, model="demo")


def test_a_damaged_run_options_file_is_named(tmp_path, prompts):
    run = tmp_path / "run"
    write_run_options(TrainOptions(output_path=str(run), height=64, width=64, num_frames=9))
    lora_file(run / "lora.safetensors", demo_layers(), step="6", run_id="r")
    options = run / "run_options.json"
    text = options.read_text()
    options.write_text(text[:9] + "\x01" + text[9:])
    damaged = run_main(sample_main, [prompts, "--lora", run, "--output", tmp_path / "out"], tmp_path)
    assert damaged.returncode == 2
    assert damaged.stderr.startswith(f"error: {options}: damaged, it is not the run's options as the training writes "
                                     "them ("), damaged.stderr
    saved = json.loads(text)
    saved["options"]["seed"] = "abc"
    options.write_text(json.dumps(saved))
    typed = run_main(sample_main, [prompts, "--lora", run, "--output", tmp_path / "out"], tmp_path)
    assert (typed.returncode, typed.stderr.strip()) == (2, f"error: {options}: option seed is 'abc', not int; the "
                                                           "file is damaged")


def test_the_prompts_file_and_the_strengths_are_named_as_the_sweep_takes_them(tmp_path, prompts):
    good = lora_file(tmp_path / "good.safetensors", demo_layers())
    latin = tmp_path / "latin.yaml"
    latin.write_bytes("- prompt: un caf\u00e9\n".encode("latin-1"))
    result = run_main(sample_main, [latin, "--lora", good, "--output", tmp_path / "out", "--demo"], tmp_path)
    assert (result.returncode, result.stderr.strip()) == (2, f"error: prompts file {latin}: not UTF-8 text (byte 0xe9 "
                                                             "at position 16); save it as UTF-8")
    result = sweep(tmp_path, prompts, good, "--strengths", "nan")
    assert result.returncode == 2 and result.stderr.startswith("error: --strengths must be comma-separated numbers")
