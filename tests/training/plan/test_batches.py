"""Shape-grouped batches (pure): every sample once per epoch, one shape per batch, the same on every rank and on
resume, and counted by the step plan exactly as the loader deals them."""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from diffsynth_mbc.data.media.shapes import IMAGE, VIDEO, shape_key
from diffsynth_mbc.training.plan.batches import (ShapeGroupedBatchSampler, batches_per_rank, default_image_batch_size,
                                                 epoch_batches)
from diffsynth_mbc.training.plan.step_plan import StepPlan

KEYS = [VIDEO] * 7 + [IMAGE] * 11
SIZES = {VIDEO: 2, IMAGE: 5}


def check_epoch(keys, repeat, sizes, world, seed, epoch):
    batches = epoch_batches(keys, repeat, sizes, world, seed, epoch)
    rows = len(keys)
    assert len(batches) % world == 0
    assert len(batches) == batches_per_rank(keys, repeat, sizes, world) * world
    unpadded = sum(-(-count * repeat // sizes[key]) for key, count in Counter(keys).items())
    real, padding = batches[:unpadded], batches[unpadded:]
    seen = sorted(i for batch in real for i in batch)
    assert seen == list(range(rows * repeat))                         # every sample exactly once
    for batch in batches:
        assert len({keys[i % rows] for i in batch}) == 1               # one shape per batch
        assert 1 <= len(batch) <= sizes[keys[batch[0] % rows]]
    assert all(batch in real for batch in padding)                     # padding repeats real batches
    return batches


def test_an_epoch_holds_every_sample_once_in_batches_of_one_shape():
    batches = check_epoch(KEYS, 2, SIZES, 2, seed=42, epoch=0)
    sizes = Counter((KEYS[b[0] % len(KEYS)], len(b)) for b in batches[:12])
    assert sizes[(VIDEO, 2)] == 7 and sizes[(IMAGE, 5)] == 4 and sizes[(IMAGE, 2)] == 1


def test_the_same_seed_and_epoch_give_the_same_batches_and_epochs_differ():
    first = epoch_batches(KEYS, 1, SIZES, 2, seed=42, epoch=3)
    assert epoch_batches(KEYS, 1, SIZES, 2, seed=42, epoch=3) == first
    assert epoch_batches(KEYS, 1, SIZES, 2, seed=42, epoch=4) != first
    assert epoch_batches(KEYS, 1, SIZES, 2, seed=7, epoch=3) != first


def test_the_sampler_follows_set_epoch_and_its_length_is_every_ranks_batches():
    sampler = ShapeGroupedBatchSampler(KEYS, 1, SIZES, world_size=2, seed=1)
    sampler.set_epoch(5)
    samples = len(KEYS)
    # Each index carries its epoch: index % samples is the sample, index // samples the epoch.
    assert [[index % samples for index in batch] for batch in sampler] == epoch_batches(KEYS, 1, SIZES, 2, 1, 5)
    assert {index // samples for batch in sampler for index in batch} == {5}
    assert len(sampler) == len(list(sampler))


def test_the_step_plan_counts_the_batches_the_loader_deals():
    for world in (1, 2, 3, 8):
        plan = StepPlan(rows=len(KEYS), repeat=2, world_size=world, batch_size=2, gradient_accumulation=3,
                        num_epochs=5, images=KEYS.count(IMAGE), image_batch_size=5)
        assert plan.batches_per_epoch == batches_per_rank(KEYS, 2, SIZES, world)
        assert plan.steps_per_epoch == -(-plan.batches_per_epoch // 3)


def test_default_image_batch_has_one_videos_tokens():
    assert default_image_batch_size(1, 17) == 5 and default_image_batch_size(2, 9) == 6
    assert default_image_batch_size(1, 1) == 1


def test_shape_keys_from_media_type_or_extension():
    assert shape_key("Video") == VIDEO and shape_key("IMAGE ") == IMAGE
    assert shape_key(None, "a/b.JPG") == IMAGE and shape_key("", "clip.mp4") == VIDEO


def test_a_key_without_a_batch_size_is_named():
    with pytest.raises(ValueError, match="no batch size for samples of shape 'image'"):
        epoch_batches(KEYS, 1, {VIDEO: 1}, 1, 0, 0)


@settings(max_examples=60, deadline=None)
@given(videos=st.integers(0, 30), images=st.integers(0, 30), repeat=st.integers(1, 3), video_batch=st.integers(1, 4),
       image_batch=st.integers(1, 6), world=st.integers(1, 5), epoch=st.integers(0, 3))
def test_any_catalogue_is_batched_without_loss(videos, images, repeat, video_batch, image_batch, world, epoch):
    keys = [VIDEO] * videos + [IMAGE] * images
    if not keys:
        return
    check_epoch(keys, repeat, {VIDEO: video_batch, IMAGE: image_batch}, world, seed=3, epoch=epoch)
    plan = StepPlan(rows=len(keys), repeat=repeat, world_size=world, batch_size=video_batch, gradient_accumulation=1,
                    num_epochs=1, images=images, image_batch_size=image_batch)
    assert plan.batches_per_epoch == batches_per_rank(keys, repeat, {VIDEO: video_batch, IMAGE: image_batch}, world)


# --- equal load (--buckets aspect): every rank on one bucket at a time ------------------------------------------

from diffsynth_mbc.training.plan.batches import equal_load_repeats, key_samples  # noqa: E402

BUCKET_KEYS = ["video@128x64"] * 5 + ["video@64x128"] * 2 + ["image@96x96"] * 7


@pytest.mark.parametrize("world_size", [1, 2, 3])
@pytest.mark.parametrize("epoch", [0, 1])
def test_every_rank_trains_the_same_bucket_at_every_position_with_full_batches(world_size, epoch):
    sizes = {"video": 2, "image": 3}
    batches = epoch_batches(BUCKET_KEYS, 1, sizes, world_size, seed=7, epoch=epoch, equal_load=True)
    assert len(batches) == batches_per_rank(BUCKET_KEYS, 1, sizes, world_size, equal_load=True) * world_size
    for start in range(0, len(batches), world_size):
        group = batches[start:start + world_size]
        keys = {BUCKET_KEYS[index] for batch in group for index in batch}
        assert len(keys) == 1, group
        assert {len(batch) for batch in group} == {sizes[keys.pop().partition("@")[0]]}
    seen = [index for batch in batches for index in batch]
    assert set(seen) == set(range(len(BUCKET_KEYS)))   # nothing dropped
    repeated = sum(equal_load_repeats(n, sizes[key.partition("@")[0]], world_size)
                   for key, n in key_samples(BUCKET_KEYS, 1).items())
    assert len(seen) - len(BUCKET_KEYS) == repeated


def test_equal_load_batches_are_the_same_for_a_seed_and_epoch_and_differ_between_epochs():
    sizes = {"video": 1, "image": 2}
    first = epoch_batches(BUCKET_KEYS, 2, sizes, 2, seed=3, epoch=0, equal_load=True)
    assert first == epoch_batches(BUCKET_KEYS, 2, sizes, 2, seed=3, epoch=0, equal_load=True)
    assert first != epoch_batches(BUCKET_KEYS, 2, sizes, 2, seed=3, epoch=1, equal_load=True)


def test_without_equal_load_the_batches_are_what_they_always_were():
    keys = ["video"] * 5 + ["image"] * 4
    assert epoch_batches(keys, 1, {"video": 2, "image": 3}, 2, seed=0, epoch=0) == \
        epoch_batches(keys, 1, {"video": 2, "image": 3}, 2, seed=0, epoch=0, equal_load=False)


def test_a_catalogues_repeat_gives_each_copy_of_a_row_its_own_draw_in_every_epoch():
    """Row 0's catalogue repeats 3 times: its second copy in epoch 0 and its first in epoch 1 had the same loader
    index, so random_window drew them the same window (the epoch offset was rows x repeat)."""
    from diffsynth_mbc.data.sample_draws import sample_place
    from diffsynth_mbc.training.plan.batches import ShapeGroupedBatchSampler

    keys = ["video", "video", "image"]
    sampler = ShapeGroupedBatchSampler(keys, 1, {"video": 1, "image": 1}, 1, seed=7, row_repeats=[3, 1, 1])
    assert sampler.epoch_span == 3 * 3
    places = []
    for epoch in (0, 1):
        sampler.set_epoch(epoch)
        indices = [index for batch in sampler for index in batch]
        assert sorted(index % 3 for index in indices) == [0, 0, 0, 1, 2]
        for index in indices:
            at, sample, copy = sample_place(index, sampler.epoch_span, len(keys))
            assert at == epoch and sample % len(keys) == index % len(keys)
            places.append((at, sample))
    assert len(set(places)) == len(places)
