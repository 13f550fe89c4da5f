"""Real 2-rank CPU runs with --sample_strengths 0,0.5,1 and --validate_with both: one clip per prompt, strength and
weights at every sample step, the base model's once per prompt, what the monitor lists, and training unchanged."""

from __future__ import annotations

import json

import numpy as np
import pytest

from clip_frames import clip_frames
from diffsynth_mbc.data.demo import prepare
from diffsynth_mbc.monitor.samples import list_base, list_sets
from e2e_helpers import assert_trained_alike, demo_flags, read_history, read_status
from forked_ranks import run_training

pytestmark = pytest.mark.slow
PROMPTS = """\
- prompt: a news anchor in the studio
  steps: 2
- prompt: 도시 거리 밤
  height: 32
  width: 64
  num_frames: 5
  steps: 2
  seed: 9
"""
STEMS = ["01-a-news-anchor-in-the-studio", "02-도시-거리-밤"]
STEPS = [0, 2, 4, 5]   # 5 optimizer steps: the baseline, every 2, the end


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("strengths")
    prepare(root / "demo", num_videos=3, num_images=2)
    (root / "prompts.yaml").write_text(PROMPTS, encoding="utf-8")
    plan = {"gradient_accumulation_steps": 1, "num_epochs": 1, "dataset_repeat": 2, "image_batch_size": 1,
            "ema_decay": 0.9}
    out = {}
    for name, extra in (("sweep", {"sample_prompts": root / "prompts.yaml", "sample_steps": 2,
                                   "sample_strengths": "0,0.5,1", "validate_with": "both"}),
                        ("without", {})):
        result = run_training(root, demo_flags(root / "demo", root / name, **plan, **extra), timeout=600,
                              OMP_NUM_THREADS=1)
        assert result.returncode == 0, result.stderr[-4000:]
        out[name] = root / name
    return out


def frames(path):
    return clip_frames(path).astype(int)


def test_each_prompt_at_each_strength_and_weights_at_every_sample_step(runs):
    samples = runs["sweep"] / "lora" / "samples"
    assert sorted(p.name for p in samples.iterdir()) == ["base"] + [f"step-{s:08d}" for s in STEPS]
    for step in STEPS:
        # the EMA once it has been updated (not before the first step): beside the raw weights at each strength
        suffixes = ["", "-s0.5"] + (["-ema", "-s0.5-ema"] if step else [])
        expected = sorted(f"{stem}{suffix}.{kind}" for stem in STEMS for suffix in suffixes for kind in ("mp4", "png"))
        folder = samples / f"step-{step:08d}"
        assert sorted(p.name for p in folder.iterdir()) == sorted(expected + ["prompts.json"]), step
        for suffix in suffixes:
            assert frames(folder / f"{STEMS[0]}{suffix}.mp4").shape == (9, 64, 64, 3)
            assert frames(folder / f"{STEMS[1]}{suffix}.mp4").shape == (5, 32, 64, 3)
    # the base model once per prompt, at the first sample step, never again
    assert sorted(p.name for p in (samples / "base").iterdir()) == sorted(
        [f"{stem}-base.{kind}" for stem in STEMS for kind in ("mp4", "png")] + ["prompts.json"])
    kept = json.loads((samples / "base" / "prompts.json").read_text(encoding="utf-8"))["prompts"]
    assert [(p["index"], p["stem"], p["step"]) for p in kept] == [(1, STEMS[0], 0), (2, STEMS[1], 0)]
    records = [r for r in read_history(runs["sweep"] / "logs", 0) if r.get("kind") == "samples"]
    assert [r["step"] for r in records] == STEPS
    assert [len(r["base_files"]) for r in records] == [4, 0, 0, 0]
    assert [len(r["files"]) for r in records] == [8, 16, 16, 16]
    assert read_status(runs["sweep"] / "logs", 0)["last_samples"]["step"] == 5


def test_the_same_seed_at_every_strength_and_each_strength_its_own_clip(runs):
    """Before the first step the LoRA adds nothing (its B matrices are zero): every strength renders the base
    model's clip, frame for frame. Trained, each strength renders a clip of its own."""
    samples = runs["sweep"] / "lora" / "samples"
    for stem in STEMS:
        base = frames(samples / "base" / f"{stem}-base.mp4")
        for suffix in ("", "-s0.5"):
            assert np.array_equal(frames(samples / "step-00000000" / f"{stem}{suffix}.mp4"), base), (stem, suffix)
        half, full = (frames(samples / "step-00000005" / f"{stem}{suffix}.mp4") for suffix in ("-s0.5", ""))
        assert not np.array_equal(half, base) and not np.array_equal(full, base) and not np.array_equal(half, full)


def test_the_monitor_lists_every_clip_with_its_strength_and_weights(runs):
    samples = runs["sweep"] / "lora" / "samples"
    sets = list_sets(samples)
    assert [s["step"] for s in sets] == STEPS
    kinds = [(c["index"], c["strength"], c["weights"]) for c in sets[-1]["clips"]]
    assert kinds == [(index, strength, weights) for index in (1, 2) for strength in (0.5, 1.0)
                     for weights in ("raw", "ema")]
    assert all(c["step"] == 5 and c["video"] and c["still"] for c in sets[-1]["clips"])
    assert [(c["index"], c["strength"], c["weights"], c["step"], c["prompt"]) for c in list_base(samples)] == [
        (1, 0.0, None, 0, "a news anchor in the studio"), (2, 0.0, None, 0, "도시 거리 밤")]


def test_sampling_at_other_strengths_leaves_training_unchanged(runs):
    assert_trained_alike(runs["sweep"], runs["without"])
