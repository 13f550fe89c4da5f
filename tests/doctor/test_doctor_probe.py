"""``python -m diffsynth_mbc.doctor --probe N`` on this machine: real optimizer steps of the demo run, measured."""

from __future__ import annotations

import json

import pytest

from diffsynth_mbc.data.demo import prepare
from diffsynth_mbc.doctor.cli import main
from e2e_helpers import REPO, forget_in_process_trainings, run_main

pytestmark = pytest.mark.slow


def test_the_probe_measures_clips_and_images_apart_and_projects_the_run(tmp_path, monkeypatch):
    forget_in_process_trainings(monkeypatch)
    root = tmp_path / "demo"
    prepare(root, num_videos=3, num_images=2)
    output = tmp_path / "run"
    flags = ["--config", str(REPO / "configs" / "train_demo.yaml"), "--dataset_base_path", str(root / "catalog"),
             "--dataset_metadata_path", str(root / "metadata" / "metadata.csv"), "--output_path", str(output),
             "--gradient_accumulation_steps", "1", "--image_batch_size", "1", "--checkpoint_steps", "1",
             "--val_metadata_path", str(root / "metadata" / "metadata.csv"), "--val_steps", "1"]
    result = run_main(main, [*flags, "--quick", "--probe", "2", "--json"], tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    probe = json.loads(result.stdout)["probe"]
    assert "error" not in probe and probe["steps"] == 2 and not probe["cached"]
    for kind in ("video", "image"):
        figure = probe["measured"][kind]
        assert figure["seconds_per_step"] > 0 and figure["steps_timed"] == 2 and figure["warmup_steps"] == 2
        assert figure["samples_per_step"] == 1 and figure["peak_rss_mb"] > 100 and figure["max_allocated_mb"] is None
        assert figure["mixed_precision"] == "no"   # the run's own choice on the CPU
        # the largest residual magnitude the DiT's blocks wrote, against fp16's limit (fp32 here: the stream too)
        assert 0 < figure["largest_residual"] < 65504 and figure["fp32_residual"] is False
        assert figure["fp16_headroom"] == pytest.approx(65504 / figure["largest_residual"], rel=1e-3)
    assert probe["measured"]["image"]["distinct_rows"] == 2   # 4 rows wanted, 2 images: repeated
    projected = probe["projection"]
    assert projected["kind"] == "measured" and projected["videos"] == 3 and projected["images"] == 2
    # the demo preset's 2 epochs x repeat 3 on one process: 3 videos -> 18 steps, 2 images (batch 1) -> 12
    assert projected["video_steps_per_gpu"] == 18 and projected["image_steps_per_gpu"] == 12
    assert projected["total_seconds"] == pytest.approx(
        18 * probe["measured"]["video"]["seconds_per_step"] + 12 * probe["measured"]["image"]["seconds_per_step"], abs=1)
    assert projected["line"].startswith("projected run length: ") and " on 1 CPU process(es) " in projected["line"]
    # nothing was written where the run itself writes: the probe trained in a temporary folder
    assert not output.exists()


def test_with_resolution_stages_each_stage_is_probed_at_its_size(tmp_path, monkeypatch):
    forget_in_process_trainings(monkeypatch)
    root = tmp_path / "demo"
    prepare(root, num_videos=1, num_images=1)
    flags = ["--config", str(REPO / "configs" / "train_demo.yaml"), "--dataset_base_path", str(root / "catalog"),
             "--dataset_metadata_path", str(root / "metadata" / "metadata.csv"), "--output_path", str(tmp_path / "run"),
             "--gradient_accumulation_steps", "1", "--image_batch_size", "1", "--resolution_stages", "32x32:0.5"]
    result = run_main(main, [*flags, "--quick", "--probe", "1", "--json"], tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    probe = json.loads(result.stdout)["probe"]
    assert "error" not in probe
    final, low = probe["measured"], probe["stages"]["32x32"]
    assert set(final) == set(low) == {"video", "image"}
    projected = probe["projection"]
    steps = {"video": projected["video_steps_per_gpu"], "image": projected["image_steps_per_gpu"]}
    expected = sum(0.5 * steps[kind] * (final[kind]["seconds_per_step"] + low[kind]["seconds_per_step"])
                   for kind in steps)
    assert projected["training_seconds"] == pytest.approx(expected, abs=1)
    assert projected["line"].endswith("(measured, in stages)")
    assert projected["stage_line"].startswith("in stages: 32x32 50% of the steps (")
