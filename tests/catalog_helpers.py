"""The tests' catalogues, in one place: the catalogue CSV that ``python -m diffsynth_mbc.convert`` reads (written byte
by byte, the way real exports come: BOM, CRLF, blank lines), and media files with the metadata.csv that convert
writes and the training reads.

A media catalogue is a list of ``MediaRow``s: ``clip(...)`` and ``image(...)``, or the shapes and presets below.
``write_media`` writes their files (``demo_data``'s clips and pictures, drawn from each row's seed),
``write_metadata`` their metadata CSV in the columns asked for (``CONVERTED``, ``WITH_SIZES``, ``DIFFSYNTH``,
``COMBINED``), and ``write_media_catalogue`` both in the demo's layout, which ``e2e_helpers.demo_flags`` trains on.
"""

from __future__ import annotations

import csv
import io
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Sequence

from diffsynth_mbc.data import dataset_list
from diffsynth_mbc.data.convert.outputs import METADATA_COLUMNS, METADATA_NAME
from diffsynth_mbc.data.demo_data import write_image, write_video

HEADER = ("file_path", "caption", "media_type")


def catalog_text(rows: Iterable[Sequence[str]], header: Sequence[str] = HEADER, line_end: str = "\n") -> str:
    """CSV text with ``line_end`` after each record; every field holding "\r" or "\n" ends up quoted.

    Python's writer quotes only the characters of its own line terminator (and "\n"), so with
    "\n" line ends a lone "\r" would stay bare: then quote every field instead.
    """
    rows = [list(row) for row in rows]
    bare_cr_possible = line_end != "\r\n" and any("\r" in field for row in rows for field in row)
    buffer = io.StringIO()
    writer = csv.writer(buffer, lineterminator=line_end,
                        quoting=csv.QUOTE_ALL if bare_cr_possible else csv.QUOTE_MINIMAL)
    writer.writerow(header)
    writer.writerows(rows)
    return buffer.getvalue()


def write_catalog(path, rows: Iterable[Sequence[str]], header: Sequence[str] = HEADER, line_end: str = "\n",
                  bom: bool = False) -> Path:
    path = Path(path)
    data = catalog_text(rows, header, line_end).encode("utf-8")
    path.write_bytes((b"\xef\xbb\xbf" if bom else b"") + data)
    return path


def read_csv_records(path) -> list[dict[str, str]]:
    with open(path, encoding="utf-8", newline="") as handle:
        return list(csv.DictReader(handle))


@dataclass(frozen=True)
class MediaRow:
    """One row of a media catalogue: its file (relative to the catalogue's base folder; the suffix picks the format),
    its media type, its size as stored, a clip's frames, its caption, the seed its picture is drawn from and, in a
    combined metadata, the position of its catalogue in the ``datasets:`` list. The file need not exist: a plan or an
    estimate reads only the metadata."""

    file: str
    kind: str                  # "video" or "image": the media_type column
    width: int = 64
    height: int = 64
    frames: int = 1            # a clip's (an image is 1)
    caption: str = ""
    seed: int = 0
    dataset: int | None = None

    def cells(self, columns: Sequence[str]) -> list:
        values = {"video": self.file, "prompt": self.caption, "media_type": self.kind, "width": self.width,
                  "height": self.height, "dataset": self.dataset}
        return [values[column] for column in columns]


def clip(file: str, width: int = 64, height: int = 64, *, frames: int = 9, seed: int = 0, caption: str = "a clip",
         dataset: int | None = None) -> MediaRow:
    """A clip's row, at the demo's size and frame count unless told."""
    return MediaRow(file, "video", width, height, frames, caption, seed, dataset)


def image(file: str, width: int = 64, height: int = 64, *, seed: int = 0, caption: str = "an image",
          dataset: int | None = None) -> MediaRow:
    """An image's row, at the demo's size unless told."""
    return MediaRow(file, "image", width, height, 1, caption, seed, dataset)


# The metadata layouts: what convert writes; with the sizes convert --probe adds that the training reads (it writes
# num_frames and fps too); DiffSynth's own two columns (the media type from the file's extension); a datasets: list's
# combined metadata, each row with its catalogue's position.
CONVERTED = METADATA_COLUMNS
WITH_SIZES = METADATA_COLUMNS + ("width", "height")
DIFFSYNTH = ("video", "prompt")
COMBINED = dataset_list.COLUMNS


def write_metadata(path, rows: Iterable[MediaRow], columns: Sequence[str] = CONVERTED) -> Path:
    """``rows`` as a metadata CSV with ``columns``, with convert's CRLF line ends (its folder made if need be)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="", encoding="utf-8") as handle:
        writer = csv.writer(handle, lineterminator="\r\n")
        writer.writerow(columns)
        writer.writerows(row.cells(columns) for row in rows)
    return path


def write_media(base, rows: Iterable[MediaRow]) -> list[Path]:
    """Each row's file under ``base``: an H.264 clip of its frames or a PNG/JPEG, at its size, from its seed."""
    paths = []
    for row in rows:
        path = Path(base) / row.file
        if row.kind == "video":
            write_video(path, row.frames, row.width, row.height, seed=row.seed)
        else:
            write_image(path, row.width, row.height, seed=row.seed)
        paths.append(path)
    return paths


def write_media_catalogue(root, rows: Sequence[MediaRow], columns: Sequence[str] = CONVERTED) -> Path:
    """The demo's layout in ``root``: each row's file under ``root/catalog`` (--dataset_base_path) and their metadata
    at ``root/metadata/metadata.csv`` (--dataset_metadata_path), whose path it returns."""
    write_media(Path(root) / "catalog", rows)
    return write_metadata(Path(root) / "metadata" / METADATA_NAME, rows, columns)


def write_media_metadata(path, videos: int, images: int) -> Path:
    """A metadata.csv as `python -m diffsynth_mbc.convert` writes it (video, prompt, media_type): ``videos`` clip rows
    then ``images`` image rows, none of them with a file behind it (for plans and estimates)."""
    return write_metadata(path, [*(clip(f"clips/{i}.mp4") for i in range(videos)),
                                 *(image(f"images/{i}.jpg") for i in range(images))])


# Sizes as stored (width, height). At --height 64 --width 128, whose buckets are 160x64, 128x64, 96x96, 64x128 and
# 64x160 (width x height), a landscape clip trains at 128x64, a portrait one at 64x128, square and 4:3 pictures at
# 96x96.
LANDSCAPE = (128, 72)
PORTRAIT = (72, 128)
SQUARE = (64, 64)
FOUR_THREE = (80, 60)
STREET = "a city street at night"
STUDIO = "a news anchor in the studio"


def street_clips(index: int, seed: int, portrait_seed: int | None = None) -> list[MediaRow]:
    """A landscape and a portrait clip of 9 frames, ``media/land_{index}.mp4`` and ``media/port_{index}.mp4``,
    captioned with their names ("a city street at night #land0"); the portrait one from ``seed`` too unless told."""
    return [clip(f"media/land_{index}.mp4", *LANDSCAPE, seed=seed, caption=f"{STREET} #land{index}"),
            clip(f"media/port_{index}.mp4", *PORTRAIT, seed=seed if portrait_seed is None else portrait_seed,
                 caption=f"{STREET} #port{index}")]


def studio_pictures(index: int, seed: int) -> list[MediaRow]:
    """A square PNG and a 4:3 JPEG, ``media/square_{index}.png`` and ``media/four_three_{index}.jpg``, captioned with
    their names ("a news anchor in the studio #square0")."""
    return [image(f"media/square_{index}.png", *SQUARE, seed=seed, caption=f"{STUDIO} #square{index}"),
            image(f"media/four_three_{index}.jpg", *FOUR_THREE, seed=seed, caption=f"{STUDIO} #four_three{index}")]


# One file of each shape, each captioned with its size (12-frame clips): three buckets at --height 64 --width 128.
ONE_OF_EACH_SHAPE = (
    clip("media/landscape.mp4", *LANDSCAPE, frames=12, seed=0, caption="a video of 128x72"),
    clip("media/portrait.mp4", *PORTRAIT, frames=12, seed=1, caption="a video of 72x128"),
    image("media/square.png", *SQUARE, seed=2, caption="an image of 64x64"),
    image("media/four_three.jpg", *FOUR_THREE, seed=3, caption="an image of 80x60"),
)
