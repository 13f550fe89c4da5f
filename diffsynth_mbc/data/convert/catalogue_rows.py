"""The MBC catalogue: parse it and validate each row (choosing rows and accounting is ``selection.py``).

Pure logic: no torch, no diffsynth, no media decoding (that is ``probe.py``). The command line
around it is ``convert.py``.

Row numbering: ``row`` is the 1-based number of a data record, counting from the first record
after the header. Blank records (a line with nothing but whitespace and commas, e.g. ``""`` or
``",,"``) are not data rows: they get no number and are counted as ``blank_lines``. So the
identity ``written + rejected == input rows`` holds over numbered rows, and ``line`` (the
physical line where a record starts, header = line 1) finds a row in an editor even when
captions span several lines.
"""

from __future__ import annotations

import csv
import hashlib
import io
import os
import re
from dataclasses import dataclass, field

from diffsynth_mbc.data.convert import file_checks

REQUIRED_COLUMNS = ("file_path", "caption", "media_type")
MEDIA_TYPES = ("video", "image")

# The extensions DiffSynth 1.1.8's VideoDataset decides on (it goes by extension, not by our
# media_type); a test checks these against the installed package.
IMAGE_EXTENSIONS = frozenset({"jpg", "jpeg", "png", "webp"})
VIDEO_EXTENSIONS = frozenset({"mp4", "avi", "mov", "wmv", "mkv", "flv", "webm", "gif"})

# Strings pandas.read_csv (which DiffSynth uses) turns into NaN by default, quoted or not.
PANDAS_NA_STRINGS = frozenset({
    "", "#N/A", "#N/A N/A", "#NA", "-1.#IND", "-1.#QNAN", "-NaN", "-nan", "1.#IND", "1.#QNAN",
    "<NA>", "N/A", "NA", "NULL", "NaN", "None", "n/a", "nan", "null",
})


class Reason:
    """Reject categories; the text in rejects.csv starts with one of these."""

    MALFORMED_ROW = "malformed row"
    EMPTY_FILE_PATH = "empty file_path"
    OUTSIDE_BASE_PATH = file_checks.OUTSIDE_BASE_PATH
    UNKNOWN_MEDIA_TYPE = "unknown media_type"
    UNSUPPORTED_EXTENSION = "unsupported extension"
    EXTENSION_CONTRADICTS = "extension contradicts media_type"
    EMPTY_CAPTION = "empty caption"
    CAPTION_NOT_TEXT = "caption does not read back as text in pandas"
    CAPTION_CONTROL = "caption contains control characters"
    DUPLICATE = "duplicate of an earlier row"
    DUPLICATE_OF_VALIDATION = "duplicate of validation row"
    MISSING_FILE = file_checks.MISSING_FILE
    NOT_A_FILE = file_checks.NOT_A_FILE
    UNREADABLE_MEDIA = "unreadable media"
    NOT_SELECTED = "not selected"
    NOT_IN_SUBSET = "not in subset"


class CatalogError(Exception):
    """The catalogue as a whole cannot be read (not found, not UTF-8, bad CSV, missing column)."""


@dataclass(slots=True)
class CatalogRow:
    row: int  # 1-based data row number (blank records not counted)
    line: int  # physical line where the record starts; the header is line 1
    file_path: str
    caption: str
    media_type: str
    field_count: int  # fields in this record; differs from the header's when the row is malformed


@dataclass
class Catalog:
    path: str
    sha256: str
    columns: list[str]
    expected_field_count: int
    rows: list[CatalogRow]
    blank_lines: int = 0


CATALOGUE_ORDER = ("train", "val")


def catalogue_rank(name: str) -> int:
    """Where a catalogue's rows come in every list the converter writes: training rows, then validation rows."""
    return CATALOGUE_ORDER.index(name) if name in CATALOGUE_ORDER else len(CATALOGUE_ORDER)


@dataclass(slots=True)
class Entry:
    """A row that passed validation: what goes into metadata.csv."""

    catalog: str  # "train" or "val": the catalogue it came from
    source: CatalogRow
    media_type: str  # "video" or "image"
    resolved_path: str  # absolute, normalised
    relative_path: str  # relative to --base-path, "/"-separated; what DiffSynth joins to its base path

    @property
    def row(self) -> int:
        return self.source.row

    def order(self) -> tuple[int, int]:
        """The entry's place in the converter's lists: its catalogue, then its row."""
        return catalogue_rank(self.catalog), self.row


@dataclass(frozen=True)
class Reject:
    catalog: str  # "train" or "val"
    row: int
    line: int
    file_path: str
    code: str  # one of Reason's values
    reason: str  # code plus detail, e.g. "duplicate of an earlier row (row 3)"

    @classmethod
    def of(cls, entry: Entry, code: str, reason: str) -> "Reject":
        """A validated row rejected later (by a probe, a selection or an inspection)."""
        return cls(entry.catalog, entry.row, entry.source.line, entry.source.file_path, code, reason)


@dataclass
class Validation:
    catalog: str
    accepted: list[Entry] = field(default_factory=list)
    rejects: list[Reject] = field(default_factory=list)

    def reject(self, row: CatalogRow, code: str, detail: str = "") -> None:
        reason = f"{code} ({detail})" if detail else code
        self.rejects.append(Reject(self.catalog, row.row, row.line, row.file_path, code, reason))


# ---------------------------------------------------------------------------------------------
# Reading


def read_catalog(path: str | os.PathLike) -> Catalog:
    """Read a catalogue file; raise CatalogError naming the file (and line) when it cannot be read."""
    path = os.fspath(path)
    try:
        with open(path, "rb") as handle:
            data = handle.read()
    except FileNotFoundError:
        raise CatalogError(f"{path}: file not found") from None
    except IsADirectoryError:
        raise CatalogError(f"{path}: is a directory, not a CSV file") from None
    except OSError as error:
        raise CatalogError(f"{path}: cannot read ({error.strerror or error})") from None
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as error:
        line = data.count(b"\n", 0, error.start) + 1
        raise CatalogError(
            f"{path}: not UTF-8 (line {line}, byte offset {error.start}: {error.reason}); "
            "re-save it as UTF-8"
        ) from None
    catalog = parse_catalog_text(text, name=path)
    catalog.sha256 = hashlib.sha256(data).hexdigest()
    return catalog


def parse_catalog_text(text: str, name: str = "<catalog>") -> Catalog:
    """Parse catalogue text (BOM already removed). Header names are matched trimmed and case-blind."""
    csv.field_size_limit(2**31 - 1)  # captions can be long; the default 128 KiB would abort the file
    reader = csv.reader(io.StringIO(text, newline=""), strict=True)
    leading_blank_lines = 0
    try:
        header = next(reader, None)
        while header is not None and not "".join(header).strip():
            leading_blank_lines += 1
            header = next(reader, None)
    except csv.Error as error:
        raise _malformed(name, reader.line_num, error) from None
    if header is None:
        raise CatalogError(f"{name}: empty file, expected a header with columns {', '.join(REQUIRED_COLUMNS)}")
    columns = [cell.strip() for cell in header]
    positions = _required_column_positions(columns, name)
    file_path_at, caption_at, media_type_at = (positions[c] for c in REQUIRED_COLUMNS)

    rows: list[CatalogRow] = []
    blank_lines = leading_blank_lines
    expected = len(columns)
    line = reader.line_num + 1  # where the next record starts
    try:
        for record in reader:
            if not "".join(record).strip():
                blank_lines += 1
            elif len(record) == expected:
                rows.append(CatalogRow(len(rows) + 1, line, record[file_path_at], record[caption_at],
                                       record[media_type_at], expected))
            else:
                rows.append(CatalogRow(len(rows) + 1, line, _cell(record, file_path_at), _cell(record, caption_at),
                                       _cell(record, media_type_at), len(record)))
            line = reader.line_num + 1
    except csv.Error as error:
        raise _malformed(name, line, error) from None
    return Catalog(path=name, sha256="", columns=columns, expected_field_count=expected,
                   rows=rows, blank_lines=blank_lines)


def _malformed(name: str, line: int, error: csv.Error) -> CatalogError:
    return CatalogError(f"{name}: malformed CSV at line {line} ({error}); check the quotes in that row")


def _required_column_positions(columns: list[str], name: str) -> dict[str, int]:
    lowered = [column.lower() for column in columns]
    positions = {}
    for required in REQUIRED_COLUMNS:
        count = lowered.count(required)
        if count == 0:
            raise CatalogError(
                f"{name}: missing required column '{required}' "
                f"(header has: {', '.join(repr(c) for c in columns)})"
            )
        if count > 1:
            raise CatalogError(f"{name}: column '{required}' appears {count} times in the header")
        positions[required] = lowered.index(required)
    return positions


def _cell(record: list[str], index: int) -> str:
    return record[index] if index < len(record) else ""


# ---------------------------------------------------------------------------------------------
# Validation


def normalise_base_path(base_path: str | os.PathLike) -> str:
    return os.path.normpath(os.path.abspath(os.fspath(base_path)))


def file_extension(path: str) -> str:
    """Lower-case extension without the dot, "" if none (a leading dot alone is no extension)."""
    name = path[path.rfind(os.sep) + 1:]
    dot = name.rfind(".")
    return name[dot + 1:].lower() if dot > 0 else ""


def caption_reads_as_non_text(caption: str) -> str | None:
    """Why pandas.read_csv (DiffSynth's reader) would not give this caption back as a string, or None.

    pandas turns NA-like strings into NaN, and a column whose values all look like numbers or
    booleans into numbers or booleans; the text encoder then gets a float, not a prompt. Checked
    per row (a subset could hold only such rows), erring on the side of rejecting.
    """
    if caption in PANDAS_NA_STRINGS:
        return f"{caption!r} reads as NaN"
    stripped = caption.strip()
    if stripped.lower() in ("true", "false"):
        return f"{caption!r} reads as a boolean"
    if not stripped or stripped[0] not in _NUMBER_STARTS:
        return None  # cheap exit for ordinary text: float() raising costs more than this check
    try:
        float(stripped)
    except ValueError:
        return None
    return f"{caption!r} reads as a number"


_NUMBER_STARTS = frozenset("0123456789+-.iInN")
# Characters that show nothing, which str.strip() keeps: zero-width space, joiners and marks, word joiner and
# invisible operators, BOM, soft hyphen, Mongolian vowel separator, Hangul fillers.
_INVISIBLE_ONLY = re.compile(r"[\s\u200b-\u200f\u2060-\u2064\ufeff\u00ad\u180e\u115f\u1160\u3164\uffa0]*")
# NUL and the other C0/C1 controls; tab and line breaks are ordinary caption text.
_CONTROL_CHARACTER = re.compile(r"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f-\x9f]")


def _caption_problem(caption: str) -> tuple[str, str] | None:
    """(reject code, detail) of a caption that cannot train as it is written, or None."""
    if _INVISIBLE_ONLY.fullmatch(caption):
        return Reason.EMPTY_CAPTION, "only zero-width or other invisible characters" if caption.strip() else ""
    control = _CONTROL_CHARACTER.search(caption)
    if control:
        return Reason.CAPTION_CONTROL, f"{control.group()!r} at position {control.start()}"
    not_text = caption_reads_as_non_text(caption)
    return (Reason.CAPTION_NOT_TEXT, not_text) if not_text else None


def validate_rows(
    catalog: Catalog,
    base_path: str,
    catalog_name: str = "train",
    check_files: bool = True,
    validation_paths: dict[str, int] | None = None,
) -> Validation:
    """Check each row; the first problem found is its reject reason.

    Order: field count, file_path, inside base path, media_type, extension, caption, duplicate
    (of an earlier accepted row, then of an accepted validation row: the same file, ``file_identity``, whatever
    path names it, through a linked folder say), file exists and its real path
    (symbolic links followed) is inside the base path's real path. ``base_path``
    must be normalised (``normalise_base_path``). ``validation_paths`` maps resolved path to
    validation row number.
    """
    result = Validation(catalog_name)
    base_prefix = base_path.rstrip(os.sep) + os.sep
    identify = file_identity if check_files else (lambda path: path)
    seen: dict = {}   # identity -> (row, resolved path, file_path as written)
    validation_files = {identify(path): (row, path, path.removeprefix(base_prefix))
                        for path, row in (validation_paths or {}).items()}
    candidates: list[Entry] = []
    for row in catalog.rows:
        if row.field_count != catalog.expected_field_count:
            result.reject(row, Reason.MALFORMED_ROW,
                          f"{row.field_count} fields, header has {catalog.expected_field_count}")
            continue
        file_path = row.file_path.strip()
        if not file_path:
            result.reject(row, Reason.EMPTY_FILE_PATH)
            continue
        resolved = os.path.normpath(file_path if os.path.isabs(file_path) else base_prefix + file_path)
        if not resolved.startswith(base_prefix):
            result.reject(row, Reason.OUTSIDE_BASE_PATH, f"resolves to {resolved}")
            continue
        media_type = row.media_type.strip().lower()
        if media_type not in MEDIA_TYPES:
            result.reject(row, Reason.UNKNOWN_MEDIA_TYPE, repr(row.media_type))
            continue
        extension = file_extension(resolved)
        if extension not in IMAGE_EXTENSIONS and extension not in VIDEO_EXTENSIONS:
            result.reject(row, Reason.UNSUPPORTED_EXTENSION, f"'.{extension}'" if extension else "none")
            continue
        extension_media_type = "image" if extension in IMAGE_EXTENSIONS else "video"
        if extension_media_type != media_type:
            result.reject(row, Reason.EXTENSION_CONTRADICTS,
                          f"'.{extension}' is {extension_media_type}, row says {media_type}")
            continue
        caption_problem = _caption_problem(row.caption)
        if caption_problem:
            result.reject(row, *caption_problem)
            continue
        identity = identify(resolved)
        earlier = _same_file(seen, identity, resolved, file_path)
        if earlier:
            result.reject(row, Reason.DUPLICATE, earlier)
            continue
        in_validation = _same_file(validation_files, identity, resolved, file_path)
        if in_validation:
            result.reject(row, Reason.DUPLICATE_OF_VALIDATION, f"validation {in_validation}")
            continue
        seen[identity] = (row.row, resolved, file_path)
        relative = resolved[len(base_prefix):]
        if os.sep != "/":
            relative = relative.replace(os.sep, "/")
        candidates.append(Entry(catalog_name, row, media_type, resolved, relative))

    if check_files:
        problems = file_checks.file_problems((e.resolved_path for e in candidates), base_path)
        for entry in candidates:
            if entry.resolved_path in problems:
                result.reject(entry.source, *problems[entry.resolved_path])
            else:
                result.accepted.append(entry)
    else:
        result.accepted = candidates
    return result


def file_identity(path: str):
    """What makes two paths one file: its (device, inode), symbolic links (of the file or its folders) and '..'
    followed, so a hard link is the same file too; the path itself when it cannot be looked up (a missing file)."""
    try:
        found = os.stat(path)
    except OSError:
        return path
    return found.st_dev, found.st_ino


def _same_file(seen: dict, identity, resolved: str, file_path: str) -> str | None:
    """The reject detail when an earlier row named this file (``seen``: identity -> (row, resolved path, as written)):
    ``row N``, and how the two paths name one file when they differ; None for a file not named before."""
    if identity not in seen:
        return None
    row, first_resolved, first_written = seen[identity]
    return f"row {row}" if first_resolved == resolved else f"row {row}: {file_path} is the same file as {first_written}"
