"""DoRA in DiffSynth: its loader ignores dora_scale (the DoRA loads wrong, without an error); ``export --format merged``
writes the DiT's weights with the DoRA (or LoRA) merged in, which DiffSynth loads with load_state_dict."""

from __future__ import annotations

import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from diffsynth_mbc.models.pipeline import build_demo_pipeline
from diffsynth_mbc.training.lora.export import dora_run_note
from diffsynth_mbc.training.lora.export import main as export_main
from diffsynth_mbc.training.lora.file_format import convert, file_metadata, training_scale
from diffsynth_mbc.training.lora.module import WanTI2VLoraModule
from diffsynth_mbc.training.lora.variants import dora_norm_ratios
from diffsynth_mbc.training.reporting.terminal import summary_lines

SEED, RANK, ALPHA = 42, 4, 12.0   # the demo's seed; alpha != rank: trained at scale 3


def dit_output(dit):
    generator = torch.Generator().manual_seed(7)
    x = torch.randn(1, 48, 2, 4, 4, generator=generator)
    context = torch.randn(1, 8, 32, generator=generator)
    with torch.no_grad():
        return dit(x, timestep=torch.tensor([500.0]), context=context)


def base_dit():
    return build_demo_pipeline(load_encoders=False, seed=SEED).dit


def trained_module(variant: str, seed: int = SEED):
    """The demo DiT with a LoRA or DoRA as training holds it: non-zero B, magnitudes moved off the base norms."""
    module = WanTI2VLoraModule(build_demo_pipeline(load_encoders=False, seed=seed), lora_rank=RANK, lora_alpha=ALPHA,
                               use_gradient_checkpointing=False, lora_variant=variant)
    generator = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for name, parameter in module.pipe.dit.named_parameters():
            if "lora_B" in name:
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.05)
            elif "lora_magnitude_vector" in name:
                parameter.mul_(1 + 0.2 * torch.rand(parameter.shape, generator=generator))
    return module


@pytest.fixture(scope="module", params=["dora", "lora"])
def run_file(request, tmp_path_factory):
    """The run's lora.safetensors, as a run writes it, and the output the trained module gives."""
    variant = request.param
    module = trained_module(variant)
    tensors = {k: v.detach().clone() for k, v in module.lora_state_dict().items()}
    ratios = dora_norm_ratios(module.pipe.dit) if variant == "dora" else None
    path = tmp_path_factory.mktemp(variant) / "lora.safetensors"
    save_file(convert(tensors, "comfyui", scale=training_scale(RANK, ALPHA), dora_ratios=ratios), str(path),
              metadata=file_metadata(rank=RANK, alpha=ALPHA, targets="q,k,v,o,ffn.0,ffn.2",
                                     base_model="Wan2.2-TI2V-5B (demo)", step=10, run_id="r", layout="comfyui",
                                     variant=variant))
    return {"variant": variant, "path": path, "output": dit_output(module.pipe.dit), "raw": tensors}


def export(*args):
    """The command in a process of its own (the merged export of each case runs that way), else in this one; as a
    user runs it, without the launchers' warning filters."""
    environment = {key: value for key, value in os.environ.items() if key != "PYTHONWARNINGS"}
    return subprocess.run([sys.executable, "-m", "diffsynth_mbc.export", *map(str, args)], capture_output=True,
                          text=True, timeout=300, env=environment)


def export_here(capsys, *args) -> SimpleNamespace:
    code = export_main([str(arg) for arg in args])
    return SimpleNamespace(returncode=code, stderr=capsys.readouterr().err)


def relative_miss(output, trained):
    """How much of the trained change to the DiT's output ``output`` misses."""
    return float((output - trained).norm() / (trained - dit_output(base_dit())).norm())


@pytest.mark.slow
def test_diffsynth_load_lora_misses_a_dora_and_the_merged_export_reproduces_it(tmp_path, run_file):
    pipe = build_demo_pipeline(load_encoders=False, seed=SEED)
    pipe.load_lora(pipe.dit, str(run_file["path"]))   # no error, whatever the file holds
    loaded = relative_miss(dit_output(pipe.dit), run_file["output"])
    merged = tmp_path / "merged.safetensors"
    result = export(run_file["path"], "--format", "merged", "--demo", "--output", merged)
    assert result.returncode == 0, result.stderr
    kind = {"dora": "DoRA", "lora": "LoRA"}[run_file["variant"]]
    assert result.stderr.startswith(f"wrote {merged}: 20 DiT weights with the {kind} merged in"), result.stderr
    weights = load_file(str(merged))
    assert sorted(weights)[0] == "blocks.0.cross_attn.k.weight" and len(weights) == 20
    pipe = build_demo_pipeline(load_encoders=False, seed=SEED)
    missing, unexpected = pipe.dit.load_state_dict(weights, strict=False)
    assert unexpected == [] and "blocks.0.self_attn.q.bias" in missing
    torch.testing.assert_close(dit_output(pipe.dit), run_file["output"], rtol=1e-4, atol=1e-5)
    if run_file["variant"] == "dora":
        assert loaded > 0.1, loaded   # 0.28-0.37 here (the LoRA A draws vary); 0.21 after a 3-epoch demo DoRA run
    else:
        assert loaded < 1e-4          # a plain LoRA loads right either way
    assert safe_open(str(merged), framework="pt").metadata()["lora_variant"] == run_file["variant"]


def test_the_merged_export_reads_the_base_from_a_model_folder_and_takes_peft_magnitudes(tmp_path, run_file, capsys):
    """From the release layout (DiT shards), only the weights the LoRA changes; a checkpoint's raw peft tensors
    (lora_magnitude_vector, alpha from the metadata) merge to the same trained model."""
    model = tmp_path / "Wan2.2-TI2V-5B"
    model.mkdir()
    state = {key: value.contiguous() for key, value in base_dit().state_dict().items()}
    keys = sorted(state)
    for number, part in enumerate((keys[:len(keys) // 2], keys[len(keys) // 2:]), start=1):
        save_file({key: state[key] for key in part}, str(model / f"diffusion_pytorch_model-0000{number}-of-00002"
                                                                      ".safetensors"))
    raw = tmp_path / "raw.safetensors"
    save_file(run_file["raw"], str(raw), metadata={"lora_rank": str(RANK), "lora_alpha": str(ALPHA)})
    for source in (run_file["path"], raw):
        merged = tmp_path / f"merged-{source.stem}.safetensors"
        result = export_here(capsys, source, "--format", "merged", "--model_dir", model, "--output", merged)
        assert result.returncode == 0, result.stderr
        dit = base_dit()
        assert dit.load_state_dict(load_file(str(merged)), strict=False).unexpected_keys == []
        torch.testing.assert_close(dit_output(dit), run_file["output"], rtol=1e-4, atol=1e-5)


def test_the_merged_export_refuses_without_or_with_the_wrong_base(tmp_path, run_file, capsys):
    source, output = run_file["path"], tmp_path / "merged.safetensors"
    result = export_here(capsys, source, "--format", "merged", "--output", output)
    assert result.returncode == 2 and "--format merged needs the base model's weights: --model_dir DIR" in result.stderr
    model = tmp_path / "other"
    model.mkdir()
    state = base_dit().state_dict()
    state["blocks.1.ffn.2.weight"] = torch.zeros(64, 64)   # another model's shape
    del state["blocks.0.self_attn.q.weight"]
    save_file({k: v.contiguous() for k, v in state.items()}, str(model / "diffusion_pytorch_model.safetensors"))
    result = export_here(capsys, source, "--format", "merged", "--model_dir", model, "--output", output)
    assert result.returncode == 2 and "its DiT weights have no blocks.0.self_attn.q.weight" in result.stderr
    state["blocks.0.self_attn.q.weight"] = torch.zeros(64, 64)
    save_file({k: v.contiguous() for k, v in state.items()}, str(model / "diffusion_pytorch_model.safetensors"))
    result = export_here(capsys, source, "--format", "merged", "--model_dir", model, "--output", output)
    assert result.returncode == 2 and "blocks.1.ffn.2: the LoRA changes a (64, 128) weight, the base model's is " \
                                      "(64, 64): the LoRA is for another model" in result.stderr, result.stderr
    result = export_here(capsys, source, "--demo", "--output", output)
    assert result.returncode == 2 and "--demo is read by --format merged only" in result.stderr
    assert not output.exists()


@pytest.mark.slow
def test_a_dora_says_where_it_loads_right_at_export_and_at_the_end_of_its_run(tmp_path, run_file, capsys):
    result = export_here(capsys, run_file["path"], "--output", tmp_path / "comfy.safetensors")
    assert result.returncode == 0, result.stderr
    summary = "\n".join(summary_lines({"status": "finished", "step": 10, "total_steps": 10}, best_val_loss=None,
                                      output_path=str(run_file["path"].parent), log_dir="logs"))
    if run_file["variant"] == "lora":
        assert "note:" not in result.stderr and dora_run_note(run_file["path"]) is None and "DoRA" not in summary
        return
    said = "loads a DoRA file without an error but ignores its dora_scale tensors"
    assert "note: a DoRA: ComfyUI loads it as trained" in result.stderr and said in result.stderr
    assert "For DiffSynth, export with --format merged --model_dir MODEL_DIR" in result.stderr
    assert "  DoRA: ComfyUI loads lora.safetensors as trained; DiffSynth's LoRA loader (pipe.load_lora)" in summary
    assert said in summary and f"export {run_file['path']} --format merged --demo --seed SEED --output" in summary
    result = export_here(capsys, run_file["path"], "--format", "diffsynth", "--output", tmp_path / "ds.safetensors")
    assert result.returncode == 2
    assert "for DiffSynth, export with --format merged --model_dir MODEL_DIR" in result.stderr
