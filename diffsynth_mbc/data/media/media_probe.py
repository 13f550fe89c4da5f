"""Read width, height, frame count and fps of media files, in parallel.

Videos go through imageio-ffmpeg (the ffmpeg binary it ships): the frame count comes from
``count_frames_and_secs``, the same call DiffSynth's video reader uses (``reader.count_frames()``),
so "short" here means short for DiffSynth too; size and fps come from the stream header, and the
first frame is decoded to prove the file is readable. Images are opened and verified with PIL.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable, Iterable, Sequence


@dataclass(frozen=True)
class MediaInfo:
    width: int
    height: int
    num_frames: int
    fps: float | None  # None for images


@dataclass(frozen=True)
class ProbeResult:
    path: str
    info: MediaInfo | None
    error: str | None  # the decoder's message when the file could not be read


PIL_PIXEL_LIMIT = 89_478_485   # PIL's Image.MAX_IMAGE_PIXELS: an image above it warns of a decompression bomb


def quiet_pil_pixel_warnings() -> None:
    """PIL's DecompressionBombWarning off in this process (and the workers it forks): it came once per stage that
    opens a large image (probe, inspection, every decode in training); the converter says it once itself."""
    import warnings

    from PIL import Image

    warnings.filterwarnings("ignore", category=Image.DecompressionBombWarning)


def default_workers() -> int:
    return min(8, os.cpu_count() or 1)


def probe_video(path: str) -> MediaInfo:
    import imageio_ffmpeg

    frames = imageio_ffmpeg.read_frames(path)
    try:
        meta = next(frames)
        next(frames)  # decode the first frame: a header alone can hide a broken stream
    except StopIteration:
        raise ValueError("no decodable video frame") from None
    finally:
        frames.close()
    num_frames, _seconds = imageio_ffmpeg.count_frames_and_secs(path)
    if num_frames < 1:
        raise ValueError("video has no frames")
    width, height = meta["size"]
    fps = meta.get("fps")
    return MediaInfo(int(width), int(height), int(num_frames), float(fps) if fps else None)


def probe_image(path: str) -> MediaInfo:
    from PIL import Image

    from diffsynth_mbc.data.media.orientation import displayed_size

    with Image.open(path) as image:
        image.verify()   # first: it must come straight after opening
    with Image.open(path) as image:
        width, height = displayed_size(image)   # the upright picture's: what trains (data/media/orientation.py)
    return MediaInfo(int(width), int(height), 1, None)


def probe_video_fast(path: str) -> MediaInfo:
    """Size, count and fps from the container (PyAV), one frame decoded; no whole-clip decode."""
    from diffsynth_mbc.data.media.clip_reader import probe_clip

    width, height, num_frames, fps = probe_clip(path)
    if num_frames < 1:
        raise ValueError("video has no frames")
    return MediaInfo(width, height, num_frames, fps)


def probe_file(path: str, media_type: str, decoder: str = "fast") -> ProbeResult:
    """Probe one file; never raises for a bad file, the message goes into ``error``."""
    try:
        if media_type == "video":
            info = probe_video_fast(path) if decoder == "fast" else probe_video(path)
        else:
            info = probe_image(path)
    except Exception as error:  # any decoder failure makes the file unreadable, with its message
        message = " ".join(str(error).split()) or type(error).__name__
        return ProbeResult(path, None, f"{type(error).__name__}: {message[:500]}")
    return ProbeResult(path, info, None)


def probe_files(
    items: Sequence[tuple[str, str]],
    workers: int | None = None,
    on_done: Callable[[ProbeResult], None] | None = None,
    decoder: str = "fast",
) -> list[ProbeResult]:
    """Probe (path, media_type) pairs with a thread pool; results come back in input order.

    Threads suffice: video probing waits on ffmpeg subprocesses and PIL releases the GIL while
    decoding.
    """
    workers = max(1, workers or default_workers())
    results: list[ProbeResult] = []
    with ThreadPoolExecutor(max_workers=workers) as pool:
        for result in pool.map(lambda item: probe_file(*item, decoder=decoder), items):
            results.append(result)
            if on_done is not None:
                on_done(result)
    return results


def histogram(values: Iterable) -> dict[str, int]:
    """Counts of each distinct value, keyed by its text, in ascending value order."""
    counts: dict = {}
    for value in values:
        counts[value] = counts.get(value, 0) + 1
    return {_key(value): counts[value] for value in sorted(counts, key=lambda v: (v is None, v or 0))}


def _key(value) -> str:
    if value is None:
        return "none"
    if isinstance(value, float):
        return f"{value:g}"
    return str(value)
