"""Decode only the frames training uses: the first ``num_frames`` of a clip, in-process, with PyAV.

DiffSynth 1.1.8's ``VideoDataset.load_video`` first calls ``reader.count_frames()``, which has ffmpeg
decode the whole clip just to learn its length, then pipes full RGB frames out of an ffmpeg
subprocess. Here the length comes from the container (``stream.frames``), decoding stops after the
last frame that trains, and frames never leave the process.

Same frames as DiffSynth: the same count rule (the first ``num_frames``; a shorter clip is cut to
4k+1 frames, ``VideoDataset.get_num_frames``), frame i is the i-th decoded frame, RGB as PIL images
(the caller resizes and crops with DiffSynth's own ``crop_and_resize``). The container's count is
trusted only where it cannot change the result: a clip it calls short is counted by decoding it
(short clips are cheap), and a clip that ends early falls back to the frames it really has.
Frames are shown as ffmpeg shows them: a display matrix that turns the picture by a multiple of 90
degrees (phone clips) is applied, which is an exact permutation of the pixels. Where PyAV cannot give
ffmpeg's pixels (more than 8 bits per component, where swscale's conversion differs; a mirrored or
odd-angle display matrix; variable frame rate) ``ReferenceReaderNeeded`` tells the caller to use
DiffSynth's reader for that clip. Pixel values are the same as imageio's (measured in the README).

PyAV (BSD; its wheels bundle FFmpeg's libraries) installs with pip everywhere the project does and
needs no system FFmpeg; torchcodec would tie us to one torch release per version.
"""

from __future__ import annotations

import gc
import os
import struct
import subprocess
import sys

from diffsynth_mbc.data.media.frame_selection import frames_to_use, select_frames, timeline

_STARTS_A_PROGRAM = subprocess.Popen._execute_child.__code__   # the frame that forks to exec a program


def _collect_decoder_garbage_before_fork() -> None:
    """A forked child (a data-loader worker, an inspection worker) inherits the garbage this process has not yet
    collected. When the child's collector frees a decoder's frame converter there, FFmpeg waits forever for its
    slice threads, which the child does not have: the worker hangs. Collected here, in the parent, before each
    fork, once PyAV is in use. Not before the fork ``subprocess`` makes to start a program (ffmpeg, with a
    ``preexec_fn``): CPython turns the collector off for it and the child runs no Python but that function
    before it execs the program, so nothing is freed there, and a full collection of a large process costs
    0.1-0.5 s per program started."""
    caller = sys._getframe().f_back   # None when the fork comes from C code with no Python frame above it
    if "av" in sys.modules and (caller is None or caller.f_code is not _STARTS_A_PROGRAM):
        gc.collect()


os.register_at_fork(before=_collect_decoder_garbage_before_fork)

DECODERS = ("fast", "diffsynth")


class ClipReadError(ValueError):
    """The clip cannot be decoded; the message says why (the dataset adds the row and the file)."""


class ReferenceReaderNeeded(Exception):
    """PyAV cannot give this clip's frames as DiffSynth's reader (ffmpeg) gives them; the caller uses that
    reader instead. The message says why."""


class IrregularTiming(ReferenceReaderNeeded):
    """Frames are not evenly spaced at the stream's frame rate (variable frame rate): DiffSynth's reader gets
    constant-rate frames from ffmpeg (repeating or dropping some), so the caller uses that reader instead."""


_TURNS = {1: "ROTATE_90", 2: "ROTATE_180", 3: "ROTATE_270"}   # counterclockwise, as np.rot90 and ffmpeg


def display_turns(frame) -> tuple[int, bool]:
    """(quarter turns counterclockwise, exact) of the frame's display matrix, as ffmpeg applies it to show the
    frame; ``exact`` is False for a mirrored matrix or an angle that is not a multiple of 90 degrees."""
    rotation = float(frame.rotation or 0)
    turns = round(rotation / 90)
    exact = abs(rotation - 90 * turns) < 0.01
    for data in frame.side_data:
        if str(data.type).endswith("DISPLAYMATRIX"):
            a, b, _, c, d, *_ = struct.unpack("<9i", bytes(data)[:36])
            exact = exact and a * d - b * c > 0   # a negative determinant mirrors the picture
    return turns % 4, exact


def _converter(frame, path: str):
    """frame -> RGB PIL image as ffmpeg would show it; ReferenceReaderNeeded where PyAV cannot match it."""
    bits = max((component.bits for component in frame.format.components), default=8)
    if bits > 8:
        raise ReferenceReaderNeeded(f"{path}: {frame.format.name} has {bits} bits per component; PyAV's colour "
                                    "conversion differs from ffmpeg's there")
    turns, exact = display_turns(frame)
    if not exact:
        raise ReferenceReaderNeeded(f"{path}: mirrored or {frame.rotation}-degree display matrix")
    if not turns:
        return lambda decoded: decoded.to_image()
    from PIL import Image

    transpose = getattr(Image.Transpose, _TURNS[turns])
    return lambda decoded: decoded.to_image().transpose(transpose)




def _open(path: str):
    import av

    try:
        container = av.open(str(path))
    except (av.FFmpegError, OSError, ValueError) as exc:
        raise ClipReadError(f"cannot open: {exc}") from None
    if not container.streams.video:
        container.close()
        raise ClipReadError("no video stream")
    stream = container.streams.video[0]
    stream.thread_type = "AUTO"
    return container, stream


def _decode(container, stream, limit: int | None, times: list | None = None, path: str = "") -> list:
    """The first ``limit`` decoded frames (all of them when None), as RGB PIL images shown as ffmpeg shows them;
    their times (s) go to ``times``."""
    import av

    images = []
    convert = None
    try:
        for frame in container.decode(stream):
            convert = convert or _converter(frame, path)
            images.append(convert(frame))
            if times is not None:
                times.append(None if frame.pts is None else float(frame.pts * stream.time_base))
            if limit is not None and len(images) >= limit:
                break
    except av.FFmpegError as exc:
        if not images:
            raise ClipReadError(f"cannot decode: {exc}") from None
        # A damaged tail: what decoded before it is the clip, as ffmpeg's own reader would see it.
    return images


def read_leading_frames(path: str, num_frames: int, division: int = 4, remainder: int = 1) -> list:
    """The frames DiffSynth would train on from the clip at ``path`` (RGB PIL images, not yet resized)."""
    container, stream = _open(path)
    times: list = []
    try:
        listed = stream.frames or 0
        if listed >= num_frames:
            images = _decode(container, stream, num_frames, times, path)
        else:   # no count, or a short clip: decode it all (short) to know how many frames it has
            images = _decode(container, stream, None, times, path)
        rate = stream.guessed_rate or stream.average_rate
        start = stream.start_time * stream.time_base if stream.start_time is not None else None
    finally:
        container.close()
    if not images:
        raise ClipReadError("no decodable video frame")
    used = frames_to_use(len(images), num_frames, division, remainder)
    if not evenly_spaced(times[:used], float(rate) if rate else None, None if start is None else float(start)):
        raise IrregularTiming(f"{path}: frames are not evenly spaced at {rate} fps")
    return images[:used]


def read_selected_frames(path: str, num_frames: int, selection, *, epoch: int = 0, sample: int = 0,
                         division: int = 4, remainder: int = 1) -> list:
    """The frames ``selection`` (a ``frame_selection.FrameSelection``) trains on from the clip at ``path``: RGB PIL
    images, not yet resized. Decoding stops after the last frame used and only used frames are converted to RGB,
    so the fast decoder keeps its lead in every mode. The clip's length comes from the container (its packets are
    counted where it has none); a container that over-counts is decoded again with the real length."""
    container, stream = _open(path)
    try:
        listed = stream.frames or 0
        if listed <= 0:
            listed = sum(1 for packet in container.demux(stream) if packet.size)
            container.seek(0)
        rate = stream.guessed_rate or stream.average_rate
        fps = float(rate) if rate else None
        start = float(stream.start_time * stream.time_base) if stream.start_time is not None else None

        def plan(count):
            return select_frames(count, fps, num_frames, selection, epoch=epoch, sample=sample, division=division,
                                 remainder=remainder)

        times: list = []
        if len(timeline(listed, fps, selection.source_fps)) < num_frames:
            # Short, or so the container says: decode it all (short clips are cheap) to know its real length.
            decoded, count = _decode_indices(container, stream, None, None, times, path)
            indices = plan(count)
        else:
            indices = plan(listed)
            decoded, count = _decode_indices(container, stream, max(indices), set(indices), times, path)
            if count <= max(indices):   # the container promised more frames than the clip has
                indices = plan(count)
                if not set(indices) <= set(decoded):
                    container.seek(0)
                    times = []
                    decoded, _ = _decode_indices(container, stream, max(indices), set(indices), times, path)
    finally:
        container.close()
    if not evenly_spaced(times, fps, start):
        raise IrregularTiming(f"{path}: frames are not evenly spaced at {rate} fps")
    return [decoded[index] for index in indices]


def _decode_indices(container, stream, last: int | None, wanted: set | None, times: list,
                    path: str) -> tuple[dict, int]:
    """({index: RGB image} of the ``wanted`` frames (all when None) among the first ``last + 1`` (all when None),
    frames decoded); every decoded frame's time goes to ``times`` (to prove even spacing)."""
    return decode_frames(container, stream, last, wanted, lambda frame: _converter(frame, path), times)


def decode_frames(container, stream, last: int | None, wanted: set | None, converter_for,
                  times: list | None = None, sink=None) -> tuple[dict, int]:
    """({index: converted frame} of the ``wanted`` frames (all when None) among the first ``last + 1`` (all when
    None), frames decoded). ``converter_for(first decoded frame)`` gives the function that converts each wanted
    frame (it may refuse the clip by raising). Each decoded frame's time goes to ``times`` when given. ``sink``:
    each converted frame goes to ``sink(index, frame)`` as it decodes instead of into the dict (which stays empty),
    so a long clip is never held. A damaged tail ends the clip where it breaks; ClipReadError when no frame decodes
    at all."""
    import av

    frames, count, convert = {}, 0, None
    try:
        for frame in container.decode(stream):
            convert = convert or converter_for(frame)
            if wanted is None or count in wanted:
                if sink is None:
                    frames[count] = convert(frame)
                else:
                    sink(count, convert(frame))
            if times is not None:
                times.append(None if frame.pts is None else float(frame.pts * stream.time_base))
            count += 1
            if last is not None and count > last:
                break
    except av.FFmpegError as exc:
        if not count:
            raise ClipReadError(f"cannot decode: {exc}") from None
        # A damaged tail: what decoded before it is the clip, as ffmpeg's own reader would see it.
    if not count:
        raise ClipReadError("no decodable video frame")
    return frames, count


def evenly_spaced(times: list, fps: float | None, start: float | None, tolerance: float = 0.25) -> bool:
    """Whether frame times are start, start + 1/fps, start + 2/fps, ...: then ffmpeg's constant-rate output
    (what DiffSynth's reader gets) is exactly the decoded frames."""
    if not times:
        return True
    if not fps or any(t is None for t in times):
        return False   # timing unknown: not provably the same frames
    step = 1.0 / fps
    origin = times[0] if start is None else start
    return all(abs(t - (origin + i * step)) <= tolerance * step for i, t in enumerate(times))


def probe_clip(path: str) -> tuple[int, int, int, float | None]:
    """(width, height, frame count, fps) from the container, decoding one frame to prove it is readable.

    The size is the displayed one (a display matrix's quarter turns applied, as DiffSynth's reader gets the
    frames). The count is the container's; where it has none, the packets are counted (no decoding).
    """
    container, stream = _open(path)
    try:
        first = _first_frame(container, stream)
        count = stream.frames or 0
        if count <= 0:
            container.seek(0)
            count = sum(1 for packet in container.demux(stream) if packet.size)
        rate = stream.average_rate or stream.guessed_rate
        width, height = first.width, first.height
        turns, _ = display_turns(first)
        rotation = float(first.rotation or 0)
        if abs(rotation - 90 * round(rotation / 90)) >= 0.01:   # each draw would go to DiffSynth's reader, ~10 s
            raise ClipReadError(f"its display matrix turns the picture {rotation:g} degrees, which no bucket holds "
                                "upright (quarter turns are applied): re-encode it as it should be seen, e.g. "
                                "ffmpeg -i IN -vf rotate=... OUT")
        if turns % 2:
            width, height = height, width
        return width, height, int(count), float(rate) if rate else None
    finally:
        container.close()


def _first_frame(container, stream):
    """The first decoded frame (PyAV's), or ClipReadError."""
    import av

    try:
        for frame in container.decode(stream):
            return frame
    except av.FFmpegError as exc:
        raise ClipReadError(f"cannot decode: {exc}") from None
    raise ClipReadError("no decodable video frame")
