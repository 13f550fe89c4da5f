"""Each metadata row's bucket (``--buckets aspect``): from its size, read once before the run. No torch.

A row's size is its ``width``/``height`` columns where the converter wrote them (``convert --probe``), else the
file's header, read in parallel (``media_probe``: a clip's displayed size, its rotation metadata applied). A file
whose size cannot be read goes to the configured shape: it fails to decode later and is replaced like any bad file.
"""

from __future__ import annotations

import os
import sys
from typing import Sequence

from diffsynth_mbc.data.media.buckets import Bucket, bucket_set, nearest_bucket, sample_key
from diffsynth_mbc.data.media.shapes import shape_key
from diffsynth_mbc.errors import MetadataError


_NOTES_SAID: set[tuple] = set()


MAX_SIDE = 1 << 16   # pixels: no image or clip the training reads is wider or taller


def _column_size(row: dict, number: int) -> tuple[int, int] | None:
    """The row's ``width``/``height`` columns; None when either is empty (``nan`` as pandas writes a missing value):
    its file's header is read instead. A value that is no whole number of pixels in 1..MAX_SIDE (``-5``, ``abc``,
    ``inf``, ``1e400``, ``12.5``) is refused, naming the metadata row and the column."""
    cells = {column: str(row.get(column) or "").strip() for column in ("width", "height")}
    if not all(text and text.lower() != "nan" for text in cells.values()):
        return None
    sides = []
    for column, text in cells.items():
        try:
            value = float(text)
        except ValueError:
            value = None
        if value is None or not value.is_integer() or not 1 <= value <= MAX_SIDE:
            raise MetadataError(f"metadata row {number} ({row.get('video')}): {column} {text!r} is not a size in "
                                f"pixels (a whole number from 1 to {MAX_SIDE}); fix or empty the cell (python -m "
                                "diffsynth_mbc.convert --probe writes them from the files)")
        sides.append(int(value))
    return sides[0], sides[1]


def column_size_problem(rows: Sequence[dict]) -> str | None:
    """The first width/height cell that is no size in pixels, as the refusal says it; None when every one is."""
    try:
        for number, row in enumerate(rows, 1):
            _column_size(row, number)
    except MetadataError as exc:
        return str(exc)
    return None


def row_sizes(rows: Sequence[dict], base_path: str, workers: int | None = None) -> list[tuple[int, int] | None]:
    """(width, height) of every row: its columns, else its file's header; None where neither can be read."""
    from diffsynth_mbc.data.media.media_probe import probe_files

    sizes = [_column_size(row, number) for number, row in enumerate(rows, 1)]
    missing = [index for index, size in enumerate(sizes) if size is None]
    said = (len(missing), len(rows), base_path)
    if missing and os.environ.get("RANK", "0") == "0" and said not in _NOTES_SAID:   # once per process, rank 0
        _NOTES_SAID.add(said)
        print(f"note: {len(missing):,} of {len(rows):,} metadata rows have no width/height columns; reading their "
              "files' headers for the buckets (python -m diffsynth_mbc.convert --probe writes the columns)",
              file=sys.stderr)
    paths = {index: os.path.join(base_path, str(rows[index].get("video") or "")) for index in missing}
    readable = [index for index in missing if os.path.isfile(paths[index])]   # a missing file fails later, named
    if readable:
        items = [(paths[index], shape_key(rows[index].get("media_type"), rows[index].get("video")))
                 for index in readable]
        for index, result in zip(readable, probe_files(items, workers=workers)):
            if result.info is not None:
                sizes[index] = (result.info.width, result.info.height)
    return sizes


def row_buckets(rows: Sequence[dict], base_path: str, height: int, width: int,
                workers: int | None = None) -> list[Bucket]:
    """Every row's bucket among ``bucket_set(height, width)``."""
    buckets = bucket_set(height, width)
    fallback = Bucket(height, width)
    return [nearest_bucket(buckets, *size) if size else fallback for size in row_sizes(rows, base_path, workers)]


def bucket_keys(rows: Sequence[dict], base_path: str, height: int, width: int) -> list[str]:
    """Every row's batch key under ``--buckets aspect`` (``video@1280x704``), as the training's dataset keys it."""
    return [sample_key(shape_key(row.get("media_type"), row.get("video")), bucket)
            for row, bucket in zip(rows, row_buckets(rows, base_path, height, width))]
