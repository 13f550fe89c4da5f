"""Reading the training window: the training's frame positions, decoded small, turned as displayed, clear errors.

The clips are tiny and made here with the bundled ffmpeg; a "counter" clip shows frame i as flat grey at level
``COUNTER_BASE + COUNTER_STEP * i``, so each decoded frame says which source frame it is.
"""

from __future__ import annotations

import json
import subprocess

import imageio_ffmpeg
import numpy as np
import pytest
from PIL import Image, ImageOps

from diffsynth_mbc.data.inspect.window import (ANALYSIS_LONG_SIDE, InspectReadError, InspectWindow, analysis_size,
                                               read_window)
from diffsynth_mbc.data.media.frame_selection import FrameSelection, select_frames, timeline

FFMPEG = imageio_ffmpeg.get_ffmpeg_exe()
COUNTER_BASE, COUNTER_STEP = 10, 6


def encode(path, frames: np.ndarray, rate: float = 24, extra=()):
    """Encode uint8 RGB frames [T, h, w, 3] as H.264 (near-lossless, so levels survive)."""
    _, height, width, _ = frames.shape
    subprocess.run([FFMPEG, "-y", "-loglevel", "error", "-f", "rawvideo", "-pix_fmt", "rgb24", "-s",
                    f"{width}x{height}", "-r", str(rate), "-i", "-", *extra, "-c:v", "libx264", "-crf", "4",
                    "-pix_fmt", "yuv420p", str(path)], input=np.ascontiguousarray(frames).tobytes(), check=True)
    return str(path)


def counter_clip(path, frames: int, size=(64, 36), rate: float = 24):
    levels = COUNTER_BASE + COUNTER_STEP * np.arange(frames)
    return encode(path, np.broadcast_to(levels[:, None, None, None], (frames, size[1], size[0], 3))
                  .astype(np.uint8), rate)


def frame_numbers(frames: np.ndarray) -> list[int]:
    """Which counter frame each decoded frame is."""
    return [round((float(frame.mean()) - COUNTER_BASE) / COUNTER_STEP) for frame in frames]


@pytest.fixture(scope="module")
def counter40(tmp_path_factory):
    return counter_clip(tmp_path_factory.mktemp("clips") / "counter40.mp4", 40)


def test_analysis_size_keeps_the_aspect_with_an_even_short_side():
    assert analysis_size(1280, 720) == (128, 72)
    assert analysis_size(720, 1280) == (72, 128)
    assert analysis_size(500, 500) == (128, 128)
    assert analysis_size(1920, 817) == (128, 54)
    assert analysis_size(4000, 10) == (128, 2)
    assert analysis_size(64, 36, long_side=256) == (256, 144)
    with pytest.raises(InspectReadError):
        analysis_size(0, 10)


@pytest.mark.parametrize("sampling, source_fps", [("head", None), ("uniform", None), ("head", 12.0),
                                                  ("uniform", 10.0), ("head", 60.0)])
@pytest.mark.parametrize("available, fps", [(1, 24.0), (9, 24.0), (17, 24.0), (40, 24.0), (300, 29.97),
                                            (50, None)])
def test_positions_are_the_frames_the_training_selects(sampling, source_fps, available, fps):
    window = InspectWindow(17, sampling, source_fps, seed=3)
    selection = FrameSelection(sampling, source_fps, "shorten", 3)
    assert window.positions(available, fps) == sorted(set(select_frames(available, fps, 17, selection)))


@pytest.mark.parametrize("source_fps", [None, 12.0, 50.0])
def test_random_window_positions_are_the_whole_timeline(source_fps):
    window = InspectWindow(17, "random_window", source_fps, seed=1)
    assert window.positions(300, 25.0) == sorted(set(timeline(300, 25.0, source_fps)))
    every_window = set()   # each epoch's window lies inside it
    for epoch in range(20):
        every_window |= set(select_frames(300, 25.0, 17, window.selection(), epoch=epoch, sample=4))
    assert every_window <= set(window.positions(300, 25.0))
    # a timeline shorter than the window trains its leading frames, as head does
    assert window.positions(6, 25.0) == sorted(set(select_frames(6, 25.0, 17, window.selection())))
    assert window.positions(0, 25.0) == []


def test_settings_are_plain_and_rebuild_the_window():
    window = InspectWindow(33, "uniform", 12.5, seed=7)
    assert InspectWindow(**json.loads(json.dumps(window.settings()))) == window
    with pytest.raises(ValueError, match="frame_sampling"):
        InspectWindow(sampling="sideways")
    with pytest.raises(ValueError):
        InspectWindow(num_frames=0)


@pytest.mark.parametrize("window", [InspectWindow(), InspectWindow(9, "uniform"), InspectWindow(17, "random_window"),
                                    InspectWindow(17, "head", source_fps=12.0),
                                    InspectWindow(5, "uniform", source_fps=8.0)])
@pytest.mark.parametrize("told", [True, False])
def test_the_decoded_frames_are_the_selected_ones(counter40, window, told):
    """With the probe's count and rate, or with the container's."""
    read = read_window(counter40, "video", window, available=40 if told else None, fps=24.0 if told else None)
    assert read.positions == window.positions(40, 24.0)
    assert frame_numbers(read.frames) == read.positions
    assert read.frames.dtype == np.uint8 and read.frames.shape[1:] == (72, 128, 3)
    assert (read.width, read.height) == (64, 36)


def test_head_needs_no_count_and_the_others_count_packets(tmp_path):
    """A Matroska file carries no frame count: head reads its window anyway, uniform counts the packets."""
    clip = str(tmp_path / "counter.mkv")
    subprocess.run([FFMPEG, "-y", "-loglevel", "error", "-i", counter_clip(tmp_path / "c.mp4", 30), "-c", "copy",
                    clip], check=True)
    assert read_window(clip, "video", InspectWindow()).positions == list(range(17))
    uniform = read_window(clip, "video", InspectWindow(17, "uniform"))
    assert uniform.positions == window_positions(30, "uniform")
    assert frame_numbers(uniform.frames) == uniform.positions


def window_positions(available: int, sampling: str) -> list[int]:
    return sorted(set(select_frames(available, 24.0, 17, FrameSelection(sampling))))


@pytest.mark.parametrize("sampling", ["head", "uniform", "random_window"])
def test_a_clip_that_ends_early_gives_what_training_takes_from_the_frames_it_has(tmp_path, sampling):
    clip = counter_clip(tmp_path / "short.mp4", 10)
    read = read_window(clip, "video", InspectWindow(17, sampling), available=40, fps=24.0)
    assert read.positions == window_positions(10, sampling) == list(range(9))   # 4k+1 leading frames
    assert frame_numbers(read.frames) == read.positions


@pytest.mark.parametrize("rotation, turns", [(90, 1), (180, 2), (-90, 3)])
def test_a_rotated_clip_comes_out_as_displayed(tmp_path, rotation, turns):
    rng = np.random.default_rng(0)
    frames = np.repeat(rng.integers(0, 255, (1, 18, 32, 3), dtype=np.uint8).repeat(4, 1).repeat(4, 2), 5, axis=0)
    plain = encode(tmp_path / "plain.mp4", frames)
    turned = str(tmp_path / "turned.mp4")
    subprocess.run([FFMPEG, "-y", "-loglevel", "error", "-display_rotation", str(rotation), "-i", plain, "-c",
                    "copy", turned], check=True)
    upright, shown = (read_window(path, "video", InspectWindow(5)) for path in (plain, turned))
    assert (shown.width, shown.height) == ((128, 72) if turns == 2 else (72, 128))
    assert np.array_equal(shown.frames, np.rot90(upright.frames, turns, axes=(1, 2)))


def test_an_image_is_one_frame_turned_by_its_exif_orientation(tmp_path):
    rng = np.random.default_rng(1)
    pixels = rng.integers(0, 255, (9, 16, 3), dtype=np.uint8).repeat(40, 0).repeat(40, 1)   # 640x360, blocky
    path = tmp_path / "phone.jpg"
    exif = Image.Exif()
    exif[0x0112] = 6   # stored on its side: shown turned 90 degrees clockwise
    Image.fromarray(pixels).save(path, quality=95, exif=exif)
    read = read_window(str(path), "image", InspectWindow())
    assert read.positions == [0] and (read.width, read.height) == (360, 640)
    assert read.frames.shape == (1, ANALYSIS_LONG_SIDE, 72, 3)
    with Image.open(path) as image:
        expected = np.asarray(ImageOps.exif_transpose(image).convert("RGB").resize((72, 128), Image.BOX), dtype=float)
    assert np.abs(read.frames[0].astype(float) - expected).mean() < 4
    png = tmp_path / "plain.png"
    Image.fromarray(pixels).convert("L").save(png)
    grey = read_window(str(png), "image", InspectWindow())
    assert grey.frames.shape == (1, 72, 128, 3) and (grey.width, grey.height) == (640, 360)


@pytest.mark.parametrize("name, media_type, content", [("clip.mp4", "video", b"not a video at all"),
                                                        ("empty.mp4", "video", b""),
                                                        ("picture.png", "image", b"\x89PNG\r\n\x1a\n broken"),
                                                        ("missing.mp4", "video", None),
                                                        ("missing.jpg", "image", None)])
def test_an_unreadable_file_says_why(tmp_path, name, media_type, content):
    path = tmp_path / name
    if content is not None:
        path.write_bytes(content)
    with pytest.raises(InspectReadError) as raised:
        read_window(str(path), media_type, InspectWindow())
    assert str(raised.value)


def test_an_audio_only_file_has_no_video_stream(tmp_path):
    path = tmp_path / "sound.m4a"
    subprocess.run([FFMPEG, "-y", "-loglevel", "error", "-f", "lavfi", "-i", "sine=duration=0.2", str(path)],
                   check=True)
    with pytest.raises(InspectReadError, match="no video stream"):
        read_window(str(path), "video", InspectWindow())
