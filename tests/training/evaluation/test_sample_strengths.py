"""--sample_strengths: the option, and which clips a sample step writes (the base model's once per prompt), with
the generation itself stood in for (tests/training/evaluation/test_sample_strengths_run.py runs it for real)."""

from __future__ import annotations

import contextlib
import json
from types import SimpleNamespace

import pytest
import torch
from accelerate.utils import DistributedType
from PIL import Image

from diffsynth_mbc.errors import OptionsError
from diffsynth_mbc.sample_prompts import load_sample_prompts
from diffsynth_mbc.training.evaluation.sample_clips import Sampler
from diffsynth_mbc.training.options import DECLARATIONS, load_preset, resolve_options

REQUIRED = ["--dataset_base_path", "data", "--dataset_metadata_path", "data/metadata.csv"]


def test_the_option_defaults_to_the_trained_strength_and_needs_sample_prompts(tmp_path):
    assert resolve_options(REQUIRED).sample_strengths == (1.0,)
    (tmp_path / "prompts.yaml").write_text("- a prompt\n")
    given = resolve_options(REQUIRED + ["--sample_prompts", str(tmp_path / "prompts.yaml"),
                                        "--sample-strengths", "0,0.5,1"])
    assert given.sample_strengths == (0.0, 0.5, 1.0) and given.sample_strengths.text == "0,0.5,1"   # parsed once
    with pytest.raises(OptionsError, match="--sample_strengths needs --sample_prompts"):
        resolve_options(REQUIRED + ["--sample_strengths", "0,1"])
    with pytest.raises(OptionsError, match="--sample_strengths must be comma-separated numbers"):
        resolve_options(REQUIRED + ["--sample_prompts", str(tmp_path / "prompts.yaml"), "--sample_strengths", "0;1"])
    preset = tmp_path / "p.yaml"
    preset.write_text("sample_strengths: 0.5\n")
    assert load_preset(preset) == {"sample_strengths": "0.5"}


class Status:
    def __init__(self):
        self.state, self.history = {}, []

    def update(self, **fields):
        self.state.update(fields)

    def append_history(self, record):
        self.history.append(record)


class Accelerator:
    device = torch.device("cpu")
    is_main_process, num_processes, trackers = True, 1, []
    distributed_type = DistributedType.NO   # one process: the module is not wrapped

    def autocast(self):
        return contextlib.nullcontext()


class Ema:
    updates = 3

    def __init__(self):
        self.inside = "raw"

    @contextlib.contextmanager
    def weights(self, which):
        self.inside = which
        yield
        self.inside = "raw"


def sampler(tmp_path, text, strengths, validate_with="raw"):
    (tmp_path / "prompts.yaml").write_text(text, encoding="utf-8")
    prompts = load_sample_prompts(tmp_path / "prompts.yaml", height=32, width=32, num_frames=1, seed=5)
    options = SimpleNamespace(sample_steps=2, sample_strengths=DECLARATIONS["sample_strengths"].typed(strengths),
                              output_path=str(tmp_path / "lora"),
                              validate_with=validate_with)
    made = Sampler(options, Status(), prompts)
    made.attach(Accelerator(), SimpleNamespace(pipe=SimpleNamespace(dit=torch.nn.Linear(2, 2), scheduler=[])))
    made.rendered = []

    def generate(pipe, prompt, step, index, label=""):
        made.rendered.append((step, index + 1, label.strip(" ()"), made.ema.inside if made.ema else "raw"))
        return [Image.new("RGB", (32, 32), (index * 40, 0, 0))]

    made._generate = generate
    return made


def names(folder):
    return sorted(p.name for p in folder.iterdir())


def test_each_prompt_at_each_strength_and_the_base_model_once(tmp_path):
    run = sampler(tmp_path, "- a news anchor\n- 도시 거리 밤\n", "0,0.5,1", validate_with="both")
    run.ema = Ema()
    run.run(0)
    run.run(2)
    samples = tmp_path / "lora" / "samples"
    assert names(samples) == ["base", "step-00000000", "step-00000002"]
    assert names(samples / "base") == ["01-a-news-anchor-base.mp4", "01-a-news-anchor-base.png",
                                       "02-도시-거리-밤-base.mp4", "02-도시-거리-밤-base.png", "prompts.json"]
    clips = [n for n in names(samples / "step-00000002") if n.endswith(".mp4")]
    assert clips == ["01-a-news-anchor-ema.mp4", "01-a-news-anchor-s0.5-ema.mp4", "01-a-news-anchor-s0.5.mp4",
                     "01-a-news-anchor.mp4", "02-도시-거리-밤-ema.mp4", "02-도시-거리-밤-s0.5-ema.mp4",
                     "02-도시-거리-밤-s0.5.mp4", "02-도시-거리-밤.mp4"]
    # the base model rendered once per prompt, at the first sample step; the EMA beside the raw weights
    assert [r for r in run.rendered if r[2] == "base model"] == [(0, 1, "base model", "raw"), (0, 2, "base model", "raw")]
    assert [r for r in run.rendered if r[0] == 2 and r[1] == 1] == [
        (2, 1, "strength 0.5", "raw"), (2, 1, "", "raw"), (2, 1, "strength 0.5, EMA", "ema"), (2, 1, "EMA", "ema")]
    base = json.loads((samples / "base" / "prompts.json").read_text(encoding="utf-8"))["prompts"]
    assert [(p["index"], p["stem"], p["step"], p["seed"]) for p in base] == [(1, "01-a-news-anchor", 0, 5),
                                                                           (2, "02-도시-거리-밤", 0, 6)]
    first, second = [r for r in run.status.history if r["kind"] == "samples"]
    assert first["base_files"] == ["01-a-news-anchor-base.mp4", "01-a-news-anchor-base.png",
                                   "02-도시-거리-밤-base.mp4", "02-도시-거리-밤-base.png"]
    assert second["base_files"] == [] and len(second["files"]) == 16 and second["strengths"] == [0.0, 0.5, 1.0]
    assert run.status.state["last_samples"]["base_dir"] == str(samples / "base")


def test_the_default_writes_the_clips_it_always_wrote_and_no_base(tmp_path):
    run = sampler(tmp_path, "- a news anchor\n", "1")
    run.run(0)
    samples = tmp_path / "lora" / "samples"
    assert names(samples) == ["step-00000000"]
    assert names(samples / "step-00000000") == ["01-a-news-anchor.mp4", "01-a-news-anchor.png", "prompts.json"]
    record = run.status.history[0]
    assert "base_files" not in record and record["files"] == ["01-a-news-anchor.mp4", "01-a-news-anchor.png"]


def test_a_resumed_run_renders_the_base_again_only_for_prompts_that_changed(tmp_path):
    run = sampler(tmp_path, "- a news anchor\n- a street\n", "0,1")
    run.run(0)
    base = tmp_path / "lora" / "samples" / "base"
    kept = (base / "01-a-news-anchor-base.mp4").stat().st_mtime_ns
    again = sampler(tmp_path, "- a news anchor\n- prompt: a street\n  seed: 9\n- a river\n", "0,1")
    again.run(4)
    assert [r[:2] for r in again.rendered if r[2] == "base model"] == [(4, 2), (4, 3)]   # new seed, new prompt
    assert (base / "01-a-news-anchor-base.mp4").stat().st_mtime_ns == kept
    records = json.loads((base / "prompts.json").read_text())["prompts"]
    assert [(p["index"], p["step"]) for p in records] == [(1, 0), (2, 4), (3, 4)]
    third = sampler(tmp_path, "- a river\n", "0,1")   # another prompt file: the old base clips go
    third.run(6)
    assert names(base) == ["01-a-river-base.mp4", "01-a-river-base.png", "prompts.json"]
