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


def test_the_frame_rates_are_said_with_what_the_run_does_with_them():
    from diffsynth_mbc.data.media.frame_selection import describe_frame_rates, rates_off_the_model

    rates = {29.97: 78112, 25.0: 1888}
    assert describe_frame_rates(rates, 0, 24.0, 17) == (
        "frame rates: clips at 29.97 fps (78,112) and 25 fps (1,888) put on the 24 fps timeline (--source_fps 24): "
        "17 frames span 0.67 s")
    own = describe_frame_rates(rates, 3, None, 17)
    assert own.startswith("frame rates: clips at 29.97 fps (78,112) and 25 fps (1,888) train at their own rates "
                          "(no --source_fps): 17 frames span 0.53 s at 29.97 fps, 0.64 s at 25 fps; at 24 fps their "
                          "motion plays at 0.80x (29.97 fps), 0.96x (25 fps) speed; --source_fps 24 puts them on")
    assert own.endswith("; 3 clip(s) of no recorded rate (python -m diffsynth_mbc.convert --probe records each "
                        "clip's)")
    assert "(Wan2.2-TI2V-5B generates 24 fps: their motion plays at 0.80x speed there)" in \
        describe_frame_rates(rates, 0, 30.0, 17)
    unprobed = describe_frame_rates({}, 40, None, 17)
    assert unprobed.startswith("frame rates: not in the metadata for 40 clips (python -m diffsynth_mbc.convert "
                               "--probe records them); each trains at its own rate (no --source_fps)")
    many = {29.97: 5, 25.0: 4, 30.0: 3, 60.0: 2, 15.0: 1, 24.0: 1}
    assert "clips at 29.97 fps (5), 25 fps (4), 30 fps (3), 60 fps (2) and 2 other rates (2) put on" in \
        describe_frame_rates(many, 0, 24.0, 17)
    assert describe_frame_rates({}, 0, 24.0, 17) is None   # images only
    assert rates_off_the_model(rates, None) and not rates_off_the_model(rates, 24.0)
    assert not rates_off_the_model({23.976: 10, 24.0: 3}, None) and rates_off_the_model({}, 30.0)


def test_the_presets_train_on_the_24_fps_timeline_of_the_model():
    from diffsynth_mbc.data.media.frame_selection import MODEL_FPS
    from diffsynth_mbc.training.options import resolve_options
    from e2e_helpers import REPO

    for preset in ("train_full.yaml", "train_test.yaml"):
        assert resolve_options(["--config", str(REPO / "configs" / preset)]).source_fps == MODEL_FPS == 24.0
