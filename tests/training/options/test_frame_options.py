"""--frame_sampling, --source_fps, --short_clips: flags, presets, the latent cache's refusals and keys, resume."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from catalog_helpers import DIFFSYNTH, clip, write_metadata
from diffsynth_mbc.data.cache import cli as cache
from diffsynth_mbc.data.cache.dataset import CachedLatentDataset, CacheMismatchError, open_training_dataset
from diffsynth_mbc.data.cache.index import CacheError
from diffsynth_mbc.data.demo import prepare
from diffsynth_mbc.errors import OptionsError
from diffsynth_mbc.training.checkpoints.fingerprint import fingerprint_differences, run_fingerprint
from diffsynth_mbc.training.options import resolve_options
from diffsynth_mbc.training.plan.command import cache_arguments

BASE = ["--dataset_metadata_path", "m.csv", "--dataset_base_path", "."]


def test_flags_and_presets_take_the_frame_options(tmp_path):
    options = resolve_options(BASE)
    assert (options.frame_sampling, options.source_fps, options.short_clips) == ("head", None, "shorten")
    options = resolve_options(BASE + ["--frame-sampling", "uniform", "--source_fps", "24", "--short_clips", "loop"])
    assert (options.frame_sampling, options.source_fps, options.short_clips) == ("uniform", 24.0, "loop")
    preset = tmp_path / "p.yaml"
    preset.write_text("frame_sampling: random_window\nsource_fps: 25\nshort_clips: skip\n")
    options = resolve_options(BASE + ["--config", str(preset)])
    assert (options.frame_sampling, options.source_fps, options.short_clips) == ("random_window", 25.0, "skip")


@pytest.mark.parametrize("flags, named", [
    (["--frame_sampling", "middle"], "--frame_sampling"), (["--short_clips", "pad"], "--short_clips"),
    (["--source_fps", "0"], "--source_fps"), (["--source_fps", "nan"], "--source_fps"),
    (["--frame_sampling", "random_window", "--cache", "c"], "--frame_sampling random_window cannot train from --cache"),
    (["--frame_sampling", "random_window", "--val_cache", "c"], "from --val_cache c: its frames are drawn anew"),
])
def test_bad_frame_options_name_the_flag(flags, named):
    with pytest.raises(OptionsError, match=named):
        resolve_options(BASE + flags)


def test_the_cache_command_refuses_random_window_and_gets_the_trainings_frame_flags(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)   # the cache's options read the metadata file (its errors come before any model)
    write_metadata(tmp_path / "m.csv", [clip("a.mp4")], DIFFSYNTH)
    common = ["--demo", "--dataset_base_path", ".", "--dataset_metadata_path", "m.csv", "--cache_dir", "c"]
    with pytest.raises(CacheError, match="random_window draws a clip's frames anew every epoch"):
        cache.parse_options(common + ["--frame_sampling", "random_window"])
    options = resolve_options(BASE + ["--frame_sampling", "uniform", "--source_fps", "12.5", "--demo"])
    arguments = cache_arguments(options, "m.csv", ".", "c")
    assert arguments[arguments.index("--frame_sampling") + 1] == "uniform"
    assert arguments[arguments.index("--source_fps") + 1] == "12.5"
    assert cache.parse_options(arguments).frames.settings() == {"sampling": "uniform", "source_fps": 12.5,
                                                                "short_clips": "shorten"}
    assert "--frame_sampling" not in cache_arguments(resolve_options(BASE + ["--demo"]), "m.csv", ".", "c")


def test_the_cache_command_gets_the_trainings_buckets(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    write_metadata(tmp_path / "m.csv", [clip("a.mp4")], DIFFSYNTH)
    arguments = cache_arguments(resolve_options(BASE + ["--demo", "--buckets", "aspect"]), "m.csv", ".", "c")
    assert arguments[arguments.index("--buckets") + 1] == "aspect"
    assert cache.parse_options(arguments).buckets == "aspect"
    assert "--buckets" not in cache_arguments(resolve_options(BASE + ["--demo"]), "m.csv", ".", "c")


def test_a_resume_compares_the_frames_and_old_checkpoints_match_the_default():
    def fingerprint(*flags):
        return run_fingerprint(resolve_options(BASE + list(flags)), world_size=1, accumulation=1, rows=1,
                               metadata_sha256="x", image_batch=1, precision="no")
    head, uniform = fingerprint(), fingerprint("--frame_sampling", "uniform")
    assert head["frames"] is None
    assert fingerprint_differences(head, uniform) == [
        "frames: checkpoint None, this run {'sampling': 'uniform', 'source_fps': None, 'short_clips': 'shorten'}"]
    saved_before = {key: value for key, value in head.items() if key != "frames"}
    assert fingerprint_differences(saved_before, head) == []


def test_a_resume_with_other_buckets_is_refused_and_old_checkpoints_trained_without_them():
    def fingerprint(*flags):
        return run_fingerprint(resolve_options(BASE + list(flags)), world_size=1, accumulation=1, rows=1,
                               metadata_sha256="x", image_batch=1, precision="no")
    off, aspect = fingerprint(), fingerprint("--buckets", "aspect")
    assert fingerprint_differences(off, aspect) == ["buckets: checkpoint 'off', this run 'aspect'"]
    saved_before = {key: value for key, value in off.items() if key != "buckets"}
    assert fingerprint_differences(saved_before, off) == []
    assert len(fingerprint_differences(saved_before, aspect)) == 1


def test_a_uniform_cache_has_its_own_keys_and_a_run_asking_for_other_frames_is_refused(tmp_path):
    root = tmp_path / "demo"
    metadata = prepare(root, num_videos=2, num_images=1)
    summaries = {}
    for sampling in ("head", "uniform"):
        assert cache.main(["--demo", "--dataset_base_path", str(root / "catalog"), "--dataset_metadata_path",
                           str(metadata), "--height", "64", "--width", "64", "--num_frames", "5", "--cache_dir",
                           str(tmp_path / sampling), "--dataset_num_workers", "0", "--frame_sampling", sampling]) == 0
        summaries[sampling] = json.loads((tmp_path / sampling / "cache.json").read_text())
    head, uniform = summaries["head"], summaries["uniform"]
    assert "frames" not in head["settings"]          # the default's index and keys are those of older caches
    assert uniform["settings"]["frames"] == {"sampling": "uniform", "source_fps": None, "short_clips": "shorten"}
    assert {row["entry"] for row in head["rows"]}.isdisjoint(row["entry"] for row in uniform["rows"])

    def options(cache_dir, *flags):
        return resolve_options(["--demo", "--dataset_metadata_path", str(metadata), "--dataset_base_path",
                                str(root / "catalog"), "--height", "64", "--width", "64", "--num_frames", "5",
                                "--cache", str(cache_dir), *flags])
    with pytest.raises(CacheMismatchError, match=r"its frames are sampling uniform, source_fps None, short_clips "
                                                 r"shorten; this run asks for the first frames of each clip \(head\)"):
        open_training_dataset(options(tmp_path / "uniform"))
    with pytest.raises(CacheMismatchError, match="its frames are the first frames of each clip"):
        open_training_dataset(options(tmp_path / "head", "--frame_sampling", "uniform"))
    assert isinstance(open_training_dataset(options(tmp_path / "uniform", "--frame_sampling", "uniform")),
                      CachedLatentDataset)
    assert isinstance(open_training_dataset(options(tmp_path / "head")), CachedLatentDataset)
    assert Path(tmp_path / "uniform" / "summary.json").is_file()
