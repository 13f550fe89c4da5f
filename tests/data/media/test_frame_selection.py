"""Which frames train (--frame_sampling, --source_fps, --short_clips): the pure rules, in milliseconds."""

from __future__ import annotations

import argparse

import pytest

from diffsynth_mbc.data.media.frame_selection import frames_to_use
from diffsynth_mbc.data.media.frame_selection import (FrameSelection, ShortClip, frame_arguments,
                                                      frame_selection_from, frames_needed, select_frames, timeline)
from diffsynth_mbc.training.options import TrainOptions

HEAD = FrameSelection()


@pytest.mark.parametrize("available", [1, 4, 5, 16, 17, 18, 300])
def test_the_default_is_diffsynths_leading_frames(available):
    assert HEAD.is_default and HEAD.settings() is None
    assert select_frames(available, 30.0, 17, HEAD) == list(range(frames_to_use(available, 17)))


def test_uniform_spans_the_whole_clip_evenly():
    picked = select_frames(161, 30.0, 17, FrameSelection(sampling="uniform"))
    assert picked[0] == 0 and picked[-1] == 160 and len(picked) == 17
    assert {b - a for a, b in zip(picked, picked[1:])} == {10}
    assert select_frames(17, 30.0, 17, FrameSelection(sampling="uniform")) == list(range(17))


def test_random_window_is_drawn_per_seed_epoch_and_sample_and_is_consecutive():
    selection = FrameSelection(sampling="random_window", seed=3)
    draws = {epoch: select_frames(300, 30.0, 17, selection, epoch=epoch, sample=4) for epoch in range(8)}
    for picked in draws.values():
        assert picked == list(range(picked[0], picked[0] + 17)) and 0 <= picked[0] <= 300 - 17
    assert len({picked[0] for picked in draws.values()}) > 1                       # epochs differ
    assert select_frames(300, 30.0, 17, selection, epoch=2, sample=4) == draws[2]   # and repeat exactly
    assert select_frames(300, 30.0, 17, selection, epoch=2, sample=5) != draws[2] or \
        select_frames(300, 30.0, 17, selection, epoch=2, sample=6) != draws[2]
    other_seed = FrameSelection(sampling="random_window", seed=4)
    assert [select_frames(300, 30.0, 17, other_seed, epoch=e, sample=4) for e in range(8)] != list(draws.values())


def test_source_fps_takes_the_nearest_frame_so_clips_of_two_rates_span_the_same_time():
    at_30 = select_frames(300, 30.0, 17, FrameSelection(source_fps=15.0))
    at_25 = select_frames(250, 25.0, 17, FrameSelection(source_fps=15.0))
    assert at_30 == list(range(0, 34, 2))                     # every second frame of a 30 fps clip
    seconds_30, seconds_25 = at_30[-1] / 30.0, at_25[-1] / 25.0
    assert abs(seconds_30 - 16 / 15) < 1 / 30 and abs(seconds_25 - 16 / 15) < 1 / 25
    assert timeline(10, 30.0, 30.0) == list(range(10))        # its own rate: every frame
    assert timeline(10, 10.0, 20.0) == [0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7, 8, 8, 9, 9, 9]
    assert timeline(10, None, 15.0) == list(range(10))        # rate unknown: as recorded


def test_short_clips_shorten_loop_or_skip_with_a_reason():
    assert select_frames(10, 30.0, 17, FrameSelection(short_clips="shorten")) == list(range(9))
    assert select_frames(10, 30.0, 17, FrameSelection(short_clips="loop")) == list(range(10)) + list(range(7))
    with pytest.raises(ShortClip, match="10 frames, fewer than the 17"):
        select_frames(10, 30.0, 17, FrameSelection(short_clips="skip"))
    # Short after resampling: 30 source frames at 30 fps give 15 at 15 fps.
    with pytest.raises(ShortClip, match="15 frames at --source_fps 15"):
        select_frames(30, 30.0, 17, FrameSelection(source_fps=15.0, short_clips="skip"))
    assert frames_needed(17, 30.0, 15.0) == 33 and frames_needed(17, 30.0, None) == 17
    assert len(timeline(frames_needed(17, 25.0, 16.0), 25.0, 16.0)) >= 17
    assert len(timeline(frames_needed(17, 25.0, 16.0) - 1, 25.0, 16.0)) < 17


def test_bad_values_are_refused_naming_the_flag():
    with pytest.raises(ValueError, match="--frame_sampling"):
        FrameSelection(sampling="middle")
    with pytest.raises(ValueError, match="--short_clips"):
        FrameSelection(short_clips="pad")
    with pytest.raises(ValueError, match="--source_fps"):
        FrameSelection(source_fps=0.0)


def test_options_give_the_selection_and_the_flags_that_differ_from_the_default():
    options = argparse.Namespace(frame_sampling="uniform", source_fps=24.0, short_clips="loop", seed=9)
    selection = frame_selection_from(options)
    assert selection == FrameSelection("uniform", 24.0, "loop", 9)
    assert selection.settings() == {"sampling": "uniform", "source_fps": 24.0, "short_clips": "loop"}
    assert frame_arguments(options) == ["--frame_sampling", "uniform", "--source_fps", "24", "--short_clips", "loop"]
    assert frame_arguments(TrainOptions(seed=1)) == [] and frame_selection_from(TrainOptions()).is_default
