"""LoRA files that load at the trained strength in DiffSynth and under ComfyUI's key rules."""

from __future__ import annotations

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from diffsynth_mbc.models.pipeline import build_demo_pipeline
from diffsynth_mbc.training.lora.export import ExportError, export
from diffsynth_mbc.training.lora.export import main as export_main
from diffsynth_mbc.training.lora.file_format import (LoraFormatError, convert, file_metadata, split_lora_key,
                                                     training_scale)
from diffsynth_mbc.training.lora.module import WanTI2VLoraModule
from test_merge import dit_output, trained_module

RANK, ALPHA = 4, 12.0          # alpha != rank: trained at scale 3


@pytest.fixture(scope="module")
def trained():
    """The tiny TI2V DiT with a LoRA as training holds it (non-zero B, so the LoRA changes the output)."""
    module = WanTI2VLoraModule(build_demo_pipeline(load_encoders=False), lora_rank=RANK, lora_alpha=ALPHA,
                               use_gradient_checkpointing=False)
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, parameter in module.pipe.dit.named_parameters():
            if "lora_B" in name:
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.05)
    tensors = {k: v.detach().clone() for k, v in module.lora_state_dict().items()}
    return {"output": dit_output(module.pipe.dit), "tensors": tensors}


def base_dit():
    return build_demo_pipeline(load_encoders=False).dit


def test_the_lora_changes_the_output(trained):
    assert not torch.allclose(trained["output"], dit_output(base_dit()), atol=1e-4)


@pytest.mark.parametrize("layout", ["comfyui", "diffsynth"])
def test_diffsynth_loads_the_file_at_the_trained_strength(tmp_path, trained, layout):
    path = tmp_path / "lora.safetensors"
    save_file(convert(trained["tensors"], layout, scale=training_scale(RANK, ALPHA)), str(path))
    pipe = build_demo_pipeline(load_encoders=False)
    pipe.load_lora(pipe.dit, str(path))
    torch.testing.assert_close(dit_output(pipe.dit), trained["output"], rtol=1e-4, atol=1e-5)


def comfyui_merge(dit, lora: dict) -> set:
    """ComfyUI's rules as its loader states them (comfy/lora.py, comfy/weight_adapter/lora.py): every model
    weight ``diffusion_model.<m>.weight`` is addressed as ``diffusion_model.<m>``; a LoRA for x is
    ``x.lora_up.weight``/``x.lora_down.weight`` or ``x.lora_B.weight``/``x.lora_A.weight``; the patch is
    ``(alpha / rank) * up @ down`` when ``x.alpha`` exists (rank = down.shape[0]), else ``up @ down``.
    Returns the file keys it did not load (ComfyUI's "lora key not loaded")."""
    weights = dict(dit.named_parameters())
    key_map = {f"diffusion_model.{name[:-len('.weight')]}": name for name in weights if name.endswith(".weight")}
    loaded = set()
    for x, target in key_map.items():
        for up_name, down_name in ((f"{x}.lora_up.weight", f"{x}.lora_down.weight"),
                                   (f"{x}.lora_B.weight", f"{x}.lora_A.weight")):
            if up_name in lora:
                up, down = lora[up_name], lora[down_name]
                scale = lora[f"{x}.alpha"].item() / down.shape[0] if f"{x}.alpha" in lora else 1.0
                with torch.no_grad():
                    if f"{x}.dora_scale" in lora:
                        weights[target].copy_(comfyui_weight_decompose(lora[f"{x}.dora_scale"], weights[target],
                                                                       scale * (up @ down)))
                    else:
                        weights[target] += scale * (up @ down)
                loaded |= {up_name, down_name} | {f"{x}.{extra}" for extra in ("alpha", "dora_scale")
                                                  if f"{x}.{extra}" in lora}
                break
    return set(lora) - loaded


def comfyui_weight_decompose(dora_scale, weight, diff):
    """ComfyUI's DoRA merge at strength 1 (comfy/weight_adapter/base.py, weight_decompose): a dora_scale with as
    many rows as the weight is on the output axis and divides by the row norms of the *base* weight; otherwise
    by the column norms of the merged one."""
    merged = weight + diff
    if dora_scale.shape[0] == merged.shape[0]:
        norm = weight.reshape(weight.shape[0], -1).norm(dim=1, keepdim=True)
    else:
        norm = merged.transpose(0, 1).reshape(merged.shape[1], -1).norm(dim=1, keepdim=True).transpose(0, 1)
    return merged * (dora_scale / (norm + torch.finfo(weight.dtype).eps))


def test_comfyui_rules_load_every_key_at_the_trained_strength(trained):
    lora = convert(trained["tensors"], "comfyui", scale=training_scale(RANK, ALPHA))
    assert all(key.startswith("diffusion_model.blocks.") and ".default" not in key for key in lora)
    dit = base_dit()
    assert comfyui_merge(dit, lora) == set()
    torch.testing.assert_close(dit_output(dit), trained["output"], rtol=1e-4, atol=1e-5)


def test_the_old_layout_is_what_comfyui_misses(trained):
    """Why the layout changed: keys as DiffSynth exports them are not addressed by ComfyUI's generic map."""
    assert comfyui_merge(base_dit(), trained["tensors"]) == set(trained["tensors"])


def test_export_converts_an_old_file_and_never_touches_it(tmp_path, trained):
    old = tmp_path / "old.safetensors"
    save_file(trained["tensors"], str(old), metadata={"lora_rank": str(RANK), "lora_alpha": str(ALPHA),
                                                      "lora_target_modules": "q,k,v,o,ffn.0,ffn.2", "step": "12"})
    before = old.read_bytes()
    result = export(old, "comfyui", tmp_path / "comfy.safetensors")
    assert old.read_bytes() == before and result["scale_folded"] == ALPHA / RANK
    dit = base_dit()
    assert comfyui_merge(dit, load_file(str(tmp_path / "comfy.safetensors"))) == set()
    torch.testing.assert_close(dit_output(dit), trained["output"], rtol=1e-4, atol=1e-5)
    # An already folded file converts between layouts without scaling twice.
    again = export(tmp_path / "comfy.safetensors", "diffsynth", tmp_path / "ds.safetensors")
    assert again["scale_folded"] == 1.0
    pipe = build_demo_pipeline(load_encoders=False)
    pipe.load_lora(pipe.dit, str(tmp_path / "ds.safetensors"))
    torch.testing.assert_close(dit_output(pipe.dit), trained["output"], rtol=1e-4, atol=1e-5)


def test_export_refuses_what_it_cannot_make_right(tmp_path, trained):
    bare = tmp_path / "bare.safetensors"
    save_file(trained["tensors"], str(bare))
    with pytest.raises(ExportError, match="rank"):
        export(bare, "comfyui", tmp_path / "out.safetensors")
    with pytest.raises(ExportError, match="overwrite the input"):
        export(bare, "comfyui", bare)
    with pytest.raises(ExportError, match="no such LoRA file"):
        export(tmp_path / "missing", "comfyui", tmp_path / "out.safetensors")
    garbage = tmp_path / "garbage.safetensors"
    garbage.write_bytes(b"\x00" * 64)
    with pytest.raises(ExportError, match="garbage.safetensors"):
        export(garbage, "comfyui", tmp_path / "out.safetensors")


def test_key_rules():
    assert split_lora_key("blocks.0.self_attn.q.lora_A.default.weight") == ("blocks.0.self_attn.q", "A")
    assert split_lora_key("pipe.dit.blocks.1.ffn.0.lora_B.default.weight") == ("blocks.1.ffn.0", "B")
    assert split_lora_key("diffusion_model.blocks.1.ffn.2.lora_up.weight") == ("blocks.1.ffn.2", "B")
    with pytest.raises(LoraFormatError, match="not a LoRA weight key"):
        split_lora_key("blocks.0.self_attn.q.weight")
    with pytest.raises(LoraFormatError, match="not both"):
        convert({"blocks.0.q.lora_A.weight": torch.zeros(2, 3)}, "comfyui")
    meta = file_metadata(rank=4, alpha=None, targets="q", base_model="m", step=3, run_id="r", layout="comfyui")
    assert meta["lora_alpha"] == "4" and meta["lora_scale_folded"] == "true"
    assert all(isinstance(v, str) for v in meta.values())


META = {"lora_rank": str(RANK), "lora_alpha": str(ALPHA), "lora_target_modules": "q,k,v,o,ffn.0,ffn.2"}


def broken_file(path, trained, case):
    """A LoRA file with one thing wrong, as found in the wild; returns the text the refusal must hold."""
    tensors, meta = dict(trained["tensors"]), dict(META)
    first_b = sorted(k for k in tensors if "lora_B" in k)[0]
    if case == "nan alpha":
        meta["lora_alpha"], expected = "nan", "lora_alpha 'nan'"
    elif case == "nan weight":
        tensors[first_b] = tensors[first_b].clone()
        tensors[first_b][0, 0] = float("nan")
        expected = f"1 of {len(tensors)} LoRA tensors hold NaN or infinite values: diffusion_model."
    elif case == "rank above the tensors":
        meta["lora_rank"], expected = "16", "rank 4, but the file says lora_rank 16"
    elif case == "A and B of different ranks":
        tensors[first_b] = torch.zeros(tensors[first_b].shape[0], 8)
        expected = "lora_A is of rank 4 but lora_B of rank 8"
    elif case == "no tensors":
        tensors, expected = {}, "no LoRA tensors"
    elif case in ("garbage rank", "zero rank", "inf rank"):
        meta["lora_rank"] = {"garbage rank": "four", "zero rank": "0", "inf rank": "inf"}[case]
        expected = f"lora_rank {meta['lora_rank']!r} in its metadata is not a whole number"
    elif case == "alpha keys disagreeing with the metadata":
        tensors.update({f"{split_lora_key(k)[0]}.alpha": torch.tensor(8.0) for k in trained["tensors"]})
        expected = "metadata says lora_alpha 12 but its .alpha keys say 8"
    save_file(tensors, str(path), metadata=meta)
    return expected


@pytest.mark.parametrize("case", ["nan alpha", "nan weight", "rank above the tensors", "A and B of different ranks",
                                  "no tensors", "garbage rank", "zero rank", "inf rank",
                                  "alpha keys disagreeing with the metadata"])
def test_export_refuses_a_broken_file_with_exit_2_and_writes_nothing(tmp_path, trained, case, capsys):
    source, output = tmp_path / "in.safetensors", tmp_path / "out.safetensors"
    expected = broken_file(source, trained, case)
    assert export_main([str(source), "--output", str(output)]) == 2
    error = capsys.readouterr().err
    assert error.startswith(f"error: {source}: ") and expected in error, error
    assert not output.exists()


def test_per_module_alpha_keys_are_folded_once(tmp_path, trained):
    """ComfyUI-style files carry alpha as .alpha keys; with the same alpha in the metadata it is applied once."""
    source = tmp_path / "alpha.safetensors"
    alphas = {f"{split_lora_key(k)[0]}.alpha": torch.tensor(ALPHA) for k in trained["tensors"]}
    save_file({**trained["tensors"], **alphas}, str(source), metadata=META)
    result = export(source, "comfyui", tmp_path / "comfy.safetensors")
    assert result["scale_folded"] == ALPHA / RANK and result["alpha"] == ALPHA
    written = safe_open(str(tmp_path / "comfy.safetensors"), framework="pt").metadata()
    assert written["lora_alpha"] == str(ALPHA) and written["lora_scale_folded"] == "true"
    dit = base_dit()
    assert comfyui_merge(dit, load_file(str(tmp_path / "comfy.safetensors"))) == set()
    torch.testing.assert_close(dit_output(dit), trained["output"], rtol=1e-4, atol=1e-5)


def test_export_never_writes_inside_the_checkpoint_it_reads(tmp_path, trained, capsys):
    checkpoint = tmp_path / "checkpoints" / "step-00000004"
    checkpoint.mkdir(parents=True)
    save_file(trained["tensors"], str(checkpoint / "lora.safetensors"), metadata=META)
    (checkpoint / "model.safetensors").write_bytes(b"the optimizer's own state")
    (checkpoint / "checkpoint.json").write_text('{"step": 4, "fingerprint": {"lora_rank": 4, "lora_alpha": 12.0}}')
    for source in (checkpoint, checkpoint / "lora.safetensors"):
        assert export_main([str(source), "--output", str(checkpoint / "model.safetensors")]) == 2
        assert "inside the checkpoint folder" in capsys.readouterr().err
    assert (checkpoint / "model.safetensors").read_bytes() == b"the optimizer's own state"
    assert export_main([str(checkpoint), "--output", str(tmp_path)]) == 2
    assert "is a folder" in capsys.readouterr().err
    assert export_main([str(checkpoint), "--output", str(tmp_path / "out.safetensors")]) == 0


@pytest.mark.slow   # starts a Python process that imports torch
def test_no_torch_notice_above_the_exports_line(tmp_path, trained):
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "PYTHONWARNINGS"}   # not started by a launcher
    probe = subprocess.run([sys.executable, "-c", "import torch.cuda"], capture_output=True, text=True, timeout=300,
                           env=env)
    if "pynvml" not in probe.stderr:
        pytest.skip("this torch imports no deprecated pynvml here: nothing to silence")
    source = tmp_path / "lora.safetensors"
    save_file(trained["tensors"], str(source), metadata=META)
    result = subprocess.run([sys.executable, "-m", "diffsynth_mbc.export", str(source), "--output",
                             str(tmp_path / "out.safetensors")], capture_output=True, text=True, timeout=300, env=env)
    assert result.returncode == 0 and result.stderr.startswith("wrote "), result.stderr


def test_epoch_file_names_count_from_1_as_the_terminal_does_and_list_in_order():
    from diffsynth_mbc.run_layout import epoch_file_name

    names = [epoch_file_name(epoch, 12) for epoch in range(12)]
    assert names[0] == "epoch-001.safetensors" and names[9] == "epoch-010.safetensors"
    assert sorted(names) == names                                   # ls lists epoch 10 after epoch 9
    assert epoch_file_name(0, 1000) == "epoch-0001.safetensors"     # wider only when the run needs it


def test_export_refuses_to_replace_an_existing_output_without_overwrite(tmp_path, trained, capsys):
    source = tmp_path / "epoch-0.safetensors"                        # a name earlier versions wrote: still read
    save_file(trained["tensors"], str(source), metadata=META)
    output = tmp_path / "comfy.safetensors"
    output.write_bytes(b"someone's earlier export")
    assert export_main([str(source), "--output", str(output)]) == 2
    err = capsys.readouterr().err
    assert f"{output}: exists" in err and "--overwrite" in err
    assert output.read_bytes() == b"someone's earlier export"
    assert export_main([str(source), "--output", str(output), "--overwrite"]) == 0
    assert set(load_file(str(output))) and output.read_bytes() != b"someone's earlier export"


@pytest.fixture(scope="module")
def trained_dora():
    """The tiny DiT with a DoRA as training holds it: non-zero B, magnitudes moved off the base row norms."""
    from diffsynth_mbc.training.lora.variants import dora_norm_ratios

    module = trained_module("dora", seed=0)
    with torch.no_grad():
        output = dit_output(module.pipe.dit)
    tensors = {k: v.detach().clone() for k, v in module.lora_state_dict().items()}
    return {"output": output, "tensors": tensors, "ratios": dora_norm_ratios(module.pipe.dit)}


def dora_file(trained_dora):
    return convert(trained_dora["tensors"], "comfyui", scale=training_scale(RANK, ALPHA),
                   dora_ratios=trained_dora["ratios"])


def test_a_dora_file_loads_under_comfyuis_rules_at_the_trained_output(trained_dora):
    lora = dora_file(trained_dora)
    scales = {key: value for key, value in lora.items() if key.endswith(".dora_scale")}
    assert len(scales) == 20 and lora["diffusion_model.blocks.0.ffn.0.dora_scale"].shape == (128, 1)
    dit = base_dit()
    assert not torch.allclose(dit_output(dit), trained_dora["output"], atol=1e-3)
    assert comfyui_merge(dit, lora) == set()
    torch.testing.assert_close(dit_output(dit), trained_dora["output"], rtol=1e-4, atol=1e-5)
    # The magnitudes alone, as other tools write them, would not give the trained output under those rules.
    raw = dict(lora)
    for key in scales:
        module = key[len("diffusion_model."):-len(".dora_scale")]
        raw[key] = trained_dora["tensors"][f"{module}.lora_magnitude_vector.default.weight"].reshape(-1, 1)
    dit = base_dit()
    comfyui_merge(dit, raw)
    assert not torch.allclose(dit_output(dit), trained_dora["output"], rtol=1e-4, atol=1e-5)


def test_a_dora_file_exports_again_as_comfyui_and_never_as_diffsynth(tmp_path, trained_dora, capsys):
    source = tmp_path / "dora.safetensors"
    save_file(dora_file(trained_dora), str(source), metadata={**META, "lora_scale_folded": "true"})
    assert export_main([str(source), "--output", str(tmp_path / "again.safetensors")]) == 0
    again = load_file(str(tmp_path / "again.safetensors"))
    assert safe_open(str(tmp_path / "again.safetensors"), framework="pt").metadata()["lora_variant"] == "dora"
    dit = base_dit()
    assert comfyui_merge(dit, again) == set()
    torch.testing.assert_close(dit_output(dit), trained_dora["output"], rtol=1e-4, atol=1e-5)
    assert export_main([str(source), "--format", "diffsynth", "--output", str(tmp_path / "ds.safetensors")]) == 2
    assert "DiffSynth's LoRA loader reads no DoRA magnitude" in capsys.readouterr().err
    assert not (tmp_path / "ds.safetensors").exists()
    # peft's raw magnitudes cannot become a dora_scale without the base model: refused, naming the module.
    raw = tmp_path / "raw.safetensors"
    save_file(trained_dora["tensors"], str(raw), metadata=META)
    assert export_main([str(raw), "--output", str(tmp_path / "raw-out.safetensors")]) == 2
    assert "blocks.0.cross_attn.k: a DoRA magnitude (lora_magnitude_vector)" in capsys.readouterr().err


def test_a_lora_file_says_what_trained_it_and_export_carries_it(tmp_path, trained):
    """A LoRA file found later could not be judged without its run folder: its metadata said rank, alpha, targets,
    step and run only. It now says the sizes and stages, steps, epochs, samples, learning rate and the rest, in the
    kohya-style ss_* keys that LoRA browsers read, beside the project's own recipe and plan; export keeps them."""
    import json

    from diffsynth_mbc.training.lora.file_format import training_metadata
    from diffsynth_mbc.training.options import resolve_options
    from diffsynth_mbc.training.plan.step_plan import plan_from_options

    from e2e_helpers import REPO

    options = resolve_options(["--config", str(REPO / "configs" / "train_demo.yaml"), "--dataset_base_path",
                               str(tmp_path), "--height", "96", "--width", "96", "--resolution_stages", "64x64:0.5",
                               "--lora_alpha", str(ALPHA)])
    plan = plan_from_options(options, rows=11, images=5, world_size=2).as_dict()   # 6 steps an epoch, 2 epochs
    facts = training_metadata(options, plan, 9)
    assert {key: facts[key] for key in ("ss_network_dim", "ss_network_alpha", "ss_learning_rate", "ss_lr_scheduler",
                                        "ss_num_epochs", "ss_epoch", "ss_steps", "ss_max_train_steps",
                                        "ss_num_train_images", "ss_resolution", "ss_enable_bucket")} == {
        "ss_network_dim": "4", "ss_network_alpha": "12.0", "ss_learning_rate": "0.001", "ss_lr_scheduler": "cosine",
        "ss_num_epochs": "2", "ss_epoch": "2", "ss_steps": "9", "ss_max_train_steps": "12",
        "ss_num_train_images": "33", "ss_resolution": "(96, 96)", "ss_enable_bucket": "False"}
    assert json.loads(facts["ss_network_args"]) == {"target_modules": "q,k,v,o,ffn.0,ffn.2", "variant": "lora"}
    written_plan = json.loads(facts["plan"])
    assert (written_plan["rows"], written_plan["images"], written_plan["repeat"], written_plan["total_steps"]) == \
        (11, 5, 3, 12)
    assert written_plan["size"] == "96x96x9" and written_plan["stages"] == [
        {"size": "64x64x9", "from_step": 1, "to_step": 6}, {"size": "96x96x9", "from_step": 7, "to_step": 12}]
    assert json.loads(facts["recipe"])["lora"] == {"variant": "lora", "rank": 4, "alpha": ALPHA,
                                                   "target_modules": "q,k,v,o,ffn.0,ffn.2", "loraplus_lr_ratio": None,
                                                   "init_lora": None}
    source = tmp_path / "trained.safetensors"
    save_file(trained["tensors"], str(source), metadata={**META, **facts})
    export(source, "diffsynth", tmp_path / "ds.safetensors")
    exported = safe_open(str(tmp_path / "ds.safetensors"), framework="pt").metadata()
    assert {key: exported.get(key) for key in facts} == facts and exported["lora_layout"] == "diffsynth"
    export(source, "merged", tmp_path / "merged.safetensors", demo_seed=42)   # DiT weights: no LoRA network keys
    merged = safe_open(str(tmp_path / "merged.safetensors"), framework="pt").metadata()
    assert merged["plan"] == facts["plan"] and merged["recipe"] == facts["recipe"]
    assert not [key for key in merged if key.startswith("ss_")]
