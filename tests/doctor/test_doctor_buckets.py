"""``--buckets aspect`` in the doctor: memory sized for the largest bucket the rows use (and said), the run length
added up from each bucket's steps at its own seconds per step, ``--probe`` measuring every bucket in use apart; and
``--buckets off`` as before."""

from __future__ import annotations

import dataclasses
import json

import pytest

from catalog_helpers import CONVERTED, WITH_SIZES, clip, image, write_media_catalogue, write_metadata
from diffsynth_mbc.doctor.cli import main
from diffsynth_mbc.gpu import known_gpu
from diffsynth_mbc.training.plan import memory, speed
from e2e_helpers import REPO, forget_in_process_trainings

FULL = str(REPO / "configs" / "train_full.yaml")
GPU = "H100-80GB"
# 6 landscape phone clips, 3 portrait ones, 4 square photos (no files: the doctor reads the size columns)
ROWS = ([clip(f"clips/wide_{i}.mp4", 1920, 1080) for i in range(6)]
        + [clip(f"clips/tall_{i}.mp4", 720, 1280) for i in range(3)]
        + [image(f"photos/{i}.jpg", 1024, 1024) for i in range(4)])


def doctor(capsys, *flags) -> dict:
    """The doctor's --json report, run in this process."""
    main([*flags, "--json"])
    return json.loads(capsys.readouterr().out)


def flags_for(metadata, tmp_path, buckets):
    return ["--config", FULL, "--assume", GPU, "--gpus", "2", "--quick", "--buckets", buckets, "--cached",
            "--num_epochs", "2", "--dataset_metadata_path", str(metadata), "--output_path", str(tmp_path / "out")]


def plan_of(report, **changes) -> memory.Plan:
    fields = {field.name for field in dataclasses.fields(memory.Plan)}
    plan = memory.Plan(**{key: value for key, value in report["memory"]["plan"].items() if key in fields})
    return plan.but(lora_targets=tuple(plan.lora_targets), **changes)


def seconds(plan: memory.Plan) -> float:
    return speed.seconds_per_step(plan, known_gpu(GPU), GPU).seconds


# Every sample conditioned on its first frame, photos too: then the batch with the most tokens holds the most
ALL_CONDITIONED = ("--objective", "diffsynth")


def test_the_i2v_clip_outweighs_five_square_photos_that_keep_no_per_token_modulation(tmp_path, capsys):
    """Measured on the H100 box (benchmarks/results/2026-11-28-h100.json): an i2v clip 35.7 GiB, five 960x960
    photos 31.1 GiB: the photos' 100 more tokens weigh less than the clip's per-token time modulation."""
    metadata = write_metadata(tmp_path / "metadata.csv", ROWS, WITH_SIZES)
    mem = doctor(capsys, *flags_for(metadata, tmp_path, "aspect"))["memory"]
    assert mem["batch"] == "video" and mem["bucket"] == "1280x704" and mem["plan"]["conditioned"]


def test_memory_is_sized_for_the_largest_bucket_in_use_and_the_length_adds_up_the_buckets(tmp_path, capsys):
    metadata = write_metadata(tmp_path / "metadata.csv", ROWS, WITH_SIZES)
    report = doctor(capsys, *flags_for(metadata, tmp_path, "aspect"), *ALL_CONDITIONED)
    mem = report["memory"]
    # the photos' 960x960 bucket has 30 x 30 cells, the clips' 1280x704 40 x 22: five photos to a batch (a clip's
    # latent frames) are the larger batch, at 4,500 tokens against 4,400, when photos are conditioned too
    assert mem["batch"] == "image" and mem["bucket"] == "960x960"
    assert (mem["plan"]["height"], mem["plan"]["width"], mem["plan"]["tokens"], mem["plan"]["batch_size"]) == \
        (960, 960, 900, 5)
    assert mem["bucket_note"] == "sized for the largest bucket 960x960 of the 3 the rows use"
    assert mem["total_bytes"] == memory.total(memory.estimate(plan_of(report)))
    memory_check, = [c for c in report["checks"] if c["name"] == "memory"]
    assert "(image batch, sized for the largest bucket 960x960 of the 3 the rows use, " in memory_check["detail"]

    # the run length, by hand: on 2 GPUs 6 wide clips are 3 batches per GPU, 3 tall ones 2, 4 photos (batches of
    # 5) 1; 2 epochs; each bucket's steps at its own seconds per step
    video = plan_of(report, num_frames=17, batch_size=1)
    wide, tall = seconds(video.but(height=704, width=1280)), seconds(video.but(height=1280, width=704))
    square = seconds(plan_of(report))
    projection = report["speed"]["projection"]
    assert [(b["key"], b["steps_per_gpu"]) for b in projection["buckets"]] == \
        [("image@960x960", 2), ("video@1280x704", 6), ("video@704x1280", 4)]
    assert projection["total_steps_per_gpu"] == 12 and projection["video_steps_per_gpu"] == 10
    assert projection["training_seconds"] == round(6 * wide + 4 * tall + 2 * square)
    assert report["speed"]["buckets"]["image@960x960"]["seconds_per_step"] == round(square, 3)
    assert report["speed"]["buckets"]["video@1280x704"]["tokens"] == 4400
    assert projection["bucket_line"].startswith("by bucket (estimate): 960x960 images 2 steps x ")
    assert "--buckets aspect: memory sized for clips at 1280x704, images at 960x960 (the largest of the 3 buckets " \
           "the rows use); seconds per step at each bucket's tokens" in report["assumptions"]


def test_rows_of_unknown_size_are_sized_where_the_training_puts_them(tmp_path, capsys):
    """No width/height columns and no files to read a header from: the training puts every row at --height x
    --width (it fails to decode later), so that is the one bucket in use."""
    metadata = write_metadata(tmp_path / "metadata.csv", ROWS, CONVERTED)
    report = doctor(capsys, *flags_for(metadata, tmp_path, "aspect"))
    assert report["memory"]["plan"]["tokens"] == 4400 and report["memory"]["bucket"] == "1280x704"
    assert [b["key"] for b in report["speed"]["projection"]["buckets"]] == ["image@1280x704", "video@1280x704"]


def test_without_a_metadata_the_memory_is_sized_for_the_largest_of_every_bucket(tmp_path, capsys):
    report = doctor(capsys, *flags_for(tmp_path / "missing.csv", tmp_path, "aspect"))
    mem = report["memory"]
    assert report["media"] is None and "projection" not in report["speed"]
    assert mem["bucket"] == "960x960" and mem["plan"]["tokens"] == 5 * 900 and mem["batch"] in ("video", "image")
    assert mem["bucket_note"] == "sized for the largest bucket 960x960 of all 37 at --height x --width, the rows' " \
                                 "buckets not read"


def test_buckets_off_sizes_for_height_by_width_and_times_clips_and_images_apart(tmp_path, capsys):
    metadata = write_metadata(tmp_path / "metadata.csv", ROWS, WITH_SIZES)
    report = doctor(capsys, *flags_for(metadata, tmp_path, "off"))
    mem = report["memory"]
    assert mem["batch"] == "video" and mem["plan"]["tokens"] == 4400 and "bucket" not in mem
    assert (mem["plan"]["height"], mem["plan"]["width"]) == (704, 1280)
    assert "sized for" not in [c for c in report["checks"] if c["name"] == "memory"][0]["detail"]
    projection = report["speed"]["projection"]
    assert "buckets" not in projection and "bucket_line" not in projection and "buckets" not in report["speed"]
    # 9 clip batches and 1 photo batch dealt to 2 GPUs: 5 each, 2 epochs; the steps split 9 : 1
    assert (projection["video_steps_per_gpu"], projection["image_steps_per_gpu"]) == (9, 1)
    video, image = report["speed"]["video"]["seconds_per_step"], report["speed"]["image"]["seconds_per_step"]
    assert projection["training_seconds"] == pytest.approx(9 * video + 1 * image, abs=1)


def test_the_table_names_the_bucket_and_prints_the_bucket_sum(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "1000")
    metadata = write_metadata(tmp_path / "metadata.csv", ROWS, WITH_SIZES)
    main([*flags_for(metadata, tmp_path, "aspect"), *ALL_CONDITIONED])
    table = " ".join(capsys.readouterr().out.split())   # rich wraps the titles
    assert "memory per GPU, image batch (sized for the largest bucket 960x960 of the 3 the rows use, 900 tokens x 5" \
           in table
    assert "by bucket (estimate): 960x960 images 2 steps x 0.29 s + 1280x704 videos 6 steps x 0.27 s + " in table


@pytest.mark.slow
def test_the_probe_measures_every_bucket_in_use_and_projects_from_them(tmp_path, capsys, monkeypatch):
    """Real steps of the demo model on this machine: landscape and portrait clips at --height 64 --width 128 train
    in two buckets, each measured by a run of its own, and the run length adds up each bucket's steps."""
    forget_in_process_trainings(monkeypatch)
    wide = [clip(f"wide_{i}.mp4", 128, 64, seed=i, caption="a video") for i in range(2)]
    tall = [clip(f"tall_{i}.mp4", 64, 128, seed=2 + i, caption="a video") for i in range(2)]
    metadata = write_media_catalogue(tmp_path, wide + tall, WITH_SIZES)
    output = tmp_path / "run"
    flags = ["--config", str(REPO / "configs" / "train_demo.yaml"), "--dataset_base_path", str(tmp_path / "catalog"),
             "--dataset_metadata_path", str(metadata), "--output_path", str(output), "--height", "64", "--width", "128",
             "--buckets", "aspect", "--gradient_accumulation_steps", "1", "--quick", "--probe", "1"]
    code = main([*flags, "--json"])
    result = json.loads(capsys.readouterr().out)
    assert code == 0, json.dumps({"checks": result["checks"], "probe": result.get("probe")}, indent=1)[-4000:]
    probe = result["probe"]
    assert "error" not in probe and set(probe["measured"]) == {"video@128x64", "video@64x128"}
    assert probe["measured"]["video@128x64"]["trained_at"] == [9, 64, 128]   # [frames, height, width]
    assert probe["measured"]["video@64x128"]["trained_at"] == [9, 128, 64]
    for figure in probe["measured"].values():
        assert figure["seconds_per_step"] > 0 and figure["steps_timed"] == 1 and figure["distinct_rows"] == 2
    # the demo preset's 2 epochs x repeat 3 on one process: each bucket's 2 clips are 6 batches an epoch
    projected = probe["projection"]
    assert projected["kind"] == "measured" and projected["total_steps_per_gpu"] == 24
    assert [(b["key"], b["steps_per_gpu"]) for b in projected["buckets"]] == [("video@128x64", 12), ("video@64x128", 12)]
    wide, tall = (probe["measured"][key]["seconds_per_step"] for key in ("video@128x64", "video@64x128"))
    assert projected["training_seconds"] == round(12 * wide + 12 * tall)
    assert projected["bucket_line"].startswith("by bucket (measured): 128x64 videos 12 steps x ")
    assert not output.exists()   # the probe trained in a temporary folder


def test_the_projection_counts_the_runs_validations_and_health_records(tmp_path, capsys):
    """The full preset validates 64 samples every 2,000 steps and at the end and records the LoRA's health every 10:
    on 12 steps per GPU, one validation (32 samples per GPU, the base once) and records at steps 0, 10 and 12."""
    metadata = write_metadata(tmp_path / "metadata.csv", ROWS, WITH_SIZES)
    projection = doctor(capsys, *flags_for(metadata, tmp_path, "aspect"))["speed"]["projection"]
    evaluation = projection["evaluation"]
    assert (evaluation["validations"], evaluation["health_records"], evaluation["sample_sets"]) == (1, 3, 0)
    assert projection["total_seconds"] == pytest.approx(projection["training_seconds"]
                                                        + projection["cache_build_seconds"] + evaluation["seconds"],
                                                        abs=2)
    assert projection["evaluation_line"].startswith("evaluation: ") and \
        "1 validation(s) x 32 sample(s) per GPU" in projection["evaluation_line"]
    assert projection["line"].endswith(")") and ", with evaluation (" in projection["line"]


def test_a_size_cell_that_is_no_size_fails_the_metadata_check_naming_row_and_column(tmp_path, capsys):
    """The plan and the training refuse it; the doctor sized the run for every bucket without a word."""
    metadata = write_metadata(tmp_path / "metadata.csv", [clip("a.mp4", 1920, 1080, caption="x"),
                                                          clip("b.mp4", -5, 1080, caption="y")], WITH_SIZES)
    report = doctor(capsys, *flags_for(metadata, tmp_path, "aspect"))
    check, = [c for c in report["checks"] if c["name"] == "metadata"]
    assert check["status"] == "fail" and "metadata row 2 (b.mp4): width '-5' is not a size in pixels" in check["detail"]
    assert report["exit_code"] == 1
