"""--init_lora: a new run starts from a LoRA file of any layout we read (ours, ComfyUI, DiffSynth), at the strength
the file was trained with, with a fresh optimizer at step 0; mismatches are refused naming keys and flags."""

from __future__ import annotations


import pytest
import torch
from safetensors.torch import load_file, save_file

from diffsynth_mbc.data.cache.dataset import CachedLatentDataset
from diffsynth_mbc.data.dataset import MBCVideoDataset
from diffsynth_mbc.data.demo import prepare
from diffsynth_mbc.errors import OptionsError
from diffsynth_mbc.models.pipeline import build_demo_pipeline
from diffsynth_mbc.training.lora.file_format import COMFYUI_PREFIX, convert, file_metadata, lora_pairs, training_scale
from diffsynth_mbc.training.lora.init_from_file import InitLoraError, load_init_lora, start_from_lora, starting_pairs
from diffsynth_mbc.training.lora.module import WanTI2VLoraModule
from diffsynth_mbc.training.options import resolve_options
from e2e_helpers import REPO, build_demo_cache, read_history, read_status
from forked_ranks import run_training

SEED = 42
RANK, ALPHA = 4, 12.0     # alpha != rank: trained at scale 3, so a wrong unfolding shows
TARGETS = "q,k,v,o,ffn.0,ffn.2"
REQUIRED = ["--dataset_base_path", "data", "--dataset_metadata_path", "data/metadata.csv"]


# ---------------------------------------------------------------------------------------------
# options (no torch needed)


def test_the_default_is_no_init_lora():
    assert resolve_options(REQUIRED).init_lora is None


def test_a_resume_with_init_lora_continues_its_checkpoint_and_says_the_file_is_not_applied(tmp_path, capsys):
    """The printed resume command of a preset with init_lora used to fail: "--init_lora and --resume do not go
    together". A resume continues its checkpoint; the file (not even read) is named as not applied, once."""
    options = resolve_options(REQUIRED + ["--init_lora", str(tmp_path / "gone.safetensors"), "--resume", "latest"])
    assert start_from_lora(None, options) is None
    said = capsys.readouterr().err
    assert said.count("is not applied") == 1 and "--resume latest continues its checkpoint" in said


def test_a_missing_init_lora_is_named(tmp_path):
    with pytest.raises(OptionsError, match=r"--init_lora .*nothere\.safetensors: no such file"):
        resolve_options(REQUIRED + ["--init_lora", str(tmp_path / "nothere.safetensors")])


def test_an_init_lora_this_run_would_overwrite_is_refused(tmp_path):
    (tmp_path / "out").mkdir()
    lora = tmp_path / "out" / "lora.safetensors"
    lora.write_bytes(b"x")
    with pytest.raises(OptionsError, match="--output_path"):
        resolve_options(REQUIRED + ["--init_lora", str(lora), "--output_path", str(tmp_path / "out")])
    assert resolve_options(REQUIRED + ["--init_lora", str(lora), "--output_path", str(tmp_path / "next")]).init_lora


def test_a_preset_takes_init_lora(tmp_path):
    lora = tmp_path / "a.safetensors"
    lora.write_bytes(b"x")
    preset = tmp_path / "p.yaml"
    preset.write_text(f"dataset_base_path: a\ndataset_metadata_path: b.csv\ninit_lora: {lora}\n")
    assert resolve_options(["--config", str(preset)]).init_lora == str(lora)


# ---------------------------------------------------------------------------------------------
# the checks, on small tensors


def small_lora(modules=("blocks.0.self_attn.q", "blocks.0.ffn.0"), rank=RANK) -> dict:
    generator = torch.Generator().manual_seed(1)
    return {key: torch.randn(shape, generator=generator) for module in modules
            for key, shape in ((f"{module}.lora_A.weight", (rank, 8)), (f"{module}.lora_B.weight", (8, rank)))}


def expected_for(modules=("blocks.0.self_attn.q", "blocks.0.ffn.0"), rank=RANK):
    return {module: {"A": (rank, 8), "B": (8, rank)} for module in modules}


def check(tensors, facts=None, **overrides):
    settings = {"expected": expected_for(), "rank": RANK, "alpha": ALPHA, "targets": TARGETS, "source": "f"}
    return starting_pairs(tensors, facts or {}, **{**settings, **overrides})


def test_a_file_of_another_rank_names_the_key_and_lora_rank():
    with pytest.raises(InitLoraError, match=r"rank 8 \(blocks\.0\.\S+\.lora_A: \(8, 8\)\).*--lora_rank 8"):
        check(small_lora(rank=8))


def test_a_file_of_another_alpha_names_lora_alpha():
    facts = {"lora_scale_folded": "true", "lora_alpha": "4", "lora_rank": "4"}
    with pytest.raises(InitLoraError, match=r"alpha 4.*--lora_alpha is 12: set --lora_alpha 4"):
        check(small_lora(), facts)
    with_alpha = {**small_lora(), "blocks.0.self_attn.q.alpha": torch.tensor(8.0),
                  "blocks.0.ffn.0.alpha": torch.tensor(8.0)}
    with pytest.raises(InitLoraError, match="set --lora_alpha 8"):
        check(with_alpha)


def test_other_targets_name_the_first_modules_and_the_flag():
    with pytest.raises(InitLoraError, match=r"no weights for 1 of this run's modules \(blocks\.0\.ffn\.0\).*"
                                            r"set --lora_target_modules self_attn\.q"):
        check(small_lora(modules=("blocks.0.self_attn.q",)))
    extra = ("blocks.0.self_attn.q", "blocks.0.ffn.0", "blocks.0.cross_attn.k")
    with pytest.raises(InitLoraError, match=r"modules this run does not train \(blocks\.0\.cross_attn\.k\).*"
                                            r"--lora_target_modules is q,v: set --lora_target_modules q,k,v"):
        check(small_lora(modules=extra), {"lora_target_modules": "q,k,v"}, targets="q,v")


def test_a_file_for_another_model_is_refused():
    with pytest.raises(InitLoraError, match="another model"):
        check(small_lora(), expected={module: {"A": (RANK, 16), "B": (16, RANK)}
                                      for module in ("blocks.0.self_attn.q", "blocks.0.ffn.0")})


def test_a_dora_file_is_refused_rather_than_started_without_its_magnitudes():
    tensors = {**small_lora(), "diffusion_model.blocks.0.ffn.0.dora_scale": torch.ones(8, 1)}
    with pytest.raises(InitLoraError, match=r"it is a DoRA \(diffusion_model\.blocks\.0\.ffn\.0\.dora_scale.*--resume"):
        check(tensors)


def test_a_nonfinite_file_is_refused():
    tensors = small_lora()
    tensors["blocks.0.ffn.0.lora_B.weight"][0, 0] = float("nan")
    with pytest.raises(InitLoraError, match=r"blocks\.0\.ffn\.0\.lora_B\.weight \(1 NaN"):
        check(tensors)


@pytest.mark.parametrize("facts,alpha_keys,factor", [
    ({"lora_scale_folded": "true", "lora_alpha": "12"}, False, RANK / ALPHA),   # ours: folded, unfold alpha/rank
    ({}, False, RANK / ALPHA),                                                  # no alpha: loaded at scale 1
    ({}, True, 1.0),                                                            # per-module .alpha: raw B
    ({"lora_alpha": "12", "lora_rank": "4"}, False, 1.0),                       # our raw tensors with metadata
])
def test_lora_b_is_unfolded_to_what_training_applies(facts, alpha_keys, factor):
    tensors = small_lora()
    if alpha_keys:
        tensors.update({f"{m}.alpha": torch.tensor(ALPHA) for m in ("blocks.0.self_attn.q", "blocks.0.ffn.0")})
    start, found = check(tensors, facts)
    assert found["b_factor"] == pytest.approx(factor)
    assert start["blocks.0.ffn.0"]["B"] is tensors["blocks.0.ffn.0.lora_B.weight"]


# ---------------------------------------------------------------------------------------------
# the tiny model: train a few steps, write every layout, start a new LoRA from each


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("init_lora")
    metadata = prepare(root, num_videos=1, num_images=1)
    cache_dir = root / "cache"
    build_demo_cache(root, metadata, cache_dir, seed=SEED)
    media = MBCVideoDataset(str(root / "catalog"), str(metadata), num_frames=9, height=64, width=64)
    cached = CachedLatentDataset(cache_dir)
    return [(media[cached[i]["row"] - 1], cached[i]) for i in range(cached.rows)]


def make_module(load_encoders=False, init_seed=0) -> WanTI2VLoraModule:
    pipe = build_demo_pipeline(device="cpu", torch_dtype=torch.float32, seed=SEED, load_encoders=load_encoders)
    torch.manual_seed(init_seed)   # the LoRA's own random init (A; B starts at zero)
    return WanTI2VLoraModule(pipe, lora_rank=RANK, lora_alpha=ALPHA, use_gradient_checkpointing=False)


@pytest.fixture(scope="module")
def trained(data):
    """Three AdamW steps from the cache; the LoRA as training holds it."""
    module = make_module()
    optimizer = torch.optim.AdamW([p for p in module.parameters() if p.requires_grad], lr=1e-2)
    for step in range(3):
        torch.manual_seed(300 + step)
        module([entry for _, entry in data[:2]]).backward()
        optimizer.step()
        optimizer.zero_grad()
    tensors = {k: v.detach().clone() for k, v in module.lora_state_dict().items()}
    assert all(v.abs().max() > 0 for k, v in tensors.items() if "lora_B" in k)   # B moved away from zero
    return module, tensors


def layouts(tensors: dict) -> dict:
    """What each kind of file holds for the same trained LoRA: {name: (tensors, metadata)}."""
    scale = training_scale(RANK, ALPHA)
    ours = {layout: (convert(tensors, layout, scale=scale),
                     file_metadata(rank=RANK, alpha=ALPHA, targets=TARGETS, base_model="demo", step=3, run_id="r",
                                   layout=layout)) for layout in ("comfyui", "diffsynth")}
    pairs, _ = lora_pairs(tensors)
    kohya = {}
    for module, pair in pairs.items():   # ComfyUI/kohya names, raw B, per-module alpha
        kohya[f"{COMFYUI_PREFIX}{module}.lora_down.weight"] = pair["A"]
        kohya[f"{COMFYUI_PREFIX}{module}.lora_up.weight"] = pair["B"]
        kohya[f"{COMFYUI_PREFIX}{module}.alpha"] = torch.tensor(ALPHA)
    # DiffSynth's own trainer: PEFT keys, no metadata; its loader merges B @ A at scale 1.
    diffsynth_own = {key: (value * scale if "lora_B" in key else value) for key, value in tensors.items()}
    return {"ours-comfyui": ours["comfyui"], "ours-diffsynth": ours["diffsynth"],
            "comfyui-exported-elsewhere": (ours["comfyui"][0], None), "comfyui-kohya-alpha": (kohya, None),
            "diffsynth-own": (diffsynth_own, None),
            "ours-raw-older": (tensors, {"lora_rank": str(RANK), "lora_alpha": str(ALPHA)})}


@pytest.mark.parametrize("layout", ["ours-comfyui", "ours-diffsynth", "comfyui-exported-elsewhere",
                                    "comfyui-kohya-alpha", "diffsynth-own", "ours-raw-older"])
def test_a_new_lora_starts_where_the_file_left_off(tmp_path, data, trained, layout):
    original, tensors = trained
    file_tensors, metadata = layouts(tensors)[layout]
    path = tmp_path / f"{layout}.safetensors"
    save_file({k: v.contiguous() for k, v in file_tensors.items()}, str(path), metadata=metadata)
    module = make_module(init_seed=1)   # another random A: the file must replace it
    found = load_init_lora(module, path)
    assert found["modules"] == len(tensors) // 2 and found["rank"] == RANK
    started = module.lora_state_dict()
    assert started.keys() == tensors.keys()
    for key in tensors:
        assert started[key].dtype == torch.float32
        torch.testing.assert_close(started[key], tensors[key], rtol=1e-6, atol=1e-7, msg=key)
    entry = data[0][1]   # the first loss is the trained model's on the same sample, noise and timestep
    torch.manual_seed(500)
    expected = original.sample_loss(dict(entry))
    torch.manual_seed(500)
    torch.testing.assert_close(module.sample_loss(dict(entry)), expected, rtol=1e-6, atol=1e-7)


def test_uncached_training_starts_from_the_file_too(tmp_path, data, trained):
    original, tensors = trained
    path = tmp_path / "lora.safetensors"
    file_tensors, metadata = layouts(tensors)["ours-comfyui"]
    save_file(file_tensors, str(path), metadata=metadata)
    encoding = make_module(load_encoders=True, init_seed=1)
    load_init_lora(encoding, path)
    clip, entry = data[0]   # the media through the VAE and text encoder vs the trained model on its cache entry
    torch.manual_seed(600)
    expected = original.sample_loss(dict(entry))
    torch.manual_seed(600)
    torch.testing.assert_close(encoding.sample_loss(clip), expected, rtol=1e-5, atol=1e-6)


def test_a_mismatched_file_leaves_the_module_as_it_was(tmp_path, trained):
    _, tensors = trained
    path = tmp_path / "lora.safetensors"
    save_file(convert(tensors, "comfyui", scale=training_scale(RANK, ALPHA)), str(path),
              metadata=file_metadata(rank=RANK, alpha=ALPHA, targets=TARGETS, base_model="demo", step=3, run_id="r",
                                     layout="comfyui"))
    pipe = build_demo_pipeline(device="cpu", torch_dtype=torch.float32, seed=SEED, load_encoders=False)
    module = WanTI2VLoraModule(pipe, lora_rank=RANK, lora_alpha=ALPHA, lora_target_modules="q,k,v,o",
                               use_gradient_checkpointing=False)
    before = {k: v.clone() for k, v in module.lora_state_dict().items()}
    with pytest.raises(InitLoraError, match=r"modules this run does not train \(blocks\.0\.ffn\.0, blocks\.0\.ffn\.2, "
                                            r"blocks\.1\.ffn\.0, and 1 more\).*set --lora_target_modules "
                                            r"q,k,v,o,ffn\.0,ffn\.2"):
        load_init_lora(module, path)
    assert all(torch.equal(v, before[k]) for k, v in module.lora_state_dict().items())


# ---------------------------------------------------------------------------------------------
# the real run: 2 CPU ranks (DDP over gloo, and DeepSpeed ZeRO-2, which copies the weights when it wraps them)


@pytest.mark.slow
@pytest.mark.parametrize("config_file", [None, str(REPO / "configs" / "accelerate" / "deepspeed_zero2.yaml")],
                         ids=["ddp", "zero2"])
def test_a_two_rank_run_starts_from_the_file(tmp_path, config_file):
    root = tmp_path / "demo"
    prepare(root, num_videos=3, num_images=2)
    module = WanTI2VLoraModule(build_demo_pipeline(load_encoders=False, seed=SEED), lora_rank=4,
                               use_gradient_checkpointing=False)
    generator = torch.Generator().manual_seed(3)
    lora = {}
    for module_name, pair in lora_pairs(module.lora_state_dict())[0].items():   # kohya/ComfyUI names, .alpha
        lora[f"{COMFYUI_PREFIX}{module_name}.lora_down.weight"] = pair["A"].detach().clone()
        lora[f"{COMFYUI_PREFIX}{module_name}.lora_up.weight"] = torch.randn(pair["B"].shape, generator=generator) * 0.05
        lora[f"{COMFYUI_PREFIX}{module_name}.alpha"] = torch.tensor(4.0)
    source = tmp_path / "from_elsewhere.safetensors"
    save_file(lora, str(source))
    flags = {"config": REPO / "configs" / "train_demo.yaml", "dataset_base_path": root / "catalog",
             "dataset_metadata_path": root / "metadata" / "metadata.csv", "output_path": root / "lora",
             "log_dir": root / "logs", "num_epochs": 1, "save_steps": 1, "init_lora": source, "checkpoint_steps": 100}
    arguments = [item for key, value in flags.items() for item in (f"--{key}", str(value))]
    result = run_training(tmp_path, arguments, timeout=300, config_file=config_file, OMP_NUM_THREADS=1)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    for rank in (0, 1):
        state = read_status(root / "logs", rank)
        assert state["status"] == "finished" and state["init_lora"]["file"] == str(source)
        assert state["init_lora"]["layout"] == "ComfyUI/kohya layout with per-module alpha"
        assert read_history(root / "logs", rank)[0]["step"] == 1
    # After one optimizer step (AdamW moves each weight by at most about the learning rate, 1e-3 / 3 in warm-up)
    # the LoRA is the file's: a LoRA started from zero B would differ by ~0.05.
    expected = convert(lora, "comfyui")
    after_one = load_file(str(root / "lora" / "step-1.safetensors"))
    assert after_one.keys() == expected.keys()
    for key in expected:
        assert (after_one[key] - expected[key]).abs().max() < 1e-3, key
    assert source.read_bytes() and load_file(str(source)).keys() == lora.keys()   # the input is untouched
    # The resume command a stopped run prints carries the preset's --init_lora: it resumes, the file not applied. (A
    # resume of a run that ended trains nothing and loads nothing: this one is cut before its last LoRA file.)
    (root / "lora" / "lora.safetensors").unlink()
    resumed = run_training(tmp_path, arguments + ["--resume", "latest"], timeout=300, config_file=config_file,
                           OMP_NUM_THREADS=1)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert resumed.stderr.count(f"--init_lora {source} is not applied") == 1


@pytest.mark.parametrize("dtype", [torch.int8, torch.int32, torch.uint8, torch.bool])
def test_a_file_of_integer_tensors_is_refused_naming_the_dtype(tmp_path, dtype):
    """A LoRA cast to int8 (a quantiser's output, a wrong save) holds rounded weights, B mostly 0: refused, not
    started from; the module keeps its weights."""
    module = make_module()
    generator = torch.Generator().manual_seed(4)
    tensors = {key: (torch.randn(value.shape, generator=generator) * 0.05).to(dtype)
               for key, value in module.lora_state_dict().items()}
    path = tmp_path / "int.safetensors"
    save_file(convert(tensors, "comfyui"), str(path),
              metadata=file_metadata(rank=RANK, alpha=ALPHA, targets=TARGETS, base_model="demo", step=3, run_id="r",
                                     layout="comfyui"))
    before = {k: v.clone() for k, v in module.lora_state_dict().items()}
    name = str(dtype).replace("torch.", "")
    with pytest.raises(InitLoraError, match=rf"--init_lora {path}: module 'blocks\.0\.cross_attn\.k': lora_A holds "
                                            rf"{name} values; a LoRA's weights are floating point"):
        load_init_lora(module, path)
    assert all(torch.equal(v, before[k]) for k, v in module.lora_state_dict().items())
