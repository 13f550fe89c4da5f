"""The projected run length: steps per GPU for clips and images, the cache build, and the plan command's line."""

from __future__ import annotations

import subprocess
import sys

import pytest

from catalog_helpers import CONVERTED, DIFFSYNTH, clip, image, write_metadata
from diffsynth_mbc.training.plan import estimates

from diffsynth_mbc.gpu import known_gpu
from diffsynth_mbc.training.options import TrainOptions, resolve_options
from diffsynth_mbc.training.plan import run_length, speed
from diffsynth_mbc.training.plan.run_length import RunShape, count_media, duration
from diffsynth_mbc.training.plan.step_plan import StepPlan
from e2e_helpers import REPO

FULL = str(REPO / "configs" / "train_full.yaml")


def write_clips_and_images(path, videos, images, media_type_column=True):
    """Clip rows whose captions hold a comma, then image rows with an upper-case extension."""
    return write_metadata(path, [*(clip(f"v/{i}.mp4", caption="a clip, with a comma") for i in range(videos)),
                                 *(image(f"i/{i}.JPG") for i in range(images))],
                          CONVERTED if media_type_column else DIFFSYNTH)


def test_media_are_counted_by_the_media_type_column_or_the_extension(tmp_path):
    assert count_media(write_clips_and_images(tmp_path / "a.csv", 3, 2)) == (3, 2)
    assert count_media(write_clips_and_images(tmp_path / "b.csv", 4, 1, media_type_column=False)) == (4, 1)


def shape_of(videos, images, *, epochs=1, repeat=1, batch=1, image_batch=5, accumulation=1, gpus=1, nodes=1,
             unit="GPU"):
    plan = StepPlan(videos + images, repeat, world_size=gpus * nodes, batch_size=batch,
                    gradient_accumulation=accumulation, num_epochs=epochs, images=images, image_batch_size=image_batch)
    return RunShape(plan, nodes, unit)


def test_the_full_run_takes_200000_clip_steps_and_45090_image_steps_per_gpu_on_2_gpus():
    shape = shape_of(80_000, 90_180, epochs=5, gpus=2)
    assert (shape.video_steps, shape.image_steps, shape.total_steps) == (200_000, 45_090, 245_090)
    two_nodes = shape_of(80_000, 90_180, epochs=5, gpus=2, nodes=2, accumulation=2, repeat=2)
    assert two_nodes.gpus == 4 and two_nodes.gpus_per_node == 2
    assert two_nodes.video_steps == 5 * 20_000 and two_nodes.image_steps == 5 * 4_509


@pytest.mark.parametrize("gpus, accumulation, image_batch", [(2, 3, 7), (3, 8, 5), (16, 16, 1), (2, 1, 5)])
def test_the_projection_counts_the_step_plans_steps(gpus, accumulation, image_batch):
    """The projection counted its own steps (clips and images apart, each rounded up): 77,410 where the plan the
    launcher and the training print says 77,405. It splits the plan's total between clips and images instead."""
    shape = shape_of(80_000, 90_180, epochs=5, gpus=gpus, accumulation=accumulation, image_batch=image_batch)
    assert shape.video_steps + shape.image_steps == shape.total_steps == shape.plan.total_steps
    run = run_length.project(shape, 2.0, 1.0)
    assert f": {shape.plan.total_steps:,} ({shape.video_steps:,} video + {shape.image_steps:,} image) optimizer " \
           "steps per GPU" in run.line()
    assert run.training_seconds == shape.video_steps * 2.0 + shape.image_steps * 1.0


def test_the_length_is_steps_times_seconds_plus_the_cache_build():
    shape = shape_of(10, 20, gpus=2)
    run = run_length.project(shape, 2.0, 1.0, encode_video_seconds=3.0, encode_image_seconds=0.5)
    assert shape.total_steps == 7 and (shape.video_steps, shape.image_steps) == (5, 2)   # 10 + 4 batches on 2 GPUs
    assert run.training_seconds == 5 * 2.0 + 2 * 1.0
    assert run.cache_build_seconds == 5 * 3.0 + 10 * 0.5 and run.total_seconds == 12 + 20
    line = run.line()
    assert line.startswith("projected run length: 32 seconds (estimate): 10 videos (batch 1) + 20 images (batch 5)")
    assert "7 (5 video + 2 image) optimizer steps per GPU at 2.00 / 1.00 s/step" in line
    assert "after building the latent cache (20 seconds)" in line
    assert run_length.project(shape, 2.0, 1.0).cache_build_seconds is None


def test_the_cache_build_has_a_line_of_its_own_that_says_whether_it_is_measured():
    shape = shape_of(10, 20, gpus=2)
    estimated = run_length.project(shape, 2.0, 1.0, encode_video_seconds=3.0, encode_image_seconds=0.5)
    assert estimated.cache_line() == ("latent cache build: 20 seconds (estimate), before the first step: 5 clips x "
                                      "3.00 s + 10 images x 0.50 s per GPU, 2 GPU(s) in parallel; each row is encoded "
                                      "once (the build shows in the monitor as the caching phase)")
    assert estimated.as_dict()["cache_line"] == estimated.cache_line()
    measured = run_length.project(shape_of(0, 7, unit="CPU process"), 1.0, 1.0, encode_image_seconds=2.0,
                                  kind="measured")
    assert measured.cache_line().startswith("latent cache build: 14 seconds (measured), before the first step: "
                                            "7 images x 2.00 s per CPU process, 1 CPU process(es) in parallel")
    assert run_length.project(shape, 2.0, 1.0).cache_line() is None


@pytest.mark.parametrize("seconds, text", [(0.4, "0 seconds"), (59, "59 seconds"), (600, "10 minutes"),
                                           (5400, "1.5 hours"), (86400 * 2.26, "2.3 days")])
def test_durations_never_read_zero_days(seconds, text):
    assert duration(seconds) == text


def full_options(metadata, *flags):
    return resolve_options(["--config", FULL, "--dataset_metadata_path", str(metadata), *flags])


def test_the_full_run_on_v100s_and_h100s(tmp_path):
    metadata = write_clips_and_images(tmp_path / "metadata.csv", 80_000, 90_180)
    media = count_media(metadata)
    options = full_options(metadata, "--gradient_checkpointing", "all")
    v100 = estimates.estimate_run(options, known_gpu("V100S-32GB"), "V100S-32GB", "fp16", gpus=2, nodes=1,
                                  cached_launch=True, media=media)
    h100 = estimates.estimate_run(options, known_gpu("H100-80GB"), "H100-80GB", "bf16", gpus=2, nodes=1,
                                  cached_launch=True, media=media)
    assert v100.plans["video"].attention == "mem_efficient" and h100.plans["video"].attention == "cudnn"
    assert v100.projection.cache_build_seconds > h100.projection.cache_build_seconds > 0
    for kind in ("video", "image"):   # the cache build: the encodes measured on an H200, at the H100's tensor rate
        assert getattr(h100.projection, f"encode_{kind}_seconds") == speed.cache_encode_seconds(h100.plans[kind])
    assert 5 * h100.projection.total_seconds < v100.projection.total_seconds
    assert h100.speed["video"]["sources"][0] == ("H100 LoRA in the training precision, compiled, 30 of 30 blocks "
                                                 "recomputed, cudnn attention: 0.39 s measured")
    auto = estimates.estimate_run(full_options(metadata, "--gradient_checkpointing", "auto"), known_gpu("H100-80GB"),
                                  "H100-80GB", "bf16", gpus=2, nodes=1, cached_launch=True, media=media)
    assert auto.plans["video"].recomputed_blocks == 0 and auto.speed["video"]["seconds_per_step"] == 0.27
    assert "gradient checkpointing auto: 0 of 30 blocks recomputed" in " ".join(auto.assumptions)


def test_the_plan_command_prints_the_doctors_projected_line(tmp_path):
    metadata = write_clips_and_images(tmp_path / "metadata.csv", 800, 900)
    result = subprocess.run([sys.executable, "-m", "diffsynth_mbc.plan", "--world_size", "4", "--nodes", "2",
                             "--cached", "--assume", "V100S-32GB", "--config", FULL, "--dataset_metadata_path",
                             str(metadata)], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert result.returncode == 0, result.stderr
    options = full_options(metadata)
    expected = estimates.estimate_run(options, known_gpu("V100S-32GB"), "V100S-32GB", "fp16", gpus=2, nodes=2,
                                      cached_launch=True, media=(800, 900)).projection.line()
    assert f"  {expected}\n" in result.stderr
    cache = estimates.estimate_run(options, known_gpu("V100S-32GB"), "V100S-32GB", "fp16", gpus=2, nodes=2,
                                   cached_launch=True, media=(800, 900)).projection.cache_line()
    assert f"  {expected}\n  {cache}\n" in result.stderr and cache.startswith("latent cache build: ")
    assert "on 4 GPU(s) (2 node(s) x 2)" in expected and "after building the latent cache" in expected
    # no file of the metadata is there: said first, with the first row and where it was looked for
    warning, = [line for line in result.stderr.splitlines() if line.startswith("warning: ")]
    assert warning.startswith("warning: 1,700 of 1,700 files were not found (row 1: v/0.mp4, looked for at ")
    assert warning.endswith("is --dataset_base_path (/data/mbc) right?")
    unknown = subprocess.run([sys.executable, "-m", "diffsynth_mbc.plan", "--world_size", "1", "--config", FULL,
                              "--dataset_metadata_path", str(metadata)], capture_output=True, text=True, timeout=120,
                             cwd=REPO, env={"PATH": "/nonexistent", "PYTHONPATH": str(REPO)})
    assert unknown.returncode == 0, unknown.stderr
    assert "projected run length: unknown without a GPU" in unknown.stderr


def test_estimates_read_only_the_options_the_training_has():
    namespace = resolve_options(["--config", FULL, "--buckets", "off"])
    assert isinstance(namespace, TrainOptions)
    plans = estimates.run_plans(namespace, "fp16", "mem_efficient", True, True)
    assert plans["video"].tokens == 4400 and plans["image"].tokens == 880 and plans["image"].batch_size == 5
    assert estimates.run_plans(namespace, "fp16", "mem_efficient", True, True, media=(0, 7)).keys() == {"image"}


def test_with_aspect_buckets_and_no_rows_read_the_plans_are_at_the_largest_bucket():
    """The preset's --buckets aspect at 1280x704: 960x960 (30 x 30 cells) has the most tokens of the buckets (the
    32-pixel rounding puts 1280x704 at 40 x 22); the training's --gradient_checkpointing auto sizes for it too."""
    namespace = resolve_options(["--config", FULL])
    assert namespace.buckets == "aspect"
    plans = estimates.run_plans(namespace, "fp16", "mem_efficient", True, True)
    assert (plans["video"].height, plans["video"].width, plans["video"].tokens) == (960, 960, 5 * 900)
    assert (plans["image"].height, plans["image"].width, plans["image"].tokens) == (960, 960, 900)
    used = (("video@1280x704", 10), ("video@704x1280", 4), ("image@1248x736", 3))
    sizing = estimates.sizing_buckets(namespace, used)
    assert {kind: bucket.name for kind, bucket in sizing.items()} == {"video": "1280x704", "image": "1248x736"}


def test_the_plan_says_nothing_of_missing_files_when_every_file_is_there_and_counts_those_that_are_not(tmp_path):
    from diffsynth_mbc.training.plan.command import files_not_found

    metadata = write_clips_and_images(tmp_path / "metadata.csv", 3, 2)
    for name in ["v/0.mp4", "v/1.mp4", "v/2.mp4", "i/0.JPG", "i/1.JPG"]:
        (tmp_path / name).parent.mkdir(exist_ok=True)
        (tmp_path / name).write_bytes(b"x")
    options = full_options(metadata, "--dataset_base_path", str(tmp_path))
    assert files_not_found(options) is None
    (tmp_path / "v" / "1.mp4").unlink()
    assert files_not_found(options).startswith(f"warning: 1 of 5 files were not found (row 2: v/1.mp4, looked for at "
                                               f"{tmp_path / 'v' / '1.mp4'}): the training replaces each as bad media")


def test_the_plan_names_the_clips_frame_rates_and_what_the_run_does_with_them(tmp_path, capsys):
    """Read from the fps column ``convert --probe`` writes: the presets put every clip on the model's 24 fps timeline."""
    from diffsynth_mbc.training.plan.command import main

    metadata = tmp_path / "metadata.csv"
    metadata.write_text("video,prompt,media_type,fps\n" + "v/a.mp4,a clip,video,29.97\n" * 3
                        + "v/b.mp4,a clip,video,25.0\nv/c.mp4,a clip,video,\ni/0.png,an image,image,\n")
    flags = ["--gpus", "1", "--config", FULL, "--buckets", "off", "--dataset_metadata_path", str(metadata)]
    assert main(flags) == 0
    assert ("  frame rates: clips at 29.97 fps (3) and 25 fps (1) put on the 24 fps timeline (--source_fps 24): 17 "
            "frames span 0.67 s; 1 clip(s) of no recorded rate") in capsys.readouterr().err
    assert main([*flags, "--brief", "--source_fps", "none"]) == 0
    brief = capsys.readouterr().err
    assert max(len(line) for line in brief.splitlines() if not line.startswith("warning: ")) <= 80
    assert ("frame rates: clips at 29.97 fps (3) and 25 fps (1) train at their own rates (no --source_fps)"
            in " ".join(line.strip() for line in brief.splitlines()))
