"""Fixtures shared by the training's end-to-end tests."""

import pytest

from diffsynth_mbc.data.demo import prepare


@pytest.fixture(scope="module")
def demo_data(tmp_path_factory):
    """A demo catalogue of 6 clips and 5 images, and a validation catalogue of 2 and 2: (root, val)."""
    root = tmp_path_factory.mktemp("data")
    prepare(root, num_videos=6, num_images=5)
    val = prepare(root / "val", num_videos=2, num_images=2)
    return root, val
