"""``--buckets aspect`` on 2 CPU ranks from a latent cache: every step trains one bucket on both ranks, at that
bucket's shape, and the steps are those of the same run encoding every step."""

from __future__ import annotations

import pytest

from catalog_helpers import ONE_OF_EACH_SHAPE, write_media_catalogue
from e2e_helpers import build_demo_cache, demo_flags, read_history
from forked_ranks import run_training

pytestmark = pytest.mark.slow
# ONE_OF_EACH_SHAPE at --height 64 --width 128: the clips at 128x64 and 64x128, both images at 96x96
SHAPES = {(9, 64, 128), (9, 128, 64), (1, 96, 96)}   # [frames, height, width] of each bucket's samples


def train(work, root, name: str, *extra: str) -> list[list[dict]]:
    """Each rank's step records of a 1-epoch run (batches of 1 video or 2 images, every sample twice)."""
    flags = [*demo_flags(root, work / name, width=128, buckets="aspect", num_epochs=1, dataset_repeat=2,
                         gradient_accumulation_steps=1, image_batch_size=2), *extra]
    result = run_training(work / name, flags, timeout=300, OMP_NUM_THREADS=1)
    assert result.returncode == 0, result.stderr[-4000:]
    return [[line for line in read_history(work / name / "logs", rank) if "step" in line and "loss" in line]
            for rank in (0, 1)]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    work = tmp_path_factory.mktemp("buckets-cache-run")
    root = work / "data"
    metadata = write_media_catalogue(root, ONE_OF_EACH_SHAPE)
    build_demo_cache(root, metadata, work / "cache", "--width", "128", "--buckets", "aspect")
    return train(work, root, "cached", "--cache", str(work / "cache")), train(work, root, "encoding")


def test_every_step_trains_one_bucket_on_both_ranks_at_its_shape(runs):
    cached, _ = runs
    # Each bucket's samples (2 x 2 videos of a shape, 2 x 2 images) fill one batch on each rank: 3 steps.
    assert [[line["step"] for line in records] for records in cached] == [[1, 2, 3], [1, 2, 3]]
    seen = set()
    for first, second in zip(*cached):
        shapes = {tuple(shape) for line in (first, second) for shape in line["shapes"]}
        assert len(shapes) == 1, (first, second)   # one bucket at a time, on every rank
        seen |= shapes
    assert seen == SHAPES


def test_the_cached_run_trains_what_the_encoding_run_trains(runs):
    cached, encoding = runs
    for from_cache, from_media in zip(cached, encoding):
        assert [line["shapes"] for line in from_cache] == [line["shapes"] for line in from_media]
        assert [line["timesteps"] for line in from_cache] == [line["timesteps"] for line in from_media]
        assert [line["loss"] for line in from_cache] == pytest.approx([line["loss"] for line in from_media],
                                                                      rel=1e-4)
