"""Small real media and an MBC-format catalogue, for tests and the training demo.

Videos are H.264 mp4 (libx264, yuv420p, so width and height must be even) written through
imageio's ffmpeg backend; images are PNG or JPEG written with PIL. ``make_demo_catalog`` replaces a file
only when its bytes differ, so a latent cache built from one demo run (it keys files by size and mtime)
is still good for the next.
"""

from __future__ import annotations

import csv
import io
from pathlib import Path

import numpy as np
from PIL import Image

from diffsynth_mbc.atomic import atomic_path

# Captions in the catalogue's own style: Korean and English, with commas, quotes and a newline.
DEMO_CAPTIONS = (
    "뉴스 스튜디오에서 앵커가 말한다, 카메라는 천천히 다가간다.",
    'A reporter says "good evening", then turns to the screen.',
    "한강 위로 해가 지고, 구름이 \"천천히\" 흘러간다.",
    "Crowd at a festival, lights, music\nand fireworks at night.",
    "드라마 장면: 두 사람이 카페에서 이야기한다",
    "An aerial shot of Seoul, wide, slow pan to the left.",
)


def _pattern(width: int, height: int, phase: int, seed: int) -> np.ndarray:
    """An RGB frame with a gradient that shifts with ``phase`` plus a moving square."""
    rng = np.random.default_rng(seed)
    base_colour = rng.integers(0, 256, size=3)
    ys, xs = np.mgrid[0:height, 0:width]
    frame = np.empty((height, width, 3), dtype=np.uint8)
    frame[..., 0] = (xs * 4 + phase * 16 + base_colour[0]) % 256
    frame[..., 1] = (ys * 4 + phase * 8 + base_colour[1]) % 256
    frame[..., 2] = ((xs + ys) * 2 + base_colour[2]) % 256
    side = max(2, min(width, height) // 4)
    left = (phase * 3) % max(1, width - side)
    top = (phase * 2) % max(1, height - side)
    frame[top:top + side, left:left + side] = 255
    return frame


def write_video(path, num_frames: int, width: int, height: int, fps: int = 8, seed: int = 0) -> Path:
    """Write an mp4 of ``num_frames`` distinct frames at width x height (both even)."""
    import imageio.v2 as imageio  # imported here: only video writers need the ffmpeg plugin

    if width % 2 or height % 2:
        raise ValueError(f"yuv420p needs even sizes, got {width}x{height}")
    if num_frames < 1:
        raise ValueError(f"num_frames must be >= 1, got {num_frames}")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    writer = imageio.get_writer(
        path, format="FFMPEG", mode="I", fps=fps, codec="libx264", pixelformat="yuv420p",
        macro_block_size=1, ffmpeg_log_level="error", output_params=["-preset", "ultrafast"],
    )
    try:
        for index in range(num_frames):
            writer.append_data(_pattern(width, height, index, seed))
    finally:
        writer.close()
    return path


def write_image(path, width: int, height: int, seed: int = 0) -> Path:
    """Write a PNG or JPEG (chosen by the suffix) of width x height."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    image = Image.fromarray(_pattern(width, height, seed, seed))
    if path.suffix.lower() in (".jpg", ".jpeg"):
        image.save(path, format="JPEG", quality=90)
    else:
        image.save(path)
    return path


def _write_if_changed(path: Path, write) -> None:
    """``write(temp_path)`` beside ``path`` (same suffix, which picks the format), moved into place only when its
    bytes differ from ``path``'s: an unchanged file keeps its mtime."""
    with atomic_path(path, suffix=path.suffix, keep_if_same=True) as temp:
        write(temp)


def make_demo_catalog(
    root,
    num_videos: int = 6,
    num_images: int = 6,
    width: int = 64,
    height: int = 64,
    num_frames: int = 9,
    seed: int = 0,
) -> Path:
    """Write media under ``root/media/`` and ``root/catalog.csv`` (file_path,caption,media_type).

    file_path is relative to ``root``; images alternate PNG and JPEG; captions cycle through
    DEMO_CAPTIONS with the item number appended so every caption is distinct.
    """
    root = Path(root)
    media_dir = root / "media"
    rows = []
    for index in range(num_videos):
        relative = f"media/video_{index:03d}.mp4"
        _write_if_changed(root / relative, lambda temp, index=index: write_video(temp, num_frames, width, height,
                                                                                  seed=seed + index))
        caption = f"{DEMO_CAPTIONS[index % len(DEMO_CAPTIONS)]} #{index}"
        rows.append((relative, caption, "video"))
    for index in range(num_images):
        suffix = "png" if index % 2 == 0 else "jpg"
        relative = f"media/image_{index:03d}.{suffix}"
        _write_if_changed(root / relative, lambda temp, index=index: write_image(temp, width, height,
                                                                                  seed=seed + 1000 + index))
        caption = f"{DEMO_CAPTIONS[(index + 3) % len(DEMO_CAPTIONS)]} #{index}"
        rows.append((relative, caption, "image"))
    media_dir.mkdir(parents=True, exist_ok=True)
    catalog_path = root / "catalog.csv"
    text = io.StringIO()
    writer = csv.writer(text, lineterminator="\n")
    writer.writerow(("file_path", "caption", "media_type"))
    writer.writerows(rows)
    _write_if_changed(catalog_path, lambda temp: temp.write_text(text.getvalue(), encoding="utf-8", newline=""))
    return catalog_path
