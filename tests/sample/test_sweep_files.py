"""Which files a sweep renders, where their clips go and what a clip is made of, on files whose headers say what a
run's say: pure rules, no model (the sweep's runs on trained files are in test_sweep.py)."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save_file

from diffsynth_mbc.sample.lora_files import sweep_files
from diffsynth_mbc.sample.sheet import column_head
from diffsynth_mbc.sample.sweep_plan import best_file, plan_clips
from diffsynth_mbc.sample_prompts import SamplePrompt
from diffsynth_mbc.training.options.run_options import TrainOptions
from diffsynth_mbc.training.options.run_record import write_run_options

PROMPTS = [SamplePrompt("a news anchor", seed=1, height=64, width=64, num_frames=9),
           SamplePrompt("a street", seed=2, height=64, width=64, num_frames=9)]
DEMO = {"model": {"demo_seed": 42}, "precision": "no", "device": "cpu"}


def a_lora_file(path: Path, step: int | None, run_id: str = "run-1", fill: float = 0.0) -> Path:
    """A file with a LoRA file's header (step, run id, base model) and one pair of tensors."""
    path.parent.mkdir(parents=True, exist_ok=True)
    metadata = {"run_id": run_id, "base_model": "Wan2.2-TI2V-5B (demo)", **({"step": str(step)} if step else {})}
    save_file({"blocks.0.self_attn.q.lora_A.weight": np.full((4, 64), fill, np.float32),
               "blocks.0.self_attn.q.lora_B.weight": np.zeros((64, 4), np.float32)}, str(path), metadata=metadata)
    return path


def a_run(folder: Path, run_id: str) -> Path:
    """A run's output folder as the training leaves it: run_options.json, lora.safetensors and an epoch file of
    step 6 (one step's weights), a step file of step 2."""
    write_run_options(TrainOptions(output_path=str(folder), height=64, width=64, num_frames=9))
    for name, step in (("lora", 6), ("epoch-001", 6), ("step-2", 2)):
        a_lora_file(folder / f"{name}.safetensors", step, run_id)
    return folder


def test_two_runs_in_one_sweep_keep_their_files_apart_each_named_by_its_run(tmp_path):
    """Both runs write lora.safetensors and epoch-001 (even under one --run_id): each keeps its own folder and
    column; before, both were "lora" and one run's clips were listed under the other's."""
    first, second = a_run(tmp_path / "runa" / "lora", "mbc"), a_run(tmp_path / "runb" / "lora", "mbc")
    files = sweep_files([str(first), str(second)])
    assert [(item.key, item.step) for item in files] == [
        ("runa-lora/step-00000002", 2), ("runb-lora/step-00000002", 2), ("runa-lora/lora", 6), ("runb-lora/lora", 6)]
    assert [(item.key, item.run, item.step) for item in files] == [
        ("runa-lora/step-00000002", "runa/lora", 2), ("runb-lora/step-00000002", "runb/lora", 2),
        ("runa-lora/lora", "runa/lora", 6), ("runb-lora/lora", "runb/lora", 6)]
    from diffsynth_mbc.sample.lora_files import with_digests

    clips = plan_clips(PROMPTS, with_digests(files), [0, 1], DEMO)
    assert len({clip.path for clip in clips}) == len(clips) == 2 + 4 * 2
    assert [item.run for item in sweep_files([str(first)])] == [None, None]   # one run: no run names, same folders
    assert [item.key for item in sweep_files([str(first)])] == ["step-00000002", "lora"]


def test_a_file_named_like_a_path_or_like_the_sweeps_own_files_writes_inside_the_output(tmp_path):
    names = ["...safetensors", "base.safetensors", "sweep.json.safetensors", ".hidden.safetensors",
             "a b?.safetensors"]
    files = sweep_files([str(a_lora_file(tmp_path / "files" / name, None)) for name in names])
    assert [item.key for item in files] == ["file", "base-2", "sweep.json-2", "hidden", "a-b"]
    from diffsynth_mbc.sample.lora_files import with_digests
    from diffsynth_mbc.sample.sweep_plan import inside_output

    output = tmp_path / "files" / "out"
    for clip in plan_clips(PROMPTS, with_digests(files), [0, 0.5, 1], DEMO):
        assert (output / clip.path).resolve().is_relative_to(output.resolve()), clip.path
    with pytest.raises(ValueError, match="x.safetensors: its clips would be written to '../01-a', outside"):
        inside_output("../01-a", "x.safetensors")


def test_a_clip_is_made_of_the_files_bytes_and_the_model_not_of_its_path(tmp_path):
    from diffsynth_mbc.sample.lora_files import with_digests

    path = a_lora_file(tmp_path / "lora.safetensors", 6)
    before = plan_clips(PROMPTS, with_digests(sweep_files([str(path)])), [0, 1], DEMO)
    a_lora_file(path, 6, fill=0.5)   # rewritten at the same path (a resume, --start_over)
    after = plan_clips(PROMPTS, with_digests(sweep_files([str(path)])), [0, 1], DEMO)
    assert [a.path for a in after] == [b.path for b in before]
    assert [a.settings == b.settings for a, b in zip(after, before)] == [True, True, False, False]   # base kept
    for other in ({**DEMO, "model": {"demo_seed": 7}}, {**DEMO, "precision": "bf16"}, {**DEMO, "device": "cuda"},
                  {**DEMO, "model": {"model_dir": "/models/a", "model_id": None}}):
        moved = plan_clips(PROMPTS, with_digests(sweep_files([str(path)])), [0, 1], other)
        assert all(a.settings != b.settings for a, b in zip(moved, after)), other


def test_a_first_frame_rewritten_at_the_same_path_renders_again(tmp_path):
    from PIL import Image

    image = tmp_path / "first.png"
    Image.new("RGB", (8, 8), (200, 0, 0)).save(image)
    prompts = [SamplePrompt("a street", seed=2, height=64, width=64, num_frames=9, image=str(image))]
    before = plan_clips(prompts, [], [0], DEMO)[0].settings
    Image.new("RGB", (8, 8), (0, 200, 0)).save(image)
    assert plan_clips(prompts, [], [0], DEMO)[0].settings != before


def test_a_nan_validation_is_never_the_best_file():
    files = [{"key": f"step-{step}", "label": f"step-{step}", "path": f"step-{step}.safetensors", "step": step,
              "val_loss": loss} for step, loss in ((2, math.nan), (4, 1.5), (6, 1.2), (8, math.inf))]
    best = best_file(files, 1.6)
    assert best["key"] == "step-6" and best["gain"] == pytest.approx(0.25)
    assert best_file(files[:1], 1.6) is None
    assert best_file(files, math.nan)["gain"] is None


def test_the_gain_reads_as_the_dashboard_says_it_and_other_strengths_say_they_are_not_validated():
    item = {"key": "lora", "label": "lora", "path": "/r/lora.safetensors", "step": 6, "val_loss": 1.4001,
            "run": "runa/lora"}
    head = column_head({"file": item, "strength": 1.0, "base_val_loss": 1.6648}, None)
    assert "val_loss 1.4001 (15.90% below the base)" in head and "vs the base" not in head and "runa/lora" in head
    worse = column_head({"file": {**item, "val_loss": 1.7}, "strength": 1.0, "base_val_loss": 1.6648}, None)
    assert "(2.11% above the base)" in worse
    half = column_head({"file": item, "strength": 0.5, "base_val_loss": 1.6648}, None)
    assert "val_loss" not in half and "not validated" in half   # no strength-1 figure repeated as if measured


def test_the_summary_names_the_best_file_its_gain_the_runs_and_what_judged_them():
    from diffsynth_mbc.sample.sheet import summary_lines
    from diffsynth_mbc.sample.sweep_plan import judging_notes

    files = [{"key": "runa-lora/lora", "label": "lora", "path": "/r/a/lora.safetensors", "step": 140,
              "val_loss": 1.4001, "run": "runa/lora", "run_dir": "/r/a"},
             {"key": "runb-lora/step-00000056", "label": "step-56", "path": "/r/b/step-56.safetensors", "step": 56,
              "val_loss": 1.6063, "run": "runb/lora", "run_dir": "/r/b"}]
    best = best_file(files, 1.6648)
    used = {"val_metadata_path": "/v/metadata_val.csv", "val_base_path": "/v", "val_cache": None, "val_samples": 16,
            "val_timestep_quantiles": "0.5", "seed": 42, "height": 64, "width": 64, "num_frames": 9, "buckets": "on"}

    class File:
        def __init__(self, run_dir, run):
            self.run_dir, self.run = run_dir, run

    notes = judging_notes(used, {"/r/a": used, "/r/b": {**used, "height": 96, "width": 128}},
                          [File("/r/a", "runa/lora"), File("/r/b", "runb/lora")])
    assert notes == ["validation at 64x64x9: 16 samples of /v/metadata_val.csv, timestep quantiles 0.5, seed 42",
                     "runb/lora: its own validation is at height 96, width 128; its figures here are measured at the "
                     "settings above, not its run's"]
    lines = summary_lines(best, files, notes, [0, 0.5, 1], validated=True)
    assert lines == ["best: lora of runa/lora (step 140): val_loss 1.4001, 15.90% below the base (1.6648); "
                     "/r/a/lora.safetensors", "runs: runa/lora, runb/lora", *notes,
                     "only strength 1 is validated: the 0.5 columns show clips, not figures"]
