"""The fast clip reader gives DiffSynth's frames: same indices and counts, same pixels, clear reasons."""

from __future__ import annotations

import json
import subprocess

import imageio_ffmpeg
import numpy as np
import pytest

from catalog_helpers import DIFFSYNTH, clip, write_metadata
from diffsynth_mbc.data.dataset import MBCVideoDataset, MediaDecodeError
from diffsynth_mbc.data.media.clip_reader import (ClipReadError, IrregularTiming, ReferenceReaderNeeded,
                                                  evenly_spaced, probe_clip, read_leading_frames)
from diffsynth_mbc.data.media.frame_selection import frames_to_use
from diffsynth_mbc.data.media.media_probe import probe_video

NUM_FRAMES, SIZE = 17, 64
FFMPEG = imageio_ffmpeg.get_ffmpeg_exe()


def make_clip(path, frames, size="96x64", rate=8, pix_fmt="yuv420p", extra=(), codec="libx264"):
    subprocess.run([FFMPEG, "-y", "-loglevel", "error", "-f", "lavfi", "-i", f"testsrc2=size={size}:rate={rate}",
                    "-frames:v", str(frames), *extra, "-c:v", codec, "-pix_fmt", pix_fmt, str(path)], check=True)
    return path


def with_display_matrix(source, path, rotation, hflip=False):
    """A copy of ``source`` whose container tells players to turn (and mirror) the picture, as phones write."""
    subprocess.run([FFMPEG, "-y", "-loglevel", "error", "-display_rotation", str(rotation),
                    *(["-display_hflip"] if hflip else []), "-i", str(source), "-c", "copy", str(path)], check=True)
    return path


def dataset(tmp_path, decoder):
    metadata = tmp_path / "metadata.csv"
    if not metadata.exists():
        write_metadata(metadata, [clip("clip.mp4", caption="x")], DIFFSYNTH)
    return MBCVideoDataset(str(tmp_path), str(metadata), num_frames=NUM_FRAMES, height=SIZE, width=SIZE,
                           decoder=decoder)


def assert_same_frames(fast, reference):
    assert len(fast) == len(reference)
    for a, b in zip(fast, reference):
        assert a.size == b.size and a.mode == b.mode == "RGB"
        diff = np.abs(np.asarray(a, dtype=np.int16) - np.asarray(b, dtype=np.int16))
        assert diff.max() <= 2 and diff.mean() < 0.5


@pytest.mark.parametrize("frames", [1, 4, 5, 16, 17, 18, 300])
def test_counts_indices_and_pixels_equal_diffsynth(tmp_path, frames):
    clip = make_clip(tmp_path / "clip.mp4", frames)
    fast = dataset(tmp_path, "fast").load_video(str(clip))
    reference = dataset(tmp_path, "diffsynth").load_video(str(clip))
    assert len(fast) == frames_to_use(frames, NUM_FRAMES)
    assert_same_frames(fast, reference)


def test_a_variable_frame_rate_clip(tmp_path):
    clip = make_clip(tmp_path / "clip.mp4", 60, rate=24,
                     extra=("-vf", "select='not(mod(n\\,3))+eq(n\\,7)+eq(n\\,8)'", "-fps_mode", "vfr"))
    with pytest.raises(IrregularTiming):     # so the dataset uses DiffSynth's reader for this clip
        read_leading_frames(str(clip), NUM_FRAMES)
    fast = dataset(tmp_path, "fast").load_video(str(clip))
    assert_same_frames(fast, dataset(tmp_path, "diffsynth").load_video(str(clip)))


@pytest.mark.parametrize("rotation", [90, 180, -90])
def test_a_rotated_clip_is_turned_as_diffsynth_turns_it(tmp_path, rotation):
    clip = with_display_matrix(make_clip(tmp_path / "plain.mp4", 20), tmp_path / "clip.mp4", rotation)
    turned = read_leading_frames(str(clip), NUM_FRAMES)        # applied here, no fallback to DiffSynth's reader
    assert turned[0].size == ((96, 64) if rotation == 180 else (64, 96))
    fast = dataset(tmp_path, "fast").load_video(str(clip))
    assert_same_frames(fast, dataset(tmp_path, "diffsynth").load_video(str(clip)))
    slow = probe_video(str(clip))
    assert probe_clip(str(clip))[:2] == turned[0].size == (slow.width, slow.height)    # --probe: the displayed size


def test_a_mirrored_clip_and_a_10_bit_clip_are_read_by_diffsynths_reader(tmp_path):
    mirrored = with_display_matrix(make_clip(tmp_path / "plain.mp4", 20), tmp_path / "mirrored.mp4", 90, hflip=True)
    ten_bit = make_clip(tmp_path / "ten.mp4", 20, pix_fmt="yuv420p10le", codec="libx265",
                        extra=("-x265-params", "log-level=error"))
    for clip in (mirrored, ten_bit):
        with pytest.raises(ReferenceReaderNeeded):
            read_leading_frames(str(clip), NUM_FRAMES)
        fast = dataset(tmp_path, "fast").load_video(str(clip))
        assert_same_frames(fast, dataset(tmp_path, "diffsynth").load_video(str(clip)))
    assert probe_clip(str(mirrored))[:2] == (64, 96) and probe_clip(str(ten_bit)) == (96, 64, 20, 8.0)


@pytest.mark.parametrize("size", ["97x61", "1281x721"])
def test_odd_sizes(tmp_path, size):
    clip = make_clip(tmp_path / "clip.mp4", 20, size=size, pix_fmt="yuv444p")
    fast = dataset(tmp_path, "fast").load_video(str(clip))
    assert fast[0].size == (SIZE, SIZE)
    assert_same_frames(fast, dataset(tmp_path, "diffsynth").load_video(str(clip)))


def test_the_container_count_is_trusted_only_where_it_cannot_change_the_frames(tmp_path):
    clip = make_clip(tmp_path / "clip.mp4", 11)
    assert len(read_leading_frames(str(clip), 17)) == 9        # short: counted by decoding, cut to 4k+1
    width, height, count, fps = probe_clip(str(clip))
    assert (width, height, count, fps) == (96, 64, 11, 8.0)
    slow = probe_video(str(clip))
    assert (slow.width, slow.height, slow.num_frames) == (width, height, count)


def test_evenly_spaced_frames_are_what_constant_rate_output_gives():
    assert evenly_spaced([0.0, 0.125, 0.25], 8.0, 0.0)
    assert not evenly_spaced([0.0, 0.125, 0.5], 8.0, 0.0)       # a gap: ffmpeg repeats a frame there
    assert not evenly_spaced([0.25, 0.375], 8.0, 0.0)           # starts late: ffmpeg repeats the first
    assert not evenly_spaced([0.0, None], 8.0, 0.0) and not evenly_spaced([0.0], None, 0.0)


def test_rule_matches_diffsynth():
    assert [frames_to_use(n, 17) for n in (1, 2, 4, 5, 8, 9, 16, 17, 18, 300)] == [1, 1, 1, 5, 5, 9, 13, 17, 17, 17]


@pytest.mark.parametrize("damage", ["truncated", "garbage", "empty"])
def test_a_damaged_clip_gets_a_reason_not_a_crash(tmp_path, damage):
    clip = make_clip(tmp_path / "clip.mp4", 30)
    data = clip.read_bytes()
    clip.write_bytes({"truncated": data[: len(data) // 3], "garbage": b"\x00\x00\x00\x18ftypmp42" + b"junk" * 50,
                      "empty": b""}[damage])
    with pytest.raises(MediaDecodeError, match=r"metadata row 1 \(clip.mp4\): cannot decode"):
        dataset(tmp_path, "fast").load_row(0)
    with pytest.raises(ClipReadError):
        probe_clip(str(clip))
