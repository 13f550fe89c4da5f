"""Write catalogue files byte by byte, the way real exports come (BOM, CRLF, blank lines)."""

from __future__ import annotations

import csv
import io
from pathlib import Path
from typing import Iterable, Sequence

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


def write_media_metadata(path, videos: int, images: int):
    """A metadata.csv as `python -m diffsynth_mbc.convert` writes it (video, prompt, media_type): ``videos`` clip rows
    then ``images`` image rows, none of them with a file behind it (for plans and estimates)."""
    with open(path, "w", newline="", encoding="utf-8") as handle:
        writer = csv.writer(handle)
        writer.writerow(["video", "prompt", "media_type"])
        writer.writerows([f"clips/{i}.mp4", "a clip", "video"] for i in range(videos))
        writer.writerows([f"images/{i}.jpg", "an image", "image"] for i in range(images))
    return path
