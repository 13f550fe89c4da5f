"""End to end on encoded clips: read_window -> measure_window -> findings, and find_duplicates over them all.

Each problem the inspection flags has a clip that shows it and a look-alike that must not be flagged: a slow fade
and a pan are no cut, a night scene with lit windows and moving lights is not black, a still picture with a
speaking mouth is not frozen, a re-encoded, resized copy is a duplicate and different clips are not. The clips
are 192x108 (a tenth of the usual 1920x1080), made once for the module with the bundled ffmpeg.
"""

from __future__ import annotations

import pytest

from diffsynth_mbc.data.inspect.duplicates import DUPLICATE_BITS, find_duplicates
from diffsynth_mbc.data.inspect.measures import (BLACK_LUMA, CUT_MIN_CHANGE, CUT_MIN_RATIO, FROZEN_MOTION,
                                                 findings, measure_window)
from diffsynth_mbc.data.inspect.window import InspectWindow, read_window
from inspect_media import FRAMES, RATE, make_media

TRAIN_SHAPE, SHAPE_LABEL = (1280, 704), "1280x704 aspect bucket"


@pytest.fixture(scope="module")
def media(tmp_path_factory):
    """{name: (path, media_type)} of every clip and image, made once."""
    return make_media(tmp_path_factory.mktemp("detection"))


@pytest.fixture(scope="module")
def measured(media):
    """{name: (WindowMeasures, [reasons])}, through the inspection's own path."""
    results = {}
    for name, (path, media_type) in media.items():
        window = read_window(path, media_type, InspectWindow(), available=FRAMES if media_type == "video" else None,
                             fps=RATE)
        measures = measure_window(window.frames)
        found = findings(measures, media_type, TRAIN_SHAPE, SHAPE_LABEL, (window.width, window.height))
        results[name] = (measures, [finding.reason for finding in found], found)
    return results


EXPECTED = {"clean": [], "cut": ["scene_cut"], "black": ["black"], "frozen": ["frozen"],
            "letterbox": ["letterbox"], "pillarbox": ["pillarbox"], "clean_copy": [], "fade": [], "pan": [],
            "night": [], "talking": [], "picture": [], "picture_copy": [], "other_picture": []}


def test_each_clip_is_flagged_for_what_it_shows_and_nothing_else(measured):
    assert {name: reasons for name, (_, reasons, _) in measured.items()} == EXPECTED


def test_the_cut_is_at_the_splice(measured):
    cut, _, (finding,) = measured["cut"]
    assert cut.cut_frame == 8 and cut.cut_change > 2 * CUT_MIN_CHANGE and cut.cut_score > 2 * CUT_MIN_RATIO
    assert finding.detail.startswith("hard cut at frame 8 of the window: mean luma change ")


def test_a_slow_fade_and_a_pan_change_steadily(measured):
    for name in ("fade", "pan", "clean"):
        assert measured[name][0].cut_score < CUT_MIN_RATIO / 2, name


def test_the_night_scene_is_dark_but_not_black(media, measured):
    frames = read_window(media["night"][0], "video", InspectWindow()).frames
    luma = frames.astype(float) @ [0.299, 0.587, 0.114]
    lit = (luma >= BLACK_LUMA).mean(axis=(1, 2))
    assert luma.mean() < BLACK_LUMA and (0.02 < lit).all() and (lit < 0.08).all()
    assert measured["night"][0].black_share == 0 and measured["black"][0].black_share == 1


def test_a_speaking_mouth_is_motion_and_a_grainy_still_is_not(measured):
    assert measured["talking"][0].motion > 3 * FROZEN_MOTION
    assert measured["frozen"][0].motion < FROZEN_MOTION / 2


def test_bars_are_measured_and_reported_after_the_crop(measured):
    letterbox, _, (finding,) = measured["letterbox"]
    assert letterbox.bars[:2] == pytest.approx((14 / 108, 14 / 108), abs=0.015) and letterbox.bars[2:] == (0, 0)
    # 9 of 72 rows each side; the bucket is a little wider than 16:9, so the crop takes 1% of the height off each
    assert finding.detail == ("dark bars 12% top + 12% bottom of the height; trained at 1280x704 aspect bucket "
                              "they are 23% of the picture")
    pillarbox = measured["pillarbox"][0]
    assert pillarbox.bars[2:] == pytest.approx((24 / 192, 24 / 192), abs=0.015) and pillarbox.bars[:2] == (0, 0)


def test_copies_are_duplicates_of_their_originals_and_nothing_else_is(measured):
    names = list(measured)
    signatures = [(("image" if name.startswith(("picture", "other")) else "video"), measured[name][0].hashes)
                  for name in names]
    found = {names[row]: (names[earlier], distance) for row, (earlier, distance) in
             find_duplicates(signatures).items()}
    assert {row: earlier for row, (earlier, _) in found.items()} == {"clean_copy": "clean",
                                                                     "picture_copy": "picture"}
    assert all(distance <= DUPLICATE_BITS for _, distance in found.values())

