"""Where a window's cut is in the clip, and, when the trained frames around it are far apart, whether it is one.

A window's frames may be far apart in the clip (``--frame_sampling uniform`` spreads them over the whole clip;
``--source_fps`` steps over frames). Between two such frames a pan or any motion changes the picture a lot, so the
window's typical change is large and a real cut's score sits near the 4x rule: the same cut scored 3.5 in one copy
of a clip and 6.1 in another, and 2.6 to 5.7 in one clip as ``--num_frames`` went from 9 to 33. So when the largest
change of such a window is at least CUT_MIN_CHANGE and SPARSE_CUT_MIN_RATIO times the typical one, every source frame
between the two trained frames (and a few around them) is decoded and the cut rule is applied there, at the clip's
own rate, where a cut measured 15-43 times the typical change and motion at most 2.8 (``measures``): the answer
depends on the clip, not on where the window's frames fell. Either way the measures name the cut's source frame and
its time.
"""

from __future__ import annotations

from dataclasses import replace

from diffsynth_mbc.data.inspect.measures import CUT_MIN_CHANGE, WindowMeasures, cut_statistics, luma

SPARSE_CUT_MIN_RATIO = 2.0   # a far-apart window's change this many times its typical one is checked frame by frame
DENSE_PAD = 4                # source frames decoded on each side of the two trained frames: the typical change
DENSE_MAX_FRAMES = 1800      # a longer gap (a minute at 30 fps) is judged on the window's frames alone


def located_cut(measures: WindowMeasures, positions: list[int], fps: float | None, path: str) -> WindowMeasures:
    """``measures`` with the cut's source frame and time, its score and change measured on every source frame
    around it where the window's frames there are far apart (see the module docstring)."""
    if measures.cut_frame is None:
        return measures
    before, after = positions[measures.cut_frame - 1], positions[measures.cut_frame]
    gap = after - before
    if (gap <= 1 or gap > DENSE_MAX_FRAMES or measures.cut_change < CUT_MIN_CHANGE
            or measures.cut_score < SPARSE_CUT_MIN_RATIO):
        return replace(measures, cut_position=after, cut_seconds=_seconds(after, fps))
    from diffsynth_mbc.data.inspect.window import read_span

    first = max(0, before - DENSE_PAD)
    score, frame, change = cut_statistics(luma(read_span(path, first, after + DENSE_PAD)))
    position = after if frame is None else first + frame
    return replace(measures, cut_score=round(score, 4), cut_change=round(change, 4), cut_position=position,
                   cut_seconds=_seconds(position, fps), cut_dense=True)


def _seconds(position: int, fps: float | None) -> float | None:
    return round(position / fps, 4) if fps else None
