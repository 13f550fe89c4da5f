"""convert --probe --buckets off|aspect: the orientation and aspect mix, what centre-cropping discards, and which
rows are flagged as small or cropped, on real media files.

The training size here is 288x160 (--height 160 --width 288): its buckets include 288x160, 160x288, 224x224 and
256x192, so 16:9, 9:16, square and 4:3 pictures each have a shape within a few percent of their aspect (at 128x64
the 32-pixel lattice is too coarse: a 16:9 clip would lose 11% to the nearest bucket).
"""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pytest

from catalog_helpers import read_csv_records, write_catalog
from diffsynth_mbc.data.convert import main
from diffsynth_mbc.data.demo_data import write_image, write_video
from diffsynth_mbc.data.media.buckets import Bucket, bucket_set, kept_fraction, nearest_bucket

TRAINING = Bucket(160, 288)
SIZES = {   # file: (width, height)
    "landscape.mp4": (288, 162), "portrait.mp4": (162, 288), "square.png": (64, 64), "four_three.png": (80, 60),
    "phone.png": (1080, 1920), "panorama.png": (480, 160),
}


@pytest.fixture(scope="module")
def catalogue(tmp_path_factory) -> Path:
    base = tmp_path_factory.mktemp("aspect")
    rows = []
    for name, (width, height) in SIZES.items():
        if name.endswith(".mp4"):
            write_video(base / name, num_frames=17, width=width, height=height)
        else:
            write_image(base / name, width, height)
        rows.append((name, f"a {name}", "video" if name.endswith(".mp4") else "image"))
    write_catalog(base / "c.csv", rows)
    return base


def run_convert(base: Path, out: Path, buckets: str) -> dict:
    assert main([str(base / "c.csv"), "--base-path", str(base), "--output", str(out), "--probe", "--workers", "2",
                 "--height", "160", "--width", "288", "--buckets", buckets]) == 0
    assert sorted(pd.read_csv(out / "metadata.csv")["video"]) == sorted(SIZES)   # a report, never a rejection
    return json.loads((out / "summary.json").read_text(encoding="utf-8"))["probe"]


def flags(out: Path, flag: str) -> dict[str, str]:
    return {r["file_path"]: r["detail"] for r in read_csv_records(out / "flagged.csv") if r["reason"] == flag}


def mean_discarded(target_of) -> float:
    return round(sum(1 - kept_fraction(w, h, target_of(w, h)) for w, h in SIZES.values()) / len(SIZES), 4)


BUCKETS = bucket_set(160, 288)
DISCARDED_AT_BUCKETS = mean_discarded(lambda w, h: nearest_bucket(BUCKETS, w, h))
DISCARDED_AT_TRAINING_SIZE = mean_discarded(lambda w, h: TRAINING)


def test_off_flags_every_crop_that_keeps_under_90_percent_and_shows_what_buckets_would_save(catalogue, tmp_path,
                                                                                           capsys):
    probe = run_convert(catalogue, tmp_path / "off", "off")
    aspect = probe["aspect"]
    assert aspect["buckets"] == "off" and aspect["training_size"] == "288x160"
    assert aspect["orientations"] == {"landscape": 3, "portrait": 2, "square": 1}
    assert aspect["rows_per_bucket"] == {"288x160": 6}
    assert aspect["discarded"] == {
        "off": {"mean_share": DISCARDED_AT_TRAINING_SIZE, "rows_over_10_percent": 5},
        "aspect": {"mean_share": DISCARDED_AT_BUCKETS, "rows_over_10_percent": 1},
    }
    assert DISCARDED_AT_TRAINING_SIZE > 0.4 > 0.05 > DISCARDED_AT_BUCKETS

    portrait_keeps = round(100 * kept_fraction(162, 288, TRAINING))
    assert portrait_keeps == 31
    cropped = flags(tmp_path / "off", "cropped media")
    assert cropped["portrait.mp4"] == f"portrait clip, cropping to 288x160 keeps {portrait_keeps}%"
    assert cropped["phone.png"] == f"portrait image, cropping to 288x160 keeps {portrait_keeps}%"
    square_keeps = round(100 * kept_fraction(64, 64, TRAINING))
    assert cropped["square.png"] == f"square image, cropping to 288x160 keeps {square_keeps}%"
    assert set(cropped) == set(SIZES) - {"landscape.mp4"} and probe["flagged_cropped_media"] == 5
    # The wrong orientation is no longer "small": the portrait clip and the 1080x1920 image cover 160x288.
    assert set(flags(tmp_path / "off", "small media")) == {"square.png", "four_three.png"}

    err = " ".join(capsys.readouterr().err.split())
    assert "orientation: 3 landscape, 2 portrait, 1 square" in err
    assert "rows per shape (--buckets off: all at 288x160): 288x160: 6" in err
    assert "5 files lose more than 10% of their frame to cropping (--buckets off)" in err
    assert "portrait.mp4 (portrait clip, cropping to 288x160 keeps 31%)" in err
    assert err.count("2 files would train upscaled by more than 1.1x to 288x160 in their orientation") == 1
    assert err.count("they train blurrier than the rest: re-export them from a larger source") == 1
    assert "sized for --width 288 --height 160 " in err and "assumed" not in err   # the size it was given


def test_small_media_says_the_size_it_assumed_and_the_flags_that_change_it(catalogue, tmp_path, capsys):
    """Without --width/--height "small media" measured against 1280x704 without saying so."""
    assert main([str(catalogue / "c.csv"), "--base-path", str(catalogue), "--output", str(tmp_path / "out"),
                 "--probe", "--workers", "2"]) == 0
    err = " ".join(capsys.readouterr().err.split())
    said = ("sized for --width 1280 --height 704, assumed (the default: the presets' size); for a run at another size "
            "give its --width and --height")
    assert "files would train upscaled by more than 1.1x to their bucket" in err and said in err, err
    assert json.loads((tmp_path / "out" / "summary.json").read_text())["probe"]["sized_for"] == said


def test_only_an_upscale_of_more_than_a_tenth_is_small():
    """23 of 26 real rows were flagged small, a 2% upscale among them, which trains within 1 dB of a file 2% too
    large (benchmarks/bench_upscale.py: a 10% upscale doubles the error)."""
    from diffsynth_mbc.data.convert.aspect_mix import TrainingShapes
    from diffsynth_mbc.data.media.media_probe import MediaInfo

    shapes = TrainingShapes("aspect", Bucket(704, 1280), (Bucket(704, 1280),))
    assert shapes.small(MediaInfo(1256, 691, 1, None)) is None          # 1.02x
    assert shapes.small(MediaInfo(1164, 640, 1, None)) is None          # 1.1x: the threshold itself
    assert shapes.small(MediaInfo(1140, 627, 1, None)) == "1140x627, smaller than its bucket 1280x704 (upscaled 1.1x)"
    assert shapes.small(MediaInfo(640, 352, 1, None)) == "640x352, smaller than its bucket 1280x704 (upscaled 2x)"


def test_aspect_trains_each_row_near_its_own_aspect_and_flags_only_what_is_outside_the_buckets(catalogue, tmp_path):
    probe = run_convert(catalogue, tmp_path / "aspect", "aspect")
    aspect = probe["aspect"]
    assert aspect["buckets"] == "aspect"
    assert aspect["orientations"] == {"landscape": 3, "portrait": 2, "square": 1}
    assert aspect["rows_per_bucket"] == {"160x288": 2, "224x224": 1, "256x192": 1, "288x160": 1, "320x128": 1}
    assert list(aspect["discarded"]) == ["aspect", "off"]
    assert aspect["discarded"]["aspect"] == {"mean_share": DISCARDED_AT_BUCKETS, "rows_over_10_percent": 1}
    assert aspect["discarded"]["off"] == {"mean_share": DISCARDED_AT_TRAINING_SIZE, "rows_over_10_percent": 5}

    # Only the 3:1 panorama, wider than the widest bucket (2.5:1), still loses more than 10%.
    keeps = round(100 * kept_fraction(480, 160, Bucket(128, 320)))
    assert flags(tmp_path / "aspect", "cropped media") == {
        "panorama.png": f"landscape image, cropping to 320x128 keeps {keeps}%"}
    small = flags(tmp_path / "aspect", "small media")
    assert small == {"square.png": "64x64, smaller than its bucket 224x224 (upscaled 3.5x)",
                     "four_three.png": "80x60, smaller than its bucket 256x192 (upscaled 3.2x)"}
    assert probe["flagged_small_media"] == 2 and "phone.png" not in small


def test_help_names_buckets_and_a_training_size_off_the_32_pixel_grid_is_refused(catalogue, tmp_path, capsys):
    assert main(["--help"]) == 0
    help_text = " ".join(capsys.readouterr().out.split())
    assert "--buckets {off,aspect}" in help_text and "default aspect, the presets' choice" in help_text
    assert main([str(catalogue / "c.csv"), "--base-path", str(catalogue), "--output", str(tmp_path / "out"),
                 "--probe", "--height", "48"]) == 2
    assert "--height must be a positive multiple of 32" in " ".join(capsys.readouterr().err.split())
    assert not (tmp_path / "out").exists()
