"""``--frame_sampling random_window`` measures every frame of a clip as the frames stream: the memory stays that of
a chunk, however long the clip (it held every frame: 3.8 GB for a 10-minute clip), and the measures are those of
the whole window at once."""

from __future__ import annotations

import tracemalloc

import numpy as np

from diffsynth_mbc.data.inspect.measures import WindowMeter, measure_window
from diffsynth_mbc.data.inspect.run_inspection import InspectItem, measure_item
from diffsynth_mbc.data.inspect.window import InspectWindow, read_window
from inspect_media import ffmpeg


def test_a_window_measured_in_chunks_measures_as_the_whole_window():
    generator = np.random.default_rng(7)
    frames = generator.integers(0, 255, (150, 72, 128, 3), dtype=np.uint8)
    frames[:, :8] = 0                                   # a bar on top, in every frame
    frames[40:45] = 0                                   # black frames
    frames[90:] = frames[90:] // 3                      # a cut to a darker shot
    whole = measure_window(frames)
    meter = WindowMeter(len(frames))
    for frame in frames:
        meter.push(frame)
    assert meter.result() == whole
    assert whole.cut_frame == 40 and whole.black_share == round(5 / 150, 4) and whole.bars[0] > 0.1


def clip(path, frames: int) -> str:
    ffmpeg("-f", "lavfi", "-i", "testsrc2=size=320x180:rate=30", "-frames:v", str(frames), "-c:v", "libx264",
           "-preset", "ultrafast", "-pix_fmt", "yuv420p", str(path))
    return str(path)


def peak_bytes(item: InspectItem, window: InspectWindow) -> tuple[dict, int]:
    tracemalloc.start()
    try:
        result = measure_item(item, window)
        return result.measures, tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_random_window_memory_does_not_grow_with_the_clip(tmp_path):
    window = InspectWindow(17, "random_window")
    short = InspectItem(clip(tmp_path / "short.mp4", 300), "video", 300, 30.0)
    long = InspectItem(clip(tmp_path / "long.mp4", 1200), "video", 1200, 30.0)
    short_measures, short_peak = peak_bytes(short, window)
    long_measures, long_peak = peak_bytes(long, window)
    held = 1200 * 72 * 128 * 3   # every 128x72 frame of the long clip at once: 33 MB
    assert long_peak < held / 4 and long_peak < 1.25 * short_peak, (short_peak, long_peak)
    # the streamed measures are those of the whole window read at once
    frames = read_window(long.path, "video", window, available=1200, fps=30.0).frames
    located = {"cut_position", "cut_seconds"}   # where the cut is in the clip: the window's positions say it
    whole = {key: value for key, value in measure_window(frames).to_dict().items() if key not in located}
    assert len(frames) == 1200 and {key: long_measures[key] for key in whole} == whole
    assert short_measures["frames"] == 300
