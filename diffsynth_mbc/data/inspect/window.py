"""Decode only the frames that train, small: the inspection's view of a row.

Which frames: the training's own choice (``frame_selection.select_frames`` for head and uniform sampling, epoch 0),
so a cut or a black stretch outside them is no finding; for ``random_window`` every frame of the timeline, since
some epoch's window can train any of them. A clip that ends before the container said gets the frames the
training would take from the frames it really has.

How: PyAV, one codec thread (the runner parallelises across processes, where threads would only contend), decoding
in order and stopping after the last wanted frame. Only wanted frames are converted, straight to a small RGB
picture (swscale's area filter, never a full-size RGB frame), turned by the display matrix as
``clip_reader`` turns it (phone clips). The long side is ``ANALYSIS_LONG_SIDE`` pixels: black and bars are
measured on these frames, cuts, motion and hashes on thumbnails of 64 pixels or fewer, and they are big enough
to show. Images: PIL, EXIF orientation applied, JPEGs decoded at a reduced scale.

Measured on a 1280x720 H.264 testsrc2 clip (30 fps, High profile, 3 Mbit/s), 17 frames, CPU time of one core
(medians of interleaved runs on a shared machine): decoding ~44 ms, ~38 ms with the deblocking filter skipped
(``DECODER_OPTIONS``); the 17 conversions to 128x72 RGB ~17 ms (memory-bound: a gray-only conversion costs
~12). Skipping the deblocking filter moved no measure that decides a finding (cut changes by under 0.2 luma
levels, motion by under 2%, hashes by 0-2 bits, copies at CRF 42 as near as before), since the blocking it
would smooth is far below the 10x downscale; ``flags2=+fast`` saved nothing measurable, and ``skip_frame``
would drop frames that train.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import asdict, dataclass

import numpy as np

from diffsynth_mbc.data.media.clip_reader import ClipReadError, decode_frames, display_turns
from diffsynth_mbc.data.media.frame_selection import FrameSelection, frames_needed, select_frames, timeline

ANALYSIS_LONG_SIDE = 128   # pixels: twice the statistics' largest thumbnail (64), enough for the eye too
DECODER_OPTIONS = {"skip_loop_filter": "all"}   # no deblocking: ~12% less decoding, invisible at 128 px


@dataclass(frozen=True)
class InspectWindow:
    """Which frames of a clip train: the training's --num_frames, --frame_sampling, --source_fps and --seed."""
    num_frames: int = 17
    sampling: str = "head"
    source_fps: float | None = None
    seed: int = 0

    def __post_init__(self):
        if self.num_frames < 1:
            raise ValueError(f"--num_frames must be at least 1, got {self.num_frames}")
        self.selection()   # FrameSelection checks the sampling and the rate

    def selection(self) -> FrameSelection:
        """The training's selection (short clips shortened, as DiffSynth does)."""
        return FrameSelection(sampling=self.sampling, source_fps=self.source_fps, short_clips="shorten",
                              seed=self.seed)

    def positions(self, available: int, fps: float | None) -> list[int]:
        """Sorted unique source frame indices to inspect. head/uniform: exactly the frames ``select_frames`` gives
        (epoch 0). random_window: every frame of the timeline, since some epoch's window can train any of them
        (a timeline shorter than the window trains its leading frames, as in the other modes)."""
        if available < 1:
            return []
        if self.sampling == "head":   # the head of a long clip is the head of any clip long enough for it
            available = min(available, self.head_span(fps))
        if self.sampling == "random_window":
            line = timeline(available, fps, self.source_fps)
            if len(line) >= self.num_frames:
                return sorted(set(line))
        return sorted(set(select_frames(available, fps, self.num_frames, self.selection())))

    def head_span(self, fps: float | None) -> int:
        """Source frames enough for head sampling: its positions in any longer clip are those in this many
        (``frames_needed`` plus a timeline step, so no position is clipped to the clip's end)."""
        step = fps / self.source_fps if fps and self.source_fps else 1.0
        return frames_needed(self.num_frames, fps, self.source_fps) + math.ceil(step) + 1

    def settings(self) -> dict:
        """The fields as a plain dict (for a cache key)."""
        return asdict(self)


@dataclass
class WindowFrames:
    frames: np.ndarray     # uint8 [T, h, w, 3] RGB, displayed orientation, long side = long_side
    positions: list[int]   # source frame index of each frame (images: [0])
    width: int             # the source's displayed width and height (after rotation)
    height: int


class InspectReadError(ValueError):
    """The file cannot be read for inspection; the message says why (the caller adds the row and the file)."""


def analysis_size(width: int, height: int, long_side: int = ANALYSIS_LONG_SIDE) -> tuple[int, int]:
    """(width, height) of the small picture: the long side ``long_side``, the short side even (at least 2),
    the aspect kept as nearly as that allows."""
    if width < 1 or height < 1:
        raise InspectReadError(f"the picture is {width}x{height}")
    long, short = max(width, height), min(width, height)
    small = max(2, 2 * round(short * long_side / long / 2))
    return (long_side, small) if width >= height else (small, long_side)


def read_window(path: str, media_type: str, window: InspectWindow, *, available: int | None = None,
                fps: float | None = None, long_side: int = ANALYSIS_LONG_SIDE, keep=None) -> WindowFrames:
    """The frames of the row at ``path`` that train under ``window``, small (see the module docstring).
    ``available`` and ``fps`` are the probe's (the container's are used where they are None). ``keep(count)``: the
    indices (into a window of ``count`` frames) of the only frames to return (a contact sheet's strip); all when
    None. ``positions`` are those of the frames returned."""
    if media_type == "image":
        return _read_image(path, long_side)
    kept: dict[int, np.ndarray] = {}

    def new_sink(count: int):
        kept.clear()
        wanted = set(range(count) if keep is None else keep(count))
        return lambda index, frame: kept.__setitem__(index, frame) if index in wanted else None
    streamed = stream_window(path, window, new_sink, available=available, fps=fps, long_side=long_side)
    order = sorted(kept)
    return WindowFrames(np.stack([kept[index] for index in order]), [streamed.positions[index] for index in order],
                        streamed.width, streamed.height)


@dataclass(frozen=True)
class StreamedWindow:
    positions: list[int]   # the source frame index of each frame that went to the sink
    width: int             # the source's displayed width and height
    height: int
    fps: float | None      # the probe's rate, else the container's


@contextlib.contextmanager
def opened_clip(path: str):
    """(container, its video stream) for decoding in one thread without deblocking (``DECODER_OPTIONS``)."""
    import av

    try:
        container = av.open(str(path))
    except (av.FFmpegError, OSError, ValueError) as exc:
        raise InspectReadError(f"cannot open: {exc}") from None
    try:
        if not container.streams.video:
            raise InspectReadError("no video stream")
        stream = container.streams.video[0]
        stream.thread_type = "NONE"
        stream.codec_context.options = dict(DECODER_OPTIONS)
        yield container, stream
    finally:
        container.close()


def read_span(path: str, first: int, last: int, long_side: int = ANALYSIS_LONG_SIDE) -> np.ndarray:
    """Every source frame from ``first`` to ``last`` (fewer where the clip ends first), small, in order."""
    frames = []
    with opened_clip(path) as (container, stream):
        _decode_positions(container, stream, list(range(first, last + 1)), long_side,
                          lambda _index, frame: frames.append(frame))
    return np.stack(frames)


def stream_window(path: str, window: InspectWindow, new_sink, *, available: int | None = None,
                  fps: float | None = None, long_side: int = ANALYSIS_LONG_SIDE) -> StreamedWindow:
    """The clip's frames that train under ``window``, small, one at a time as they decode, to
    ``new_sink(count)(index in the window, frame)``: nothing but the frame in hand is held, however long the clip.
    ``new_sink`` is asked again for a fresh sink when the clip ends before the container said (its frames are then
    the ones the training takes from what it has)."""
    with opened_clip(path) as (container, stream):
        if not fps:
            rate = stream.guessed_rate or stream.average_rate   # as the training's reader (clip_reader)
            fps = float(rate) if rate else None
        if available is None:
            available = _container_count(container, stream, window, fps)
        wanted = window.positions(available, fps)
        if not wanted:
            raise InspectReadError("the clip has no frames")
        decoded, shape = _decode_positions(container, stream, wanted, long_side, new_sink(len(wanted)))
        if decoded <= wanted[-1]:   # the clip ends early: the frames training would take from what it has
            wanted = window.positions(decoded, fps)
            container.seek(0)
            _, shape = _decode_positions(container, stream, wanted, long_side, new_sink(len(wanted)))
    width, height, _ = shape
    return StreamedWindow(list(wanted), width, height, fps)


def _container_count(container, stream, window: InspectWindow, fps: float | None) -> int:
    """The clip's frame count as far as the positions need it: head sampling needs none (a clip shorter than its
    span ends early and is handled then); the others take the container's count, else count its packets."""
    if window.sampling == "head":
        return window.head_span(fps)
    if stream.frames and stream.frames > 0:
        return int(stream.frames)
    count = sum(1 for packet in container.demux(stream) if packet.size)
    container.seek(0)
    return count


def _decode_positions(container, stream, wanted: list[int], long_side: int, sink):
    """(frames decoded, (displayed width, displayed height, quarter turns)), each wanted frame among the first
    ``max(wanted) + 1`` going small to ``sink(index in wanted, array)``, through the clip reader's decoding loop."""
    shapes = []
    order = {position: index for index, position in enumerate(wanted)}

    def converter_for(first):
        turns = display_turns(first)[0]
        width, height = (first.height, first.width) if turns % 2 else (first.width, first.height)
        shapes.append((width, height, turns))
        return lambda frame: _small_rgb(frame, shapes[0], long_side)

    try:
        _, count = decode_frames(container, stream, wanted[-1], set(order), converter_for,
                                 sink=lambda position, frame: sink(order[position], frame))
    except ClipReadError as exc:
        raise InspectReadError(str(exc)) from None
    return count, shapes[0]


def _small_rgb(frame, shape: tuple[int, int, int], long_side: int):
    """The frame as a small RGB array in displayed orientation: scaled in its stored orientation, then turned
    (a mirroring display matrix is not mirrored: no measure depends on it)."""
    width, height, turns = shape
    small_width, small_height = analysis_size(width, height, long_side)
    if turns % 2:
        small_width, small_height = small_height, small_width
    pixels = frame.reformat(width=small_width, height=small_height, format="rgb24",
                            interpolation="AREA").to_ndarray()
    return np.rot90(pixels, turns) if turns else pixels


def _read_image(path: str, long_side: int) -> WindowFrames:
    """The image as a one-frame window: EXIF orientation applied, JPEGs decoded at a reduced scale (``draft``)."""
    from PIL import Image

    from diffsynth_mbc.data.media.orientation import displayed_size, is_turned, upright

    try:
        with Image.open(path) as image:
            turned = is_turned(image)
            width, height = displayed_size(image)
            size = analysis_size(width, height, long_side)
            image.draft("RGB", size[::-1] if turned else size)   # JPEG: 1/2..1/8 scale, never below the size
            standing = upright(image).convert("RGB")
            pixels = np.asarray(standing.resize(size, Image.Resampling.BOX, reducing_gap=2.0))
    except (OSError, ValueError, SyntaxError, Image.DecompressionBombError) as exc:
        raise InspectReadError(f"cannot read the image: {exc}") from None
    return WindowFrames(pixels[None].copy(), [0], width, height)
