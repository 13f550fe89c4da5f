"""Frame modes on real clips: the fast reader and DiffSynth's reader give the selected frames, by index."""

from __future__ import annotations

import imageio
import numpy as np
import pytest

from catalog_helpers import DIFFSYNTH, clip, write_metadata
from diffsynth_mbc.data.dataset import MBCVideoDataset, MediaDecodeError
from diffsynth_mbc.data.media.clip_reader import IrregularTiming, read_selected_frames
from diffsynth_mbc.data.media.frame_selection import FrameSelection, select_frames
from test_clip_reader import assert_same_frames, make_clip

NUM_FRAMES, SIZE = 9, 64
MODES = [FrameSelection(sampling="uniform"), FrameSelection(sampling="random_window", seed=5),
         FrameSelection(source_fps=4.0), FrameSelection(sampling="uniform", source_fps=12.0),
         FrameSelection(short_clips="loop")]


def dataset(tmp_path, decoder, frames, rows=("clip.mp4",), repeat=1, substitute=False):
    metadata = write_metadata(tmp_path / "metadata.csv", [clip(row, caption="x") for row in rows], DIFFSYNTH)
    return MBCVideoDataset(str(tmp_path), str(metadata), num_frames=NUM_FRAMES, height=SIZE, width=SIZE,
                           decoder=decoder, frames=frames, repeat=repeat, substitute_bad_media=substitute)


def every_frame(path) -> list:
    reader = imageio.get_reader(str(path))
    try:
        return [np.asarray(frame) for frame in reader]
    finally:
        reader.close()


@pytest.mark.parametrize("selection", MODES, ids=lambda s: f"{s.sampling}-{s.source_fps}-{s.short_clips}")
def test_each_mode_reads_the_selected_frames_with_either_reader(tmp_path, selection):
    frames = 6 if selection.short_clips == "loop" else 40
    clip = make_clip(tmp_path / "clip.mp4", frames, rate=8)
    indices = select_frames(frames, 8.0, NUM_FRAMES, selection, epoch=2, sample=0)
    assert len(indices) == NUM_FRAMES
    fast = read_selected_frames(str(clip), NUM_FRAMES, selection, epoch=2, sample=0)
    whole = every_frame(clip)
    for image, index in zip(fast, indices):   # frame for frame the decoded clip's frames at those indices
        assert np.abs(np.asarray(image, dtype=np.int16) - whole[index].astype(np.int16)).max() <= 2
    ours = dataset(tmp_path, "fast", selection)
    reference = dataset(tmp_path, "diffsynth", selection)
    epoch_two = 2 * len(ours)   # the batch sampler's index of row 0 in epoch 2
    assert_same_frames(ours[epoch_two]["video"], reference[epoch_two]["video"])


def test_random_window_changes_with_the_epoch_and_repeats_exactly(tmp_path):
    make_clip(tmp_path / "clip.mp4", 80, rate=8)
    data = dataset(tmp_path, "fast", FrameSelection(sampling="random_window", seed=1))
    pixels = [np.stack([np.asarray(f) for f in data[epoch]["video"]]) for epoch in range(6)]
    assert any(not np.array_equal(pixels[0], other) for other in pixels[1:])
    assert np.array_equal(pixels[3], np.stack([np.asarray(f) for f in data[3]["video"]]))


def test_a_variable_frame_rate_clip_falls_back_to_diffsynths_reader_at_the_same_indices(tmp_path):
    clip = make_clip(tmp_path / "clip.mp4", 60, rate=24,
                     extra=("-vf", "select='not(mod(n\\,3))+eq(n\\,7)+eq(n\\,8)'", "-fps_mode", "vfr"))
    selection = FrameSelection(sampling="uniform")
    with pytest.raises(IrregularTiming):
        read_selected_frames(str(clip), NUM_FRAMES, selection)
    assert_same_frames(dataset(tmp_path, "fast", selection)[0]["video"],
                       dataset(tmp_path, "diffsynth", selection)[0]["video"])


def test_a_short_clip_under_skip_is_bad_media_named_and_replaced(tmp_path):
    make_clip(tmp_path / "short.mp4", 5, rate=8)
    make_clip(tmp_path / "long.mp4", 20, rate=8)
    skip = FrameSelection(short_clips="skip")
    with pytest.raises(MediaDecodeError, match=r"metadata row 1 \(short.mp4\): too short: the clip has 5 frames"):
        dataset(tmp_path, "fast", skip, rows=("short.mp4", "long.mp4"))[0]
    sample = dataset(tmp_path, "fast", skip, rows=("short.mp4", "long.mp4"), substitute=True)[0]
    assert sample["row"] == 2 and len(sample["video"]) == NUM_FRAMES
    assert [bad["row"] for bad in sample["skipped"]] == [1] and "too short" in sample["skipped"][0]["reason"]


def test_the_default_reads_diffsynths_frames_bit_for_bit_in_every_epoch(tmp_path):
    """The epoch the sampler adds to each index changes nothing for head: the same pixels as DiffSynth's own
    VideoDataset path (the unchanged leading-frame reader), epoch after epoch."""
    make_clip(tmp_path / "clip.mp4", 30, rate=8)
    default = dataset(tmp_path, "fast", None, repeat=2)
    assert default.frames.is_default
    first = [np.asarray(f) for f in default.load_video(str(tmp_path / "clip.mp4"))]
    for index in (0, 1, 2 * len(default), 7 * len(default) + 1):
        assert all(np.array_equal(a, np.asarray(b)) for a, b in zip(first, default[index]["video"], strict=True))
