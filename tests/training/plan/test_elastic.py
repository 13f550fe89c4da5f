"""A resume on another number of processes, the pure parts: the rest of an epoch, the steps from there, the
schedules spread over them (training/plan/elastic.py, batches.rest_of_epoch, schedule.py)."""

from collections import Counter

import pytest

from diffsynth_mbc.training.plan.batches import ShapeGroupedBatchSampler, epoch_batches, rest_of_epoch
from diffsynth_mbc.training.plan.elastic import EpochSteps, describe_resume_elsewhere
from diffsynth_mbc.training.plan.schedule import StepSchedule
from diffsynth_mbc.training.plan.step_plan import lr_factor

# 23 videos and 14 images, twice each: batches of 2 videos or 5 images; neither divides evenly
KEYS = ["video"] * 23 + ["image"] * 14
SIZES = {"video": 2, "image": 5}


def trained_then_rest(parts, to_world, equal_load=False):
    """Every sample the parts trained, then what the rest trains, over the epoch of (KEYS, repeat 2, seed 3)."""
    batches = epoch_batches(KEYS, 2, SIZES, parts[0][0], 3, 1, None, equal_load)
    trained = []
    for index, (processes, done) in enumerate(parts):
        trained += [sample for batch in batches[:done * processes] for sample in batch]
        batches = rest_of_epoch(KEYS, 2, SIZES, parts[index + 1][0] if index + 1 < len(parts) else to_world, 3, 1,
                                None, equal_load, parts[:index + 1])
    return trained, batches


@pytest.mark.parametrize("parts, to_world", [
    ([(2, 5)], 1), ([(2, 5)], 3), ([(1, 9)], 2), ([(4, 1)], 8), ([(2, 0)], 3),
    ([(2, 5), (1, 4)], 3), ([(3, 2), (5, 1), (2, 1)], 4)])
def test_the_rest_of_an_epoch_trains_every_sample_not_trained_yet_once(parts, to_world):
    trained, rest = trained_then_rest(parts, to_world)
    epoch = set(range(len(KEYS) * 2))
    rest_samples = [sample for batch in rest for sample in batch]
    assert set(trained) | set(rest_samples) == epoch          # nothing skipped
    assert not set(trained) & set(rest_samples)                 # nothing trained twice
    assert len(rest) % to_world == 0                            # every rank the same number of batches
    padding = len(rest) - len({tuple(batch) for batch in rest})
    assert Counter(rest_samples).most_common(1)[0][1] == (2 if padding else 1)   # only the padding repeats
    for batch in rest:                                          # one shape per batch, within its size
        assert len({KEYS[sample % len(KEYS)] for sample in batch}) == 1
        assert len(batch) <= SIZES[KEYS[batch[0] % len(KEYS)]]


def test_the_rest_under_equal_load_gives_every_rank_the_same_shape_at_each_position():
    trained, rest = trained_then_rest([(2, 5)], 3, equal_load=True)
    assert set(trained) | {sample for batch in rest for sample in batch} == set(range(len(KEYS) * 2))
    for start in range(0, len(rest), 3):
        assert len({KEYS[batch[0] % len(KEYS)] for batch in rest[start:start + 3]}) == 1


def test_the_sampler_iterates_the_rest_of_the_resumed_epoch_and_whole_epochs_after_it():
    sampler = ShapeGroupedBatchSampler(KEYS, 2, SIZES, world_size=3, seed=3)
    whole = len(sampler)
    sampler.go_on_after(1, [(2, 5)])
    sampler.set_epoch(1)
    rest = list(sampler)
    assert len(rest) == len(sampler) < whole
    assert rest == [[sample + sampler.epoch_span for sample in batch] for batch in trained_then_rest([(2, 5)], 3)[1]]
    assert sampler.rank_batches(1, 2, [(2, 5)]) == len(rest_of_epoch(KEYS, 2, SIZES, 2, 3, 1, None, False,
                                                                      [(2, 5)])) // 2
    sampler.set_epoch(2)
    assert len(sampler) == whole and sampler.before(2) == ()


def test_epoch_steps_count_the_rest_then_whole_epochs():
    fresh = EpochSteps.fresh(batches_per_epoch=7, accumulation=2)
    assert [fresh.first_step(epoch) for epoch in range(4)] == [0, 4, 8, 12] and fresh.end_step(3) == 12
    # resumed at step 5 (epoch 1, 2 batches in), the epoch 7 batches per process: 3 steps left there
    resumed = EpochSteps(5, 1, 2, 7, 7, 2)
    assert resumed.first_step(1) == 4 and resumed.first_step(2) == 8 and resumed.end_step(3) == 12
    # on other processes at step 5: the rest of epoch 1 is 9 batches per process from its start, later ones 10
    moved = EpochSteps(5, 1, 0, 9, 10, 2)
    assert moved.steps_left_in_epoch == 5 and moved.first_step(2) == 10 and moved.end_step(3) == 15
    assert EpochSteps(12, 3, 0, 7, 7, 2).end_step(3) == 12   # every epoch trained


def test_the_schedule_is_the_plain_one_until_a_resume_elsewhere_then_spreads_what_is_left():
    schedule = StepSchedule(24, warmup_steps=3, kind="cosine")
    assert [schedule.lr_factor(step) for step in range(24)] == [lr_factor(step, 24, 3, "cosine") for step in range(24)]
    assert schedule.last_step == 24 and schedule.run_step(12) == 12
    before = schedule.lr_factor(10)
    schedule.spread_from(10, 38)    # 14 schedule steps left over 28 steps: a step is half of one before
    assert schedule.lr_factor(10) == before and schedule.last_step == 38
    assert schedule.schedule_step(24) == 17 and schedule.schedule_step(38) == 24
    assert schedule.lr_factor(24) == pytest.approx(lr_factor(17, 24, 3, "cosine"))
    assert schedule.run_step(17) == 24 and schedule.run_step(8) == 8 and schedule.run_step(24) == 38
    # a checkpoint keeps it; a later resume elsewhere goes on from where it stands
    again = StepSchedule(99)
    again.load_state_dict(schedule.state_dict())
    again.spread_from(24, 31)
    assert again.schedule_step(24) == 17 and again.schedule_step(31) == 24 and again.run_step(24) == 31
    again.end_at(30)    # a forced resume's own plan: one schedule step a step, to its end
    assert again.schedule_step(29) == 29 and again.last_step == 30


def test_the_resume_elsewhere_is_said_with_the_steps_before_and_now():
    line = describe_resume_elsewhere(2, 1, EpochSteps(18, 1, 0, 37, 73, 1), steps_left_before=18,
                                     steps_per_epoch_before=37, num_epochs=3)
    assert line == ("resumed on 1 GPU from a 2-GPU checkpoint: 37 steps left in epoch 2, was 18 per GPU; the later "
                    "epochs take 73 steps each (were 37); from step 18 the run ends at step 128; the learning-rate "
                    "schedule goes on by samples seen")
