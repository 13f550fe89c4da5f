"""Aspect-ratio buckets: the set at one pixel area, the nearest bucket, what a crop keeps. Pure Python."""

import math

import pytest

from diffsynth_mbc.data.media.buckets import (Bucket, bucket_counts, bucket_of_key, bucket_set, kept_fraction,
                                              nearest_bucket, parse_bucket, sample_key)


def test_the_full_size_set_has_both_orientations_a_square_and_sides_divisible_by_32():
    buckets = bucket_set(704, 1280)
    names = [bucket.name for bucket in buckets]
    assert "1280x704" in names and "704x1280" in names and "960x960" in names
    assert all(b.height % 32 == 0 and b.width % 32 == 0 for b in buckets)
    assert all(abs(b.area - 704 * 1280) / (704 * 1280) < 0.05 for b in buckets if b.width != b.height)
    assert all(1 / 2.5 <= b.aspect <= 2.5 for b in buckets)
    assert len({round(b.aspect, 6) for b in buckets}) == len(buckets)   # one bucket per aspect
    assert [b.aspect for b in buckets] == sorted(b.aspect for b in buckets)


@pytest.mark.parametrize("size, expected", [((1280, 720), "1280x704"), ((720, 1280), "704x1280"),
                                            ((1920, 1080), "1280x704"), ((1080, 1920), "704x1280"),
                                            ((1000, 1000), "960x960"), ((640, 480), "1088x832")])
def test_each_picture_goes_to_the_bucket_nearest_its_aspect(size, expected):
    assert nearest_bucket(bucket_set(704, 1280), *size).name == expected


def test_inside_the_range_the_crop_takes_no_more_than_the_rounding():
    buckets = bucket_set(704, 1280)
    worst = max(1 - kept_fraction(w, h, nearest_bucket(buckets, w, h))
                for w in range(480, 2000, 37) for h in range(480, 2000, 41) if 0.4 <= w / h <= 2.5)
    assert worst < 0.04


def test_off_keeps_a_third_of_a_portrait_clip():
    assert round(kept_fraction(720, 1280, Bucket(704, 1280)), 2) == 0.31
    assert kept_fraction(1280, 720, Bucket(704, 1280)) == pytest.approx(704 / 720)
    assert math.isclose(kept_fraction(1280, 704, Bucket(704, 1280)), 1.0)


def test_names_and_keys_read_back():
    assert parse_bucket("1280x704") == Bucket(704, 1280) and Bucket(704, 1280).orientation == "landscape"
    assert sample_key("video", Bucket(704, 1280)) == "video@1280x704" and sample_key("image", None) == "image"
    assert bucket_of_key("image@960x960") == Bucket(960, 960) and bucket_of_key("video") is None
    assert bucket_counts([Bucket(704, 1280), Bucket(1280, 704), Bucket(704, 1280)]) == {"704x1280": 1, "1280x704": 2}


def test_a_size_that_is_not_a_multiple_of_32_is_refused_naming_both_flags():
    with pytest.raises(ValueError, match="--height 700 and --width 1280"):
        bucket_set(700, 1280)


def test_a_tiny_training_size_still_gives_landscape_portrait_and_square():
    assert [b.name for b in bucket_set(64, 128)] == ["64x160", "64x128", "96x96", "128x64", "160x64"]


def test_every_training_size_has_a_square_bucket_as_the_docs_say():
    """At 128x96 square images went to the 128x96 bucket (a quarter of each cropped away): no square was within 15%
    of the area, and the set left it out, where docs/training.md lists one at every size."""
    buckets = bucket_set(96, 128)
    assert [b.name for b in buckets] == ["64x160", "96x128", "96x96", "128x96", "160x64"]
    assert nearest_bucket(buckets, 100, 100) == Bucket(96, 96)
    assert all(any(b.width == b.height for b in bucket_set(h, w))
               for h in range(32, 1313, 32) for w in range(32, 1313, 32))
