import math

import pytest

from diffsynth_mbc.training.plan.step_plan import StepPlan, lr_factor, steps_from_loader


def test_the_users_test_run_is_2500_steps_per_gpu_not_5000():
    plan = StepPlan(rows=5000, repeat=1, world_size=2, batch_size=1, gradient_accumulation=1, num_epochs=1)
    assert plan.samples_per_rank_per_epoch == 2500
    assert plan.total_steps == 2500


def test_the_users_full_run():
    plan = StepPlan(rows=170_180, repeat=1, world_size=2, batch_size=1, gradient_accumulation=1, num_epochs=5)
    assert plan.steps_per_epoch == 85_090
    assert plan.total_steps == 425_450


@pytest.mark.parametrize("rows,repeat,world,batch,accum,epochs,expected_per_epoch", [
    (11, 2, 2, 1, 2, 2, 6),    # the demo: 22 samples -> 11 per rank -> 6 steps (last one partial)
    (5, 1, 2, 1, 1, 1, 3),     # odd rows: the sampler pads the last round
    (7, 3, 4, 2, 3, 1, 1),     # 21 -> 6 per rank -> 3 batches -> 1 step
    (1, 1, 8, 1, 1, 4, 1),     # fewer rows than ranks still gives each rank a step
    (100, 10, 2, 1, 4, 5, 125),
])
def test_formula(rows, repeat, world, batch, accum, epochs, expected_per_epoch):
    plan = StepPlan(rows, repeat, world, batch, accum, epochs)
    per_rank = math.ceil(rows * repeat / world)
    assert plan.steps_per_epoch == math.ceil(math.ceil(per_rank / batch) / accum) == expected_per_epoch
    assert plan.total_steps == expected_per_epoch * epochs
    assert steps_from_loader(plan.batches_per_epoch, accum, epochs) == (plan.steps_per_epoch, plan.total_steps)


def test_zero_rows_means_zero_steps():
    assert StepPlan(0, 1, 2, 1, 1, 3).total_steps == 0


@pytest.mark.parametrize("field", ["repeat", "world_size", "batch_size", "gradient_accumulation", "num_epochs"])
def test_rejects_non_positive_settings(field):
    values = dict(rows=10, repeat=1, world_size=1, batch_size=1, gradient_accumulation=1, num_epochs=1)
    values[field] = 0
    with pytest.raises(ValueError, match=field):
        StepPlan(**values)


def test_describe_names_every_number():
    text = StepPlan(5000, 1, 2, 1, 1, 1).describe()
    assert "5,000 rows" in text and "2 GPU(s)" in text and "2,500 optimizer steps per GPU per epoch" in text


def test_constant_schedule_with_warmup():
    factors = [lr_factor(step, total_steps=10, warmup_steps=3) for step in range(10)]
    assert factors[:3] == [0.25, 0.5, 0.75]
    assert factors[3:] == [1.0] * 7


def test_cosine_schedule_decays_to_the_floor():
    factors = [lr_factor(step, total_steps=12, warmup_steps=2, schedule="cosine", min_factor=0.1) for step in range(13)]
    assert factors[2] == pytest.approx(1.0)
    assert all(a >= b for a, b in zip(factors[2:], factors[3:]))
    assert factors[12] == pytest.approx(0.1)


def test_unknown_schedule_is_named():
    with pytest.raises(ValueError, match="'linear'"):
        lr_factor(0, 10, schedule="linear")


def test_with_buckets_each_bucket_is_counted_on_its_own_and_its_repeats_said():
    plan = StepPlan(rows=14, repeat=1, world_size=2, batch_size=2, gradient_accumulation=1, num_epochs=3,
                    images=7, image_batch_size=3,
                    bucket_samples=(("image@96x96", 7), ("video@128x64", 5), ("video@64x128", 2)))
    # images: 3 batches -> 2 groups of 2 GPUs; 128x64: 3 batches -> 2 groups; 64x128: 1 batch -> 1 group
    assert plan.batches_per_epoch == 2 + 2 + 1 and plan.total_steps == 15
    rows = {row["key"]: row for row in plan.bucket_dicts()}
    assert rows["image@96x96"]["repeated_samples"] == 2 * 2 * 3 - 7 and rows["video@64x128"]["repeated_samples"] == 2
    assert plan.samples_per_rank_per_epoch == 2 * 3 + 2 * 2 + 1 * 2
    lines = plan.describe_buckets()
    assert lines[0].startswith("buckets (aspect): 3 in use; every GPU trains one bucket at a time; 10 sample(s)")
    assert any("96x96 images" in line and "(+5 repeated)" in line for line in lines)
    assert not any("note:" in line for line in lines)   # three shapes: no single-shape note
    assert "bucket_samples" in plan.as_dict()
    assert "bucket_samples" not in StepPlan(rows=14, repeat=1, world_size=2, batch_size=2, gradient_accumulation=1,
                                            num_epochs=3).as_dict()


def test_at_an_area_whose_buckets_are_one_shape_the_plan_says_every_sample_is_cropped_to_it():
    """The demo's 64x64: portrait, landscape and square all round to 64x64; "2 in use" are clips and images."""
    plan = StepPlan(rows=5, repeat=1, world_size=2, batch_size=1, gradient_accumulation=1, num_epochs=1, images=2,
                    image_batch_size=2, bucket_samples=(("image@64x64", 2), ("video@64x64", 3)))
    assert plan.describe_buckets()[-1] == ("  note: at 64x64 the aspect buckets hold this one shape: every sample, "
                                           "portrait and landscape alike, is cropped to it (a larger --height x "
                                           "--width has a bucket per aspect)")


def test_a_resumed_run_ends_at_the_plans_total_unless_a_forced_resume_changed_the_plan():
    """``--force_resume true`` after the media changed size ended ``finished: 5/4 steps``: the checkpoint's 3 steps
    were counted under a plan of 3 steps per epoch, this plan has 2."""
    from diffsynth_mbc.training.plan.elastic import EpochSteps

    def end_step(step, epoch, batches_done, batches_per_epoch, accumulation, num_epochs):
        return EpochSteps(step, epoch, batches_done, batches_per_epoch, batches_per_epoch,
                          accumulation).end_step(num_epochs)

    # the same plan: 5 batches per epoch, accumulation 2 (3 steps per epoch), 2 epochs
    assert end_step(0, 0, 0, 5, 2, 2) == 6
    assert end_step(2, 0, 4, 5, 2, 2) == 6 and end_step(3, 1, 0, 5, 2, 2) == 6 and end_step(6, 2, 0, 5, 2, 2) == 6
    # the checkpoint's plan had 3 steps per epoch; this one has 2 (4 batches): from step 3 (epoch 2) to step 5
    assert end_step(3, 1, 0, 4, 2, 2) == 5
    # mid-epoch, more batches done than this plan's epoch holds: the epoch is over
    assert end_step(2, 0, 4, 3, 2, 2) == 4


def test_each_stage_line_counts_its_steps_in_words_that_fit_one_step():
    from diffsynth_mbc.data.media.stages import Stage

    plan = StepPlan(2, 1, 1, 1, 1, 1, stages=(Stage(32, 32, None, 0.5),), final_size=(64, 64, 9))
    assert [line.split(", ")[1] for line in plan.describe_stages()] == ["step 1 (1 step)", "step 2 (1 step)"]
    plan = StepPlan(4000, 1, 1, 1, 1, 1, stages=(Stage(32, 32, None, 0.5),), final_size=(64, 64, 9))
    assert [line.split(", ")[1] for line in plan.describe_stages()] == ["steps 1-2,000 (2,000 steps)",
                                                                        "steps 2,001-4,000 (2,000 steps)"]
