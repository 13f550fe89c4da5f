"""--resolution_stages: what a stage is, where the boundaries fall, the shape a batch trains at in a stage, the
batches carrying their stage, and the doctor's projection of the team's run with and without stages."""

import re

import pytest

from diffsynth_mbc.data.media.stages import Stage, boundaries, parse_stages, stage_at, stage_shape
from diffsynth_mbc.errors import OptionsError


def test_stages_are_parsed_and_a_bad_value_is_refused_naming_it():
    assert parse_stages("832x480:0.7") == (Stage(832, 480, None, 0.7),)
    assert parse_stages("480x256x9:0.4,832x480:0.3") == (Stage(480, 256, 9, 0.4), Stage(832, 480, None, 0.3))
    assert parse_stages(None) == () and parse_stages("") == ()
    for text, said in (("832x480", r"is not WxH\[xF\]:SHARE"), ("830x480:0.7", "multiples of 32"),
                       ("832x480x8:0.5", r"frames must be 4k\+1"), ("832x480:0", "above 0 and below 1"),
                       ("832x480:0.6,640x352:0.5", "add up to 1.1")):
        with pytest.raises(OptionsError, match=f"^--resolution_stages.*{said}"):
            parse_stages(text)


def test_the_boundaries_fall_on_optimizer_steps_and_every_step_has_one_stage():
    stages = parse_stages("64x64:0.5")
    assert boundaries(stages, 12) == [6, 12]
    assert [stage_at([6, 12], step) for step in range(12)] == [0] * 6 + [1] * 6
    assert boundaries(parse_stages("480x256:0.4,832x480:0.3"), 1000) == [400, 700, 1000]


def test_a_buckets_shape_is_scaled_to_the_stages_area_and_off_takes_the_stage_size():
    stage = Stage(832, 480, None, 0.7)
    final = (704, 1280)
    assert stage_shape(stage, 704, 1280, "aspect", final) == (480, 832)     # the configured shape: the stage's
    assert stage_shape(stage, 1280, 704, "aspect", final) == (832, 480)     # its portrait bucket, turned
    assert stage_shape(stage, 960, 960, "aspect", final) == (640, 640)      # others scaled by the areas' ratio
    assert stage_shape(stage, 1280, 704, "off") == (480, 832)


def test_the_batch_sampler_gives_each_index_the_stage_of_its_optimizer_step():
    from diffsynth_mbc.training.plan.batches import ShapeGroupedBatchSampler

    sampler = ShapeGroupedBatchSampler(["video"] * 8, 1, {"video": 1}, world_size=2, seed=0)
    sampler.set_stages(lambda step: stage_at([2, 4], step), first_step_of_epoch=lambda epoch: 2 * epoch,
                       accumulation=2)
    batches = list(sampler)   # 8 batches: each rank's 4 are 2 optimizer steps of 2
    assert [batch[0][1] for batch in batches] == [0, 0, 0, 0, 0, 0, 0, 0]
    sampler.set_epoch(1)
    assert [batch[0][1] for batch in sampler] == [1] * 8


def test_the_doctor_projects_the_teams_run_in_stages_at_most_0_8_of_the_plain_one_on_v100s():
    from diffsynth_mbc.gpu import known_gpu
    from diffsynth_mbc.training.options import resolve_options
    from diffsynth_mbc.training.plan import estimates

    from e2e_helpers import REPO

    spec = known_gpu("V100-32GB")
    projections = {}
    for stages in ([], ["--resolution_stages", "832x480:0.7"]):
        options = resolve_options(["--config", str(REPO / "configs" / "train_full.yaml"), *stages])
        projections[bool(stages)] = estimates.estimate_run(options, spec, spec.name, "fp16", gpus=2, nodes=1,
                                                           cached_launch=True, media=(80_000, 90_180)).projection
    plain, staged = projections[False], projections[True]
    assert staged.total_seconds <= 0.8 * plain.total_seconds
    assert plain.stage_line().startswith("with --resolution_stages 832x480:0.7: ")
    assert staged.stage_line().startswith("in stages: 832x480 70% of the steps (")
    flag, seconds = plain.staged_alternative
    assert flag == "832x480:0.7" and seconds == pytest.approx(staged.total_seconds, rel=1e-6)


def test_the_disk_check_counts_every_stages_latents():
    from diffsynth_mbc.doctor import disk
    from diffsynth_mbc.training.options import resolve_options

    from e2e_helpers import REPO

    full = ["--config", str(REPO / "configs" / "train_full.yaml")]
    plain = disk.cache_bytes(resolve_options(full), 80_000, 90_180)
    staged = disk.cache_bytes(resolve_options([*full, "--resolution_stages", "832x480:0.7"]), 80_000, 90_180)
    # a latent is 48 x frames' latents x (H/16) x (W/16) values: 832x480's are 0.44 of 1280x704's, captions once
    latent = 48 * 2 * ((80_000 * 5 * 30 * 52) + 90_180 * 30 * 52)
    assert staged - plain == latent


def demo_options(tmp_path, *flags):
    from diffsynth_mbc.training.options import resolve_options

    from e2e_helpers import REPO

    return resolve_options(["--config", str(REPO / "configs" / "train_demo.yaml"), "--dataset_base_path",
                            str(tmp_path), "--height", "96", "--width", "96", *flags])   # 9 frames


def test_a_stage_not_below_the_final_size_is_refused_naming_it(tmp_path):
    """128x128:0.5 at 96x96 trained a stage larger than the size the memory is sized for, and 96x96:0.5 the final
    size under another name; both were taken."""
    for stage, said in (("128x128:0.5", r"the stage 128x128:0.5 \(128x128x9\) is larger than the final size 96x96x9"),
                        ("64x64x17:0.5", r"the stage 64x64x17:0.5 \(64x64x17\) is larger than the final size"),
                        ("32x32:0.3,96x96:0.3", r"the stage 96x96:0.3 \(96x96x9\) trains the final size's area and "
                                                r"frames \(96x96x9\)"),
                        ("288x32:0.5", r"the stage 288x32:0.5 \(288x32x9\) trains the final size's area")):
        with pytest.raises(OptionsError, match=f"^--resolution_stages: {said}"):
            demo_options(tmp_path, "--resolution_stages", stage)
    for stage in ("64x64:0.5", "96x96x5:0.5", "128x64:0.5"):   # a smaller area, or the same at fewer frames
        assert demo_options(tmp_path, "--resolution_stages", stage).resolution_stages.text == stage


def test_a_stage_without_an_optimizer_step_is_refused_where_the_plan_is_made(tmp_path):
    """``32x32:0.0000001`` printed ``steps 1-0`` and 100 stages of 0.001 got none; shares leaving the final size no
    step were taken too. The plan (12 steps here) refuses each, naming it, and the plan command says the same."""
    from catalog_helpers import write_media_metadata
    from diffsynth_mbc.training.plan.command import main as plan_main
    from diffsynth_mbc.training.plan.step_plan import plan_from_options

    from e2e_helpers import REPO, run_main

    metadata = write_media_metadata(tmp_path / "metadata.csv", 6, 5)
    many = ",".join(["32x32:0.001"] * 100)
    for stages, said in (("32x32:0.0000001", "the stage 32x32:1e-07 gets none of this run's 12 optimizer steps"),
                         (many, "the stage 32x32:0.001 gets none of this run's 12 optimizer steps"),
                         ("64x64:0.5,32x32:0.01", "the stage 32x32:0.01 gets none"),
                         ("32x32:0.99", "the final size 96x96x9, after stages whose shares add up to 0.99, gets "
                                        "none of this run's 12 optimizer steps")):
        options = demo_options(tmp_path, "--dataset_metadata_path", str(metadata), "--resolution_stages", stages)
        with pytest.raises(OptionsError, match=f"^--resolution_stages: {re.escape(said)}"):
            plan_from_options(options, rows=11, images=5, world_size=2)
        printed = run_main(plan_main, ["--gpus", "2", "--brief", "--config", str(REPO / "configs" / "train_demo.yaml"),
                                       "--dataset_base_path", tmp_path, "--dataset_metadata_path", metadata,
                                       "--output_path", tmp_path / "out", "--height", "96", "--width", "96",
                                       "--resolution_stages", stages], tmp_path)
        assert printed.returncode == 2 and f"error: --resolution_stages: {said}" in printed.stderr, printed.stderr
    plan = plan_from_options(demo_options(tmp_path, "--resolution_stages", "32x32:0.95"), rows=11, images=5,
                             world_size=2)
    assert [(row["from_step"], row["to_step"]) for row in plan.stage_dicts()] == [(1, 11), (12, 12)]
