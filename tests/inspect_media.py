"""Media that show what ``--inspect`` flags, and look-alikes that it must not flag, for its tests.

Clips are 192x108 (a tenth of 1920x1080), 20 frames at 24 fps, made with the bundled ffmpeg: a clean moving clip
(mandelbrot), a hard cut at frame 8, black, frozen (a still with grain), letterboxed (a 2.4:1 picture padded to
16:9), pillarboxed (4:3 padded), a re-encoded, resized copy of the clean clip, a slow fade, a pan, a night scene
with lit windows and moving lights, a talking head; images: a picture, its recompressed, resized copy, another
picture.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import imageio_ffmpeg
import numpy as np
from PIL import Image

FFMPEG = imageio_ffmpeg.get_ffmpeg_exe()
WIDTH, HEIGHT, RATE, FRAMES = 192, 108, 24, 20
SIZE = f"{WIDTH}x{HEIGHT}"


def ffmpeg(*arguments, data: bytes | None = None):
    subprocess.run([FFMPEG, "-y", "-loglevel", "error", *arguments], input=data, check=True)


def lavfi_clip(path, graph: str, crf: int = 23) -> str:
    ffmpeg("-f", "lavfi", "-i", graph, "-frames:v", str(FRAMES), "-c:v", "libx264", "-crf", str(crf),
           "-pix_fmt", "yuv420p", str(path))
    return str(path)


def numpy_clip(path, frames: np.ndarray, crf: int = 23) -> str:
    ffmpeg("-f", "rawvideo", "-pix_fmt", "rgb24", "-s", SIZE, "-r", str(RATE), "-i", "-", "-c:v", "libx264",
           "-crf", str(crf), "-pix_fmt", "yuv420p", str(path), data=np.clip(frames, 0, 255).astype(np.uint8).tobytes())
    return str(path)


def still_png(path, graph: str) -> str:
    ffmpeg("-f", "lavfi", "-i", graph, "-frames:v", "1", str(path))
    return str(path)


def night_scene() -> np.ndarray:
    """Dark sky over dark buildings with lit windows, a road with two cars' lights moving: about 4% lit."""
    rng = np.random.default_rng(2)
    rows = np.arange(HEIGHT)[:, None]
    base = np.where(rows < 60, 5 + 12 * rows / 60, 14.0) * np.ones((1, WIDTH))
    for left in range(8, WIDTH - 20, 30):   # buildings, darker than the sky, with a few lit windows
        base[45:92, left:left + 20] = 9
        for top in range(48, 88, 8):
            for column in range(left + 2, left + 18, 6):
                if rng.random() < 0.5:
                    base[top:top + 3, column:column + 3] = 170
    frames = np.repeat(np.repeat(base[None, :, :, None], 3, axis=3), FRAMES, axis=0).astype(float)
    for index in range(FRAMES):
        for lane, speed in ((96, 5), (102, -4)):
            column = (20 + speed * index) % (WIDTH - 8)
            frames[index, lane:lane + 3, column:column + 8] = (240, 230, 180)
    return frames + rng.normal(0, 1.0, frames.shape)


def talking_head() -> np.ndarray:
    """A still head and shoulders whose mouth (10 pixels wide, 1-5 high) opens and closes; mild camera noise."""
    rng = np.random.default_rng(3)
    rows, columns = np.mgrid[0:HEIGHT, 0:WIDTH]
    picture = np.stack([60 + 40 * columns / WIDTH, 70 + 30 * rows / HEIGHT, 90 + 0 * rows], axis=-1)
    face = ((columns - 96) / 22) ** 2 + ((rows - 45) / 30) ** 2 < 1
    picture[face] = (200, 160, 130)
    picture[(rows > 80) & (np.abs(columns - 96) < 45)] = (40, 50, 90)   # shoulders
    for eye in (86, 106):
        picture[36:40, eye - 3:eye + 3] = (30, 20, 20)
    frames = []
    for index in range(FRAMES):
        frame = picture.copy()
        opening = (0, 1, 3, 5, 3, 1)[index % 6]
        frame[58:59 + opening, 91:101] = (90, 30, 30)
        frames.append(frame + rng.normal(0, 1.0, frame.shape))
    return np.stack(frames)


def make_media(folder: Path) -> dict[str, tuple[str, str]]:
    """{name: (path, media_type)} of every clip and image, written into ``folder``."""
    folder.mkdir(parents=True, exist_ok=True)
    clean = lavfi_clip(folder / "clean.mp4", f"mandelbrot=size={SIZE}:rate={RATE}")
    still = still_png(folder / "bars.png", f"smptehdbars=size={SIZE}")
    wide = still_png(folder / "wide.png", f"testsrc2=size={WIDTH * 4}x{HEIGHT}")
    picture = still_png(folder / "picture.png", f"testsrc2=size={WIDTH * 2}x{HEIGHT * 2}")
    other_picture = still_png(folder / "other_picture.png", f"mandelbrot=size={WIDTH * 2}x{HEIGHT * 2}")
    with Image.open(picture) as image:
        image.convert("RGB").resize((WIDTH * 4 // 3, HEIGHT * 4 // 3), Image.LANCZOS).save(
            folder / "picture_copy.jpg", quality=40)
    ffmpeg("-i", clean, "-vf", "scale=176:100", "-c:v", "libx264", "-crf", "38", str(folder / "clean_copy.mp4"))
    ffmpeg("-loop", "1", "-framerate", str(RATE), "-i", still, "-vf", "noise=alls=2:allf=t", "-frames:v",
           str(FRAMES), "-c:v", "libx264", "-crf", "28", "-pix_fmt", "yuv420p", str(folder / "frozen.mp4"))
    ffmpeg("-loop", "1", "-framerate", str(RATE), "-i", wide, "-vf", f"crop={WIDTH}:{HEIGHT}:x='n*10':y=0",
           "-frames:v", str(FRAMES), "-c:v", "libx264", "-crf", "23", "-pix_fmt", "yuv420p", str(folder / "pan.mp4"))
    clips = {
        "clean": clean,
        "cut": lavfi_clip(folder / "cut.mp4", f"testsrc2=size={SIZE}:rate={RATE}[a];"
                                              f"life=size={SIZE}:rate={RATE}:seed=5:mold=10:life_color=#e0c060:"
                                              f"death_color=#203050:mold_color=#506030[b];"
                                              "[a][b]overlay=enable='gte(n,8)'"),
        "black": lavfi_clip(folder / "black.mp4", f"color=c=black:size={SIZE}:rate={RATE},noise=alls=4:allf=t"),
        "frozen": str(folder / "frozen.mp4"),
        "letterbox": lavfi_clip(folder / "letterbox.mp4",
                                f"testsrc2=size={WIDTH}x80:rate={RATE},pad={WIDTH}:{HEIGHT}:0:14"),
        "pillarbox": lavfi_clip(folder / "pillarbox.mp4",
                                f"testsrc2=size=144x{HEIGHT}:rate={RATE},pad={WIDTH}:{HEIGHT}:24:0"),
        "clean_copy": str(folder / "clean_copy.mp4"),
        "fade": lavfi_clip(folder / "fade.mp4", f"mandelbrot=size={SIZE}:rate={RATE},fade=t=in:st=0:d=1"),
        "pan": str(folder / "pan.mp4"),
        "night": numpy_clip(folder / "night.mp4", night_scene()),
        "talking": numpy_clip(folder / "talking.mp4", talking_head()),
    }
    media = {name: (path, "video") for name, path in clips.items()}
    media.update({"picture": (picture, "image"), "picture_copy": (str(folder / "picture_copy.jpg"), "image"),
                  "other_picture": (other_picture, "image")})
    return media
