"""Reading a metadata CSV (``video, prompt, media_type``, what ``python -m diffsynth_mbc.convert`` writes) as
DiffSynth's ``pandas.read_csv`` will, and refusing what pandas stops on with one error naming the file and the line.
No torch, no pandas.

pandas stops with a raw ``ParserError`` on a quote that is never closed ("EOF inside string starting at row 1",
a row counted its own way) and on a row with more cells than the header ("Expected 3 fields in line 9, saw 4"; on the
first data row it instead takes the first cell as an index and shifts every column, silently). Python's csv module
reads the first into one long last value without a word, so every reader of a metadata file (the plan, the doctor,
the latent cache, the training's dataset, ``datasets:``) reads it here: ``read_metadata``. ``missing_files`` says
which rows' files are not where the training will look.
"""

from __future__ import annotations

import csv
import io
import os

from diffsynth_mbc.errors import MetadataError, clipped

_UNCLOSED = "unexpected end of data"   # what the csv module says, in strict mode only, of a quote never closed


def _text(path: str, where: str) -> str:
    with open(path, "rb") as handle:   # FileNotFoundError and other OSErrors pass to the caller
        data = handle.read()
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as error:
        line = data.count(b"\n", 0, error.start) + 1
        raise MetadataError(f"{where}: line {line}: not UTF-8 (byte offset {error.start}: {error.reason}); re-save "
                            "it as UTF-8") from None


def _check_closed(text: str, line: int, where: str) -> None:
    """The record starting at ``line`` (the last one) ends with its quotes closed; MetadataError naming it if not.
    Only the last record can hold an unclosed quote: it swallows everything after it."""
    tail = "".join(io.StringIO(text, newline="").readlines()[line - 1:])
    try:
        for _ in csv.reader(io.StringIO(tail, newline=""), strict=True):
            pass
    except csv.Error as error:
        if _UNCLOSED in str(error):
            raise MetadataError(f"{where}: line {line}: a quote (\") opens a value that is never closed, so the "
                                "rest of the file would read as that one value; close it (a quote inside a quoted "
                                "value is written twice: \"\")") from None


def read_metadata(path: str | os.PathLike, flag: str | None = None) -> list[dict]:
    """Every record of the metadata CSV ``path`` as a dict of header -> cell (``None`` for cells a short row lacks),
    blank lines skipped, as pandas reads them. MetadataError names ``flag``, the file and the line of a quote never
    closed, a row with more cells than the header, or bytes that are not UTF-8."""
    path = os.fspath(path)
    where = f"{flag} {path}" if flag else path
    text = _text(path, where)
    csv.field_size_limit(2**31 - 1)   # captions can be long; the default 128 KiB would stop the file
    reader = csv.reader(io.StringIO(text, newline=""))
    header, records, start, last_start = None, [], 1, 1
    try:
        for record in reader:
            line, start = start, reader.line_num + 1
            if not record or not "".join(record).strip():
                continue
            last_start = line
            if header is None:
                header = record
                continue
            if len(record) > len(header):
                raise MetadataError(f"{where}: line {line}: {len(record)} cells, the header has {len(header)} "
                                    f"({clipped(', '.join(header))}); a caption with a comma must be quoted")
            records.append(dict(zip(header, record + [None] * (len(header) - len(record)))))
    except csv.Error as error:
        raise MetadataError(f"{where}: line {start}: malformed CSV ({error}); check the quotes in that row") from None
    _check_closed(text, last_start, where)
    return records


def missing_files(rows: list[dict], base_path: str) -> list[int]:
    """The 1-based metadata rows whose file (``video``, under ``base_path``) is not a file there."""
    from concurrent.futures import ThreadPoolExecutor

    paths = [os.path.join(base_path or "", str(row.get("video") or "")) for row in rows]
    # A network file system answers each look-up slowly: 16 at a time. A task per file cost more than its look-up
    # (170,000 files: 6.0 s, 0.5 s a slice to a task: benchmarks/bench_file_checks.py).
    slices = [paths[start:start + FILES_PER_TASK] for start in range(0, len(paths), FILES_PER_TASK)]
    with ThreadPoolExecutor(max_workers=16) as pool:
        found = [there for answers in pool.map(_which_are_files, slices) for there in answers]
    return [number for number, there in enumerate(found, 1) if not there]


FILES_PER_TASK = 256


def _which_are_files(paths: list[str]) -> list[bool]:
    return [os.path.isfile(path) for path in paths]
