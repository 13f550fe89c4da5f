"""Each metadata row's bucket (``--buckets aspect``): from its size, read once per run. No torch.

A row's size is its file's, as displayed (``media_probe``: its rotation metadata or EXIF orientation applied), read
from the header once per run and kept in the run's size table (``size_table``). The ``width``/``height`` columns the
converter writes (``convert --probe``) are checked against it: a column that is no size, or not the file's, is
refused naming the row. A file whose size cannot be read takes its columns, else the configured shape: it fails to
decode later and is replaced like any bad file.
"""

from __future__ import annotations

import os
from typing import Sequence

from diffsynth_mbc.data.media.buckets import Bucket, bucket_set, nearest_bucket, sample_key
from diffsynth_mbc.data.media.shapes import shape_key
from diffsynth_mbc.data.media.size_table import MAX_SIDE, file_sizes
from diffsynth_mbc.errors import MetadataError


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


def row_sizes(rows: Sequence[dict], base_path: str, workers: int | None = None,
              table_path: str | None = None) -> list[tuple[int, int] | None]:
    """(width, height) of every row as its file is displayed: from the run's size table at ``table_path``
    (``size_table``: each file's header read once per run), its ``width``/``height`` columns where the file cannot
    be read; None where neither gives one. Columns that disagree with the file are refused, naming the rows."""
    headers, columns = file_and_column_sizes(rows, base_path, workers, table_path)
    disagreeing = [(number, row, column, header)
                   for number, (row, column, header) in enumerate(zip(rows, columns, headers), 1)
                   if column and header and column != header]
    if disagreeing:
        raise MetadataError(columns_disagree(disagreeing))
    return [header or column for header, column in zip(headers, columns)]


def file_and_column_sizes(rows: Sequence[dict], base_path: str, workers: int | None = None,
                          table_path: str | None = None) -> tuple[list, list]:
    """(each row's file size as displayed, from the size table; its ``width``/``height`` columns), None where there
    is none, whether they agree or not. A cell that is no size is refused, naming the row and the column."""
    columns = [_column_size(row, number) for number, row in enumerate(rows, 1)]
    items = [(os.path.join(base_path, str(row.get("video") or "")),
              shape_key(row.get("media_type"), row.get("video"))) for row in rows]
    return file_sizes(items, table_path, workers), columns


def columns_disagree(disagreeing: list[tuple]) -> str:
    """The refusal of width/height columns that are not the file's size: the first rows, and how many in all."""
    def said(entry):
        number, row, (width, height), (file_width, file_height) = entry
        return (f"metadata row {number} ({row.get('video')}): the columns say {width}x{height}, the file is "
                f"{file_width}x{file_height}")
    shown = "; ".join(said(entry) for entry in disagreeing[:3])
    more = f"; and {len(disagreeing) - 3:,} more rows" if len(disagreeing) > 3 else ""
    return (f"{shown}{more} (width x height as displayed, rotation applied): the width/height columns would put "
            f"{'these rows' if len(disagreeing) > 1 else 'this row'} in another shape's bucket. Rewrite them from "
            "the files with python -m diffsynth_mbc.convert --probe, or empty the cells")


def buckets_of_sizes(sizes: Sequence[tuple[int, int] | None], height: int, width: int) -> list[Bucket]:
    """Each size's bucket among ``bucket_set(height, width)``; the configured shape where the size is unknown."""
    buckets = bucket_set(height, width)
    fallback = Bucket(height, width)
    return [nearest_bucket(buckets, *size) if size else fallback for size in sizes]


def row_buckets(rows: Sequence[dict], base_path: str, height: int, width: int,
                workers: int | None = None, table_path: str | None = None) -> list[Bucket]:
    """Every row's bucket among ``bucket_set(height, width)``."""
    return buckets_of_sizes(row_sizes(rows, base_path, workers, table_path), height, width)


def bucket_keys(rows: Sequence[dict], base_path: str, height: int, width: int,
                table_path: str | None = None) -> list[str]:
    """Every row's batch key under ``--buckets aspect`` (``video@1280x704``), as the training's dataset keys it."""
    return keys_of_sizes(rows, row_sizes(rows, base_path, table_path=table_path), height, width)


def keys_of_sizes(rows: Sequence[dict], sizes: Sequence[tuple[int, int] | None], height: int, width: int) -> list[str]:
    """``bucket_keys`` from the rows' sizes already read (one read serves every training size: a stage's too)."""
    return [sample_key(shape_key(row.get("media_type"), row.get("video")), bucket)
            for row, bucket in zip(rows, buckets_of_sizes(sizes, height, width))]
