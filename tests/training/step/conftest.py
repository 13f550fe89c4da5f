"""The step tests' shared data: cache entries of the demo's clips and images, built once per test module."""

import pytest

from diffsynth_mbc.data.cache.dataset import CachedLatentDataset
from diffsynth_mbc.data.demo import prepare
from e2e_helpers import build_demo_cache
from tiny_step import SEED


@pytest.fixture(scope="module")
def entries(tmp_path_factory):
    """Cache entries of 3 demo videos and 3 images (64x64, 9 frames): same-shape groups to batch."""
    root = tmp_path_factory.mktemp("step")
    metadata = prepare(root, num_videos=3, num_images=3)
    cache_dir = root / "cache"
    build_demo_cache(root, metadata, cache_dir, seed=SEED)
    dataset = CachedLatentDataset(cache_dir)
    samples = [dataset[i] for i in range(dataset.rows)]
    videos = [s for s in samples if s["input_latents"].shape[1] > 1]
    images = [s for s in samples if s["input_latents"].shape[1] == 1]
    assert len(videos) == 3 and len(images) == 3
    return videos, images
