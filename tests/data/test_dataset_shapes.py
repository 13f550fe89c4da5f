"""The MBC dataset adapter keeps batches of one shape: a bad clip is replaced by the next clip, never an image."""

from __future__ import annotations

import pytest

from diffsynth_mbc.data.dataset import MBCVideoDataset, MediaDecodeError
from diffsynth_mbc.data.demo import prepare


@pytest.fixture(scope="module")
def catalogue(tmp_path_factory):
    root = tmp_path_factory.mktemp("shapes")
    metadata = prepare(root, num_videos=3, num_images=2)     # rows: 3 videos, then 2 images
    (root / "catalog" / "media" / "video_002.mp4").write_bytes(b"\x00\x00\x00\x18ftypmp42 broken" * 8)
    return root, metadata


def dataset(catalogue, substitute=True):
    root, metadata = catalogue
    return MBCVideoDataset(str(root / "catalog"), str(metadata), num_frames=9, height=64, width=64,
                           substitute_bad_media=substitute)


def test_rows_carry_their_shape_key(catalogue):
    assert dataset(catalogue).batch_keys() == ["video", "video", "video", "image", "image"]


def test_the_last_bad_video_is_replaced_by_a_video_not_the_image_after_it(catalogue):
    sample = dataset(catalogue)[2]
    assert len(sample["video"]) == 9                      # a clip of 9 frames, not a 1-frame image
    assert sample["row"] == 1                             # the next video, wrapping around
    assert [bad["row"] for bad in sample["skipped"]] == [3]


def test_without_substitution_the_bad_row_is_named(catalogue):
    with pytest.raises(MediaDecodeError, match=r"metadata row 3 \(media/video_002.mp4\)"):
        dataset(catalogue, substitute=False)[2]
