"""The training modes chosen per sample (``training/step/objective.py``), their options, their counts in the step plan
and the resume fingerprint. Pure: no torch."""

from __future__ import annotations

import pytest

from diffsynth_mbc.errors import OptionsError
from diffsynth_mbc.training.checkpoints.fingerprint import fingerprint_differences, run_fingerprint
from diffsynth_mbc.training.options import resolve_options
from diffsynth_mbc.training.plan.step_plan import StepPlan, plan_from_options
from diffsynth_mbc.training.step.objective import (check_mode, default_mode, modes_per_epoch, training_mode,
                                                   validation_mode)

REQUIRED = ["--dataset_base_path", "data", "--dataset_metadata_path", "data/metadata.csv"]


def modes(probability, objective="modes", is_image=False, count=4000, rank=0, epoch=0):
    return [training_mode(objective, probability, is_image, 42, rank, epoch, batch, place)
            for batch in range(count // 2) for place in range(2)]


def test_images_train_t2i_and_videos_i2v_by_default():
    assert set(modes(1.0, is_image=True)) == {"t2i"} and set(modes(1.0)) == {"i2v"}
    assert set(modes(0.5, is_image=True)) == {"t2i"} and set(modes(0.0)) == {"t2v"}
    assert default_mode("modes", True) == "t2i" and default_mode("modes", False) == "i2v"


def test_objective_diffsynth_conditions_every_sample():
    assert set(modes(1.0, "diffsynth", is_image=True)) == {"i2v"} and set(modes(1.0, "diffsynth")) == {"i2v"}
    assert default_mode("diffsynth", True) == "i2v"


def test_the_i2v_share_follows_the_probability_and_the_choice_is_a_function_of_the_samples_place():
    chosen = modes(0.3)
    assert chosen.count("i2v") / len(chosen) == pytest.approx(0.3, abs=0.03)
    assert modes(0.3) == chosen                        # the same on a resume: nothing drawn from an RNG
    assert modes(0.3, rank=1) != chosen and modes(0.3, epoch=1) != chosen
    assert modes(0.5).count("i2v") / len(chosen) == pytest.approx(0.5, abs=0.03)


def test_a_validation_samples_mode_is_fixed_for_the_run():
    first = [validation_mode("modes", 0.5, False, 7, index) for index in range(400)]
    assert first == [validation_mode("modes", 0.5, False, 7, index) for index in range(400)]
    assert 0.4 < first.count("i2v") / 400 < 0.6
    assert validation_mode("modes", 0.5, True, 7, 3) == "t2i"


@pytest.mark.parametrize("objective, mode, is_image, message", [
    ("modes", "t2i", False, "a clip cannot train t2i"),
    ("modes", "t2v", True, "one latent frame"),
    ("modes", "i2x", False, "unknown training mode"),
    ("diffsynth", "t2v", False, "--objective diffsynth trains every sample i2v"),
])
def test_a_mode_the_sample_cannot_train_in_is_refused(objective, mode, is_image, message):
    with pytest.raises(ValueError, match=message):
        check_mode(objective, mode, is_image)


def test_the_options_default_to_the_corrected_objective_and_every_sample_conditioned():
    options = resolve_options(REQUIRED)
    assert (options.objective, options.i2v_probability) == ("modes", 1.0)
    options = resolve_options(REQUIRED + ["--objective", "diffsynth"])
    assert options.objective == "diffsynth"
    assert resolve_options(REQUIRED + ["--i2v-probability", "0.5"]).i2v_probability == 0.5


@pytest.mark.parametrize("flags, named", [
    (["--objective", "videox"], "--objective must be one of modes, diffsynth"),
    (["--i2v_probability", "1.5"], "--i2v_probability must be a finite number between 0 and 1"),
    (["--i2v_probability", "nan"], "--i2v_probability"),
    (["--objective", "diffsynth", "--i2v_probability", "0.5"], "--i2v_probability 0.5 applies to --objective modes"),
])
def test_bad_objective_options_name_the_flag(flags, named):
    with pytest.raises(OptionsError, match=named):
        resolve_options(REQUIRED + flags)


def test_the_step_plan_counts_each_modes_samples_per_epoch():
    plan = StepPlan(rows=170_180, repeat=1, world_size=2, batch_size=1, gradient_accumulation=1, num_epochs=5,
                    images=90_180, image_batch_size=5)
    assert plan.modes_per_epoch == {"t2i": 90_180, "i2v": 80_000, "t2v": 0}
    assert plan.as_dict()["modes_per_epoch"] == plan.modes_per_epoch
    assert "modes per epoch: 90,180 t2i (images) + 80,000 i2v" in plan.describe()
    mixed = StepPlan(rows=30, repeat=2, world_size=1, batch_size=1, gradient_accumulation=1, num_epochs=1, images=10,
                     i2v_probability=0.5)
    assert mixed.modes_per_epoch == {"t2i": 20, "i2v": 20, "t2v": 20}
    assert "about 20 i2v + about 20 t2v" in mixed.describe_modes()
    old = StepPlan(rows=30, repeat=1, world_size=1, batch_size=1, gradient_accumulation=1, num_epochs=1, images=10,
                   objective="diffsynth")
    assert old.modes_per_epoch == {"t2i": 0, "i2v": 30, "t2v": 0} and "--objective diffsynth" in old.describe_modes()


def test_the_plan_from_options_batches_images_as_the_training_does():
    options = resolve_options(REQUIRED + ["--i2v_probability", "0.25", "--num_frames", "17"])
    plan = plan_from_options(options, rows=100, images=60, world_size=2)
    assert plan.image_batch_size == 5 and plan.i2v_probability == 0.25
    assert plan.modes_per_epoch == {"t2i": 60, "i2v": 10, "t2v": 30}


def fingerprint(options):
    return run_fingerprint(options, world_size=1, accumulation=1, rows=10, metadata_sha256="x", image_batch=1,
                           precision="no")


def test_a_resume_with_another_objective_is_refused_and_an_old_checkpoint_trained_diffsynths():
    modes_run = fingerprint(resolve_options(REQUIRED))
    mixed = fingerprint(resolve_options(REQUIRED + ["--i2v_probability", "0.5"]))
    assert [line.split(":")[0] for line in fingerprint_differences(modes_run, mixed)] == ["objective"]
    before = {key: value for key, value in modes_run.items() if key != "objective"}
    differences = fingerprint_differences(before, modes_run)
    assert len(differences) == 1 and "saved before the setting existed" in differences[0]
    assert fingerprint_differences(before, fingerprint(resolve_options(REQUIRED + ["--objective", "diffsynth"]))) == []


def test_an_epochs_counts_add_up():
    counts = modes_per_epoch("modes", 0.37, video_samples=1001, image_samples=5)
    assert sum(counts.values()) == 1006 and counts["t2i"] == 5
