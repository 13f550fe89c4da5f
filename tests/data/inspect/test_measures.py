"""The window statistics on synthetic frames: each threshold from both sides, the crop arithmetic of the bars, the
findings' wording, and the near-duplicate search (against a plain pairwise search)."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest

from diffsynth_mbc.data.inspect import duplicates
from diffsynth_mbc.data.inspect.duplicates import DUPLICATE_BITS, find_duplicates
from diffsynth_mbc.data.inspect.measures import (BAR_LUMA, BAR_MIN_SIDE, BARS_MAX_SHARE, BLACK_LUMA, CUT_MIN_CHANGE,
                                                 CUT_MIN_RATIO, FROZEN_MOTION, WindowMeasures,
                                                 bars_after_crop, findings, kept_shares, measure_window,
                                                 perceptual_hash)
from diffsynth_mbc.data.inspect.reasons import REASONS

HEIGHT, WIDTH = 72, 128


def texture(seed: int = 0, height: int = HEIGHT, width: int = WIDTH) -> np.ndarray:
    """A smooth random picture, luma 40..220 (float)."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width] / max(height, width)
    picture = np.zeros((height, width))
    for _ in range(6):
        fy, fx, phase = rng.uniform(1, 8), rng.uniform(1, 8), rng.uniform(0, 6.3)
        picture += np.sin(2 * np.pi * (fy * y + fx * x) + phase)
    picture = (picture - picture.min()) / np.ptp(picture)
    return 40 + 180 * picture


def rgb(planes) -> np.ndarray:
    """Grey RGB uint8 frames from luma planes [T, h, w] (luma of grey is the grey level)."""
    planes = np.clip(np.round(np.asarray(planes, dtype=float)), 0, 255).astype(np.uint8)
    return np.repeat(planes[..., None], 3, axis=-1)


def grey_levels(levels) -> np.ndarray:
    """A window of flat grey frames at ``levels``: each change is exactly the step between levels."""
    return rgb([np.full((HEIGHT, WIDTH), float(level)) for level in levels])


def panning(frames: int = 17, step: int = 3, seed: int = 0) -> np.ndarray:
    wide = texture(seed, HEIGHT, WIDTH + step * frames)
    return rgb([wide[:, i * step:i * step + WIDTH] for i in range(frames)])


def measure(window: np.ndarray) -> WindowMeasures:
    return measure_window(window)


def reasons(window_measures: WindowMeasures, media_type: str = "video", source=(WIDTH, HEIGHT),
            train=(WIDTH, HEIGHT)) -> list[str]:
    return [finding.reason for finding in findings(window_measures, media_type, train, "test shape", source)]


# --- scene cuts ---

def test_a_moving_window_has_no_cut_and_a_spliced_one_has_it_at_the_splice():
    pan = panning()
    assert measure(pan).cut_score < 2 and reasons(measure(pan)) == []
    other = panning(seed=5)
    spliced = measure(np.concatenate([pan[:8], other[8:]]))
    assert spliced.cut_frame == 8 and spliced.cut_score > 2 * CUT_MIN_RATIO and spliced.cut_change > CUT_MIN_CHANGE
    assert reasons(spliced) == ["scene_cut"]


@pytest.mark.parametrize("jump, is_cut", [(CUT_MIN_CHANGE - 1, False), (CUT_MIN_CHANGE + 1, True)])
def test_a_cut_needs_a_change_above_the_floor(jump, is_cut):
    """Steady changes of 0.5 level (under the typical floor of 1) and one jump: score = jump, the floor decides."""
    levels = [50 + 0.5 * i for i in range(9)] + [54 + jump + 0.5 * i for i in range(8)]
    window = measure(grey_levels(levels))
    assert window.cut_frame == 9 and window.cut_change == pytest.approx(jump, abs=0.05)
    assert ("scene_cut" in reasons(window)) is is_cut


@pytest.mark.parametrize("ratio, is_cut", [(CUT_MIN_RATIO - 0.2, False), (CUT_MIN_RATIO + 0.2, True)])
def test_a_cut_needs_a_change_many_times_the_typical_one(ratio, is_cut):
    """Steady changes of 5 levels (a pan or a fade) and one change ``ratio`` times that."""
    steps = [5.0] * 16
    steps[6] = 5.0 * ratio
    window = measure(grey_levels(np.cumsum([30.0] + steps)))
    assert window.cut_frame == 7 and window.cut_score == pytest.approx(ratio, abs=0.02)
    assert window.cut_change > CUT_MIN_CHANGE and ("scene_cut" in reasons(window)) is is_cut


def test_a_fade_is_no_cut():
    picture = texture(2)
    fade = measure(rgb([picture * i / 16 for i in range(17)]))
    assert fade.cut_score < 1.5 and "scene_cut" not in reasons(fade)


def test_two_frames_have_no_cut_score():
    window = measure(grey_levels([30, 200]))
    assert window.cut_score == 0 and window.cut_frame is None and window.cut_change == pytest.approx(170, abs=0.1)


# --- black ---

def dark_frames(count: int, lit_share: float) -> np.ndarray:
    """Frames at luma 8 with ``lit_share`` of the pixels (leading columns of the middle rows) at 200."""
    frames = np.full((count, HEIGHT, WIDTH), 8.0)
    lit = round(lit_share * HEIGHT * WIDTH)
    frames.reshape(count, -1)[:, HEIGHT * WIDTH // 2:HEIGHT * WIDTH // 2 + lit] = 200
    return rgb(frames)


@pytest.mark.parametrize("lit_share, black", [(0.01, 1.0), (0.03, 0.0)])
def test_a_frame_is_black_when_98_percent_of_it_is_dark(lit_share, black):
    assert measure(dark_frames(17, lit_share)).black_share == black


@pytest.mark.parametrize("black_frames, flagged", [(8, False), (9, True)])
def test_a_window_is_black_when_more_than_half_its_frames_are(black_frames, flagged):
    window = np.concatenate([dark_frames(black_frames, 0.0), panning(17 - black_frames)])
    result = measure(window)
    assert result.black_share == round(black_frames / 17, 4)
    assert ("black" in reasons(result)) is flagged


def test_just_under_the_black_level_is_black_and_just_over_is_not():
    assert measure(rgb(np.full((3, HEIGHT, WIDTH), BLACK_LUMA - 1))).black_share == 1.0
    assert measure(rgb(np.full((3, HEIGHT, WIDTH), BLACK_LUMA + 1))).black_share == 0.0


def test_a_black_window_is_not_also_frozen_or_boxed():
    window = measure(dark_frames(17, 0.0))
    assert reasons(window) == ["black"]
    assert [f.reason for f in findings(window, "image", (WIDTH, HEIGHT), "x", (WIDTH, HEIGHT))] == ["black"]


# --- frozen ---

@pytest.mark.parametrize("shift, frozen", [(FROZEN_MOTION - 1, True), (FROZEN_MOTION + 1, False)])
def test_frozen_below_the_motion_threshold(shift, frozen):
    """A still whose last frame brightens by ``shift`` levels: the motion is exactly that."""
    picture = texture(3)
    window = measure(rgb([picture] * 16 + [picture + shift]))
    assert window.motion == pytest.approx(shift, abs=0.05)
    assert ("frozen" in reasons(window)) is frozen


def test_noise_on_a_still_is_frozen_and_a_small_moving_part_is_not():
    rng = np.random.default_rng(4)
    picture = texture(3)
    noisy = [picture + rng.normal(0, 2, picture.shape) for _ in range(17)]
    assert "frozen" in reasons(measure(rgb(noisy)))
    mouth = [frame.copy() for frame in noisy]
    for index, frame in enumerate(mouth):   # a 6x3 pixel mouth opening and closing: 0.2% of the picture
        frame[50:50 + 1 + index % 3, 60:66] = 20
    assert measure(rgb(mouth)).motion > 3 * FROZEN_MOTION
    assert "frozen" not in reasons(measure(rgb(mouth)))


def test_images_are_never_cut_or_frozen():
    image = measure(rgb([texture(3)]))
    assert image.frames == 1 and image.motion == 0 and image.cut_score == 0
    assert reasons(image, "image") == []


# --- bars ---

def boxed(top: int, bottom: int, left: int = 0, right: int = 0, level: float = 0.0, frames: int = 5) -> np.ndarray:
    window = panning(frames).astype(float)
    window[:, :top], window[:, HEIGHT - bottom:] = level, level
    window[:, :, :left], window[:, :, WIDTH - right:] = level, level
    return rgb(window[..., 0])


def test_bars_are_measured_from_each_edge():
    window = measure(boxed(9, 9, 4, 6))
    assert window.bars == (round(9 / HEIGHT, 4), round(9 / HEIGHT, 4), round(4 / WIDTH, 4), round(6 / WIDTH, 4))
    assert measure(panning(5)).bars == (0.0, 0.0, 0.0, 0.0)


@pytest.mark.parametrize("level, dark", [(BAR_LUMA - 2, True), (BAR_LUMA + 2, False)])
def test_a_bar_is_darker_than_the_bar_level(level, dark):
    assert (measure(boxed(9, 9, level=level)).bars[0] > 0) is dark


def test_bars_are_measured_on_the_frames_that_are_not_black():
    window = np.concatenate([dark_frames(8, 0.0), boxed(9, 9, frames=9)])
    assert measure(window).bars[:2] == (0.125, 0.125)


def test_crop_arithmetic():
    assert kept_shares((1280, 720), (1280, 720)) == (1.0, 1.0)
    assert kept_shares((1920, 1080), (720, 720)) == pytest.approx((0.5625, 1.0))
    assert kept_shares((1080, 1920), (720, 720)) == pytest.approx((1.0, 0.5625))
    # 2.39:1 letterboxed into 16:9, trained at a 2.4:1 shape: the crop takes the bars away
    assert bars_after_crop((0.125, 0.125, 0, 0), (1280, 720), (1280, 536)) == pytest.approx((0, 0, 0, 0), abs=0.01)
    # trained square: the sides are cut, the bars stay (as a share of the same height)
    assert bars_after_crop((0.125, 0.125, 0, 0), (1280, 720), (512, 512)) == pytest.approx((0.125, 0.125, 0, 0))
    # 4:3 pillarboxed in 16:9, trained at 4:3: a quarter of the width is cut, so no bar is left
    assert bars_after_crop((0, 0, 0.125, 0.125), (1280, 720), (960, 720)) == pytest.approx((0, 0, 0, 0))
    # trained slightly wider than the source: a little of each bar is cut, the rest is a share of less height
    top, bottom, _, _ = bars_after_crop((0.12, 0.13, 0, 0), (1280, 720), (1280, 704))
    keep = (1280 / 720) / (1280 / 704)
    cut = (1 - keep) / 2
    assert top == pytest.approx((0.12 - cut) / keep) and bottom == pytest.approx((0.13 - cut) / keep)
    assert top + bottom == pytest.approx(0.233, abs=0.001)   # the example in the findings: 25% -> 23%


def test_letterbox_wording_and_the_trained_share():
    window = measure(boxed(9, 9))
    (finding,) = findings(window, "video", (1280, 720), "1280x720 aspect bucket", (1280, 720))
    assert (finding.reason, finding.threshold) == ("letterbox", BARS_MAX_SHARE)
    assert finding.value == pytest.approx(0.25)
    assert finding.detail == ("dark bars 12% top + 12% bottom of the height; trained at 1280x720 aspect bucket they "
                              "are 25% of the picture")
    assert findings(window, "video", (1280, 536), "1280x536 aspect bucket", (1280, 720)) == []   # cropped away
    assert reasons(measure(boxed(0, 0, 16, 16))) == ["pillarbox"]


@pytest.mark.parametrize("rows, flagged", [(2, False), (4, True)])
def test_letterbox_above_its_share_of_the_picture(rows, flagged):
    """Bars of ``rows`` of 72 each side: 5.6% and 11.1% of the height in all, against 8%."""
    assert (sum(measure(boxed(rows, rows)).bars[:2]) > BARS_MAX_SHARE) is flagged
    assert ("letterbox" in reasons(measure(boxed(rows, rows)))) is flagged


def test_a_bar_on_one_side_only_is_no_letterbox():
    assert measure(boxed(20, 0)).bars[0] > BARS_MAX_SHARE
    assert reasons(measure(boxed(20, 0))) == []
    assert BAR_MIN_SIDE * HEIGHT > 1   # so a one-row border is no side
    assert reasons(measure(boxed(20, 1))) == []


# --- hashes, the record, the findings ---

def test_hashes_of_first_middle_and_last_frame_and_none_for_a_flat_frame():
    pan = panning(17, step=6)
    hashes = measure(pan).hashes
    assert len(hashes) == 3 and all(len(digest) == 16 and int(digest, 16) < 2 ** 63 for digest in hashes)
    assert hashes == tuple(measure(pan[index:index + 1]).hashes[0] for index in (0, 8, 16))
    assert len(set(hashes)) == 3
    assert measure(pan[:2]).hashes == measure(pan[:1]).hashes + measure(pan[1:2]).hashes
    assert measure(rgb(np.full((3, HEIGHT, WIDTH), 120.0))).hashes == ("", "", "")


def bits_apart(first: str, second: str) -> int:
    return bin(int(first, 16) ^ int(second, 16)).count("1")


def test_a_hash_survives_resizing_noise_and_brightness_but_not_another_picture():
    picture = texture(6, 144, 256)
    small = picture.reshape(72, 2, 128, 2).mean(axis=(1, 3))
    noisy = small + np.random.default_rng(0).normal(0, 3, small.shape)
    assert bits_apart(perceptual_hash(picture), perceptual_hash(noisy)) <= 4
    assert bits_apart(perceptual_hash(small), perceptual_hash(small * 0.7 + 20)) == 0
    assert bits_apart(perceptual_hash(small), perceptual_hash(texture(7))) > 2 * DUPLICATE_BITS


def test_measures_round_trip_through_json_exactly():
    for window in (measure(panning()), measure(rgb([texture(3)])), measure(dark_frames(3, 0.0))):
        assert WindowMeasures.from_dict(json.loads(json.dumps(window.to_dict()))) == window


def test_cut_wording():
    window = WindowMeasures(frames=17, cut_score=50.83, cut_frame=8, cut_change=61.0, black_share=0.0, motion=90.0,
                            bars=(0.0, 0.0, 0.0, 0.0), hashes=("1", "2", "3"))
    (finding,) = findings(window, "video", (1280, 704), "1280x704 aspect bucket", (1280, 720))
    assert finding.detail == "hard cut at frame 8 of the window: mean luma change 61 vs 1.2 typical"
    assert (finding.reason, finding.value, finding.threshold) == ("scene_cut", 50.83, CUT_MIN_RATIO)
    assert {f.reason for f in findings(window, "video", (1, 1), "", (1, 1))} <= set(REASONS)


def test_a_frozen_finding_reads_well():
    (finding,) = findings(measure(rgb([texture(3)] * 17)), "video", (WIDTH, HEIGHT), "x", (WIDTH, HEIGHT))
    assert finding.detail.startswith("no motion across 17 frames: at most 0.0 luma levels")


# --- near-duplicates ---

def pairwise(signatures):
    """The plain O(n^2) search that find_duplicates must equal."""
    found = {}
    for i, (kind, hashes) in enumerate(signatures):
        for j, (other_kind, other) in enumerate(signatures[:i]):
            if kind == other_kind and len(hashes) == len(other) and all(hashes) and all(other):
                distance = max(bits_apart(a, b) for a, b in zip(hashes, other))
                if distance <= DUPLICATE_BITS:
                    found[i] = (j, distance)
                    break
    return found


def flipped(digest: int, bits: list[int]) -> str:
    for bit in bits:
        digest ^= 1 << bit
    return f"{digest:016x}"


def test_duplicates_rules():
    base, other = 0x0123456789ABCDEF, 0x7EDCBA9876543210
    signatures = [
        ("video", (flipped(base, []), flipped(base, [1]), flipped(base, []))),                 # 0
        ("image", (flipped(base, []),)),                                                         # 1
        ("video", (flipped(base, [3, 4]), flipped(base, [1, *range(20, 21 + DUPLICATE_BITS)]),  # 2: 1 bit too far
                   flipped(base, []))),
        ("video", (flipped(base, list(range(DUPLICATE_BITS))), flipped(base, [1]), flipped(base, [9]))),  # 3 -> 0
        ("video", (flipped(base, []), "", flipped(base, []))),                                  # 4: a flat frame
        ("video", (flipped(base, []), flipped(base, []))),                                      # 5: 2 hashes
        ("image", (flipped(base, [0, 1]),)),                                                     # 6 -> 1
        ("video", (flipped(other, []),) * 3),                                                    # 7
        ("video", (flipped(base, []), flipped(base, [1]), flipped(base, []))),                  # 8 -> 0, not 3
    ]
    assert find_duplicates(signatures) == {3: (0, DUPLICATE_BITS), 6: (1, 2), 8: (0, 0)}
    assert find_duplicates([]) == {} and find_duplicates(signatures[:1]) == {}


def test_duplicates_equal_a_pairwise_search_across_blocks(monkeypatch):
    rng = random.Random(0)
    for block_rows, block_columns, dense_share in ((4, 8, 0.02), (3, 5, 0.0), (16, 16, 1.0)):
        monkeypatch.setattr(duplicates, "BLOCK_ROWS", block_rows)
        monkeypatch.setattr(duplicates, "BLOCK_COLUMNS", block_columns)
        monkeypatch.setattr(duplicates, "DENSE_SHARE", dense_share)
        for _ in range(5):
            bases = [rng.getrandbits(64) for _ in range(4)]
            signatures = [(rng.choice(["video", "image"]),
                           tuple(flipped(rng.choice(bases), [rng.randrange(64) for _ in range(rng.randint(0, 7))])
                                 if rng.random() > 0.05 else "" for _ in range(rng.choice([1, 3, 3]))))
                          for _ in range(rng.randint(20, 90))]
            assert find_duplicates(signatures) == pairwise(signatures)


def test_many_copies_of_one_row_stay_fast():
    """A catalogue of copies (every row near its first): each block stops at its first match."""
    signatures = [("video", (flipped(1234567, [i % 5]), flipped(7654321, []), flipped(99, [])))
                  for i in range(3000)]
    found = find_duplicates(signatures)
    assert len(found) == 2999 and all(j == 0 for j, _ in found.values())
