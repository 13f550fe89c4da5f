"""``--frame_sampling uniform``: the same cut gets the same answer in every copy of a clip and at every
``--num_frames``, and the finding names the source frame and its time. On the window's far-apart frames a cut scored
2.6 to 5.7 around the 4x rule (flagged in one copy, not in another); it is now judged on the clip's own frames."""

from __future__ import annotations

import pytest

from diffsynth_mbc.data.inspect.measures import WindowMeasures, findings
from diffsynth_mbc.data.inspect.run_inspection import InspectItem, measure_item
from diffsynth_mbc.data.inspect.window import InspectWindow
from inspect_media import ffmpeg

RATE = 24


@pytest.fixture(scope="module")
def copies(tmp_path_factory):
    """A 300-frame clip, a moving fractal then a panned test pattern (the cut at frame 150), and a copy with its
    first 13 frames trimmed (the cut at frame 137)."""
    folder = tmp_path_factory.mktemp("cut")
    whole, trimmed = folder / "whole.mp4", folder / "trimmed.mp4"
    ffmpeg("-f", "lavfi", "-i", f"mandelbrot=size=480x270:rate={RATE}", "-f", "lavfi", "-i",
           f"testsrc2=size=480x270:rate={RATE}", "-filter_complex",
           "[0:v]trim=end_frame=150,setpts=PTS-STARTPTS,crop=320:180:x='40+40*sin(n/25)':y='30+30*cos(n/30)'[a];"
           "[1:v]trim=end_frame=150,setpts=PTS-STARTPTS,crop=320:180:x='n*0.8':y=20[b];[a][b]concat=n=2:v=1[out]",
           "-map", "[out]", "-c:v", "libx264", "-preset", "ultrafast", "-pix_fmt", "yuv420p", str(whole))
    ffmpeg("-i", str(whole), "-vf", "trim=start_frame=13,setpts=PTS-STARTPTS", "-c:v", "libx264", "-preset",
           "ultrafast", "-pix_fmt", "yuv420p", str(trimmed))
    return {"whole": (str(whole), 300, 150), "trimmed": (str(trimmed), 287, 137)}


@pytest.mark.parametrize("num_frames", [9, 17])
@pytest.mark.parametrize("copy", ["whole", "trimmed"])
def test_the_same_cut_is_flagged_in_every_copy_naming_its_source_frame_and_time(copies, copy, num_frames):
    path, frames, cut = copies[copy]
    result = measure_item(InspectItem(path, "video", frames, float(RATE)), InspectWindow(num_frames, "uniform"))
    measures = WindowMeasures.from_dict(result.measures)
    found = findings(measures, "video", (320, 180), "320x180", (320, 180))
    assert [finding.reason for finding in found] == ["scene_cut"]
    assert measures.cut_dense and measures.cut_position == cut and measures.cut_score > 10
    seconds = cut / RATE
    assert found[0].detail.startswith(f"hard cut at source frame {cut} (0:{seconds:05.2f}), window frame "
                                      f"{measures.cut_frame} of {num_frames}: mean luma change "), found[0].detail
    assert found[0].detail.endswith("typical (at the clip's own frame rate, around the trained frames)")


def test_a_window_of_neighbouring_frames_names_the_cut_without_decoding_again(copies):
    path, frames, cut = copies["whole"]
    result = measure_item(InspectItem(path, "video", frames, float(RATE)), InspectWindow(frames, "head"))
    measures = WindowMeasures.from_dict(result.measures)
    assert not measures.cut_dense and measures.cut_position == measures.cut_frame == cut
    assert measures.cut_seconds == cut / RATE
