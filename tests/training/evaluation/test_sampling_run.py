"""Real 2-rank CPU runs with --sample_prompts: decodable clips of the asked size at the expected steps, and
training unchanged by sampling."""

from __future__ import annotations

import json
import time

import pytest
from PIL import Image

from clip_frames import clip_frames
from diffsynth_mbc.data.cache.cli import main as cache_main
from diffsynth_mbc.data.demo import prepare
from e2e_helpers import (REPO, assert_the_monitor_reads_what_the_ranks_wrote, assert_trained_alike, read_history,
                         read_status, run_main)
from forked_ranks import start_training

pytestmark = pytest.mark.slow
PROMPTS = """\
- prompt: a news anchor in the studio
  steps: 150                       # long enough (seconds) to outlast the watcher's stall threshold
- prompt: 도시 거리 밤
  image: first.png
  height: 32
  width: 64
  num_frames: 5
  steps: 2
  seed: 9
"""


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("sampling")
    prepare(root / "demo", num_videos=3, num_images=2)
    Image.new("RGB", (64, 32), (200, 40, 40)).save(root / "first.png")
    (root / "prompts.yaml").write_text(PROMPTS)
    out = {}
    cache = root / "cache"
    built = run_main(cache_main, ["--demo", "--dataset_base_path", root / "demo" / "catalog", "--dataset_metadata_path",
                                  root / "demo" / "metadata" / "metadata.csv", "--height", "64", "--width", "64",
                                  "--num_frames", "9", "--cache_dir", cache, "--dataset_num_workers", "0",
                                  "--sample_prompts", root / "prompts.yaml"], root)
    assert built.returncode == 0, built.stderr[-3000:]
    assert "sample prompts: 3 text(s) encoded" in built.stderr   # two prompts and the empty negative prompt
    for name, extra in (("with", ["--sample_prompts", str(root / "prompts.yaml"), "--sample_steps", "2",
                                  "--report_to", "tensorboard"]),
                        ("without", []),
                        ("cached", ["--sample_prompts", str(root / "prompts.yaml"), "--cache", str(cache)])):
        base = root / name
        flags = ["--config", str(REPO / "configs" / "train_demo.yaml"),
                                     "--dataset_base_path", str(root / "demo" / "catalog"),
                                     "--dataset_metadata_path", str(root / "demo" / "metadata" / "metadata.csv"),
                                     "--output_path", str(base / "lora"), "--log_dir", str(base / "logs"),
                                     "--gradient_accumulation_steps", "1", "--num_epochs", "1",
                                 # 5 steps per rank: the plan these checks are written for
                                 "--dataset_repeat", "2", "--image_batch_size", "1", *extra]
        process = start_training(root, flags, OMP_NUM_THREADS=1)
        out[f"{name}-seen"] = watch(base / "logs", process) if name == "with" else []
        _, stderr = process.communicate(timeout=400)
        assert process.returncode == 0, stderr[-4000:]
        out[name] = base
    return out


def watch(log_dir, process) -> list[tuple]:
    """What a monitor with a 2 s stall threshold sees while the run goes: (rank, phase, stalled) per look."""
    from diffsynth_mbc.monitor.state import MonitorState

    state, seen = MonitorState(log_dir, stall_after=2.0), []
    while process.poll() is None:
        for rank in state.refresh()["ranks"]:
            seen.append((rank["rank"], rank.get("phase") or "", rank["stalled"]))
        time.sleep(0.2)
    return seen


def test_clips_of_the_asked_size_and_length_at_the_baseline_every_n_steps_and_the_end(runs):
    samples = runs["with"] / "lora" / "samples"
    assert sorted(p.name for p in samples.iterdir()) == ["step-00000000", "step-00000002", "step-00000004",
                                                         "step-00000005"]   # 5 steps: 0 (baseline), 2, 4, end
    # the prompts file beside the clips keeps each prompt whole and in its own script (a Korean prompt's
    # clip was "02-prompt.mp4", its text nowhere)
    for folder in samples.iterdir():
        names = sorted(p.name for p in folder.iterdir())
        assert names == ["01-a-news-anchor-in-the-studio.mp4", "01-a-news-anchor-in-the-studio.png",
                         "02-도시-거리-밤.mp4", "02-도시-거리-밤.png", "prompts.json"], names   # no temp files left
        first = clip_frames(folder / names[0])
        assert first.shape == (9, 64, 64, 3)
        second = clip_frames(folder / "02-도시-거리-밤.mp4")
        assert second.shape == (5, 32, 64, 3)
        assert Image.open(folder / "02-도시-거리-밤.png").size == (64, 32)
        kept = json.loads((folder / "prompts.json").read_text(encoding="utf-8"))["prompts"]
        assert [(p["index"], p["stem"], p["prompt"], p["seed"]) for p in kept] == [
            (1, "01-a-news-anchor-in-the-studio", "a news anchor in the studio", 42),
            (2, "02-도시-거리-밤", "도시 거리 밤", 9)]
    state = read_status(runs["with"] / "logs", 0)
    assert state["last_samples"]["step"] == 5 and state["samples_dir"] == str(samples.resolve())
    records = [r for r in read_history(runs["with"] / "logs", 0) if r.get("kind") == "samples"]
    assert [r["step"] for r in records] == [0, 2, 4, 5] and len(records[0]["files"]) == 4
    assert not [r for r in read_history(runs["with"] / "logs", 1) if r.get("kind") == "samples"]  # rank 0 samples


def test_sampling_leaves_training_unchanged(runs):
    assert_trained_alike(runs["with"], runs["without"])


def test_a_run_from_the_cache_samples_with_the_cached_prompt_embeddings_and_only_the_vae(runs):
    """The cached run loads no text encoder; its baseline clips equal the encoding run's (same DiT, prompts, seeds)."""
    cached = runs["cached"] / "lora" / "samples"
    assert sorted(p.name for p in cached.iterdir()) == ["step-00000000", "step-00000005"]   # baseline and end
    for name in ("01-a-news-anchor-in-the-studio.mp4", "02-도시-거리-밤.mp4"):
        from_cache = clip_frames(cached / "step-00000000" / name).astype(int)
        encoded = clip_frames(runs["with"] / "lora" / "samples" / "step-00000000" / name).astype(int)
        assert from_cache.shape == encoded.shape and abs(from_cache - encoded).max() <= 2, name


def test_tensorboard_gets_each_sample_sets_first_frames(runs):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run_id = read_status(runs["with"] / "logs", 0)["run_id"]
    events = EventAccumulator(str(runs["with"] / "lora" / "tracking" / run_id),
                              size_guidance={"images": 0, "tensors": 0})
    events.Reload()
    assert sorted(events.Tags()["images"]) == ["samples/01-a-news-anchor-in-the-studio", "samples/02-도시-거리-밤"]
    images = events.Images("samples/02-도시-거리-밤")
    assert [i.step for i in images] == [0, 2, 4, 5] and (images[0].width, images[0].height) == (64, 32)
    # each image's full prompt as text beside it, unchanged
    texts = events.Tensors("samples/02-도시-거리-밤/prompt/text_summary")
    assert [t.step for t in texts] == [0, 2, 4, 5]
    assert texts[0].tensor_proto.string_val[0].decode("utf-8") == "도시 거리 밤"


def test_while_rank_0_samples_no_rank_looks_stalled(runs):
    """Rank 0's phase moves with every denoising step, and the others say how long they have waited."""
    seen = runs["with-seen"]
    assert any(rank == 0 and "denoising" in phase for rank, phase, _ in seen)
    assert any(rank == 1 and phase.startswith("waiting for rank 0's samples") for rank, phase, _ in seen)
    while_sampling = [entry for entry in seen if "sampling" in entry[1] or "samples" in entry[1]]
    assert len(while_sampling) > 10
    assert not [entry for entry in while_sampling if entry[2]], "a rank was called stalled while samples were made"


def test_every_status_field_the_runs_wrote_is_declared_and_read_back_as_written(runs):
    for name in ("with", "cached"):
        written = assert_the_monitor_reads_what_the_ranks_wrote(runs[name] / "logs")
        assert written["last_samples"]["files"] and written["samples_dir"].endswith("samples")
