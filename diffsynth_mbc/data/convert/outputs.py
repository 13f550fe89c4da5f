"""What the converter writes: the output files' names and columns, and the CSV texts of metadata.csv, rejects.csv,
not_in_subset.csv and flagged.csv."""

from __future__ import annotations

import csv
import io

from diffsynth_mbc.data.convert import catalogue_rows as cat
from diffsynth_mbc.data.convert.probe_rejects import Flag
from diffsynth_mbc.data.inspect.measure_store import STORE_NAME
from diffsynth_mbc.data.media.media_probe import MediaInfo

METADATA_NAME = "metadata.csv"
METADATA_VAL_NAME = "metadata_val.csv"
REJECTS_NAME = "rejects.csv"
NOT_IN_SUBSET_NAME = "not_in_subset.csv"
FLAGGED_NAME = "flagged.csv"
FLAGGED_SHEET_NAME = "flagged.html"
SUMMARY_NAME = "summary.json"
OUTPUT_NAMES = (METADATA_NAME, METADATA_VAL_NAME, REJECTS_NAME, NOT_IN_SUBSET_NAME, FLAGGED_NAME, FLAGGED_SHEET_NAME,
                SUMMARY_NAME, STORE_NAME)

METADATA_COLUMNS = ("video", "prompt", "media_type")
PROBE_COLUMNS = ("width", "height", "num_frames", "fps")
REJECT_COLUMNS = ("row", "file_path", "reason", "catalog", "line")
LEFT_OUT_COLUMNS = ("row", "file_path", "catalog", "line")
FLAGGED_COLUMNS = ("row", "file_path", "reason", "detail", "catalog", "line", "value", "threshold", "duplicate_of",
                   "excluded")


def _csv_text(header, rows) -> str:
    buffer = io.StringIO()
    # RFC 4180 line ends: with "\n" Python's writer would leave a lone "\r" in a caption unquoted, and
    # pandas would split the row there. QUOTE_MINIMAL with doubled quotes is what pandas reads.
    writer = csv.writer(buffer, lineterminator="\r\n")
    writer.writerow(header)
    writer.writerows(rows)
    return buffer.getvalue()


def metadata_text(entries: list[cat.Entry], probed: dict[int, MediaInfo] | None) -> str:
    if probed is None:
        return _csv_text(METADATA_COLUMNS, ((e.relative_path, e.source.caption, e.media_type) for e in entries))
    rows = []
    for entry in entries:
        info = probed[id(entry)]
        fps = "" if info.fps is None else round(info.fps, 3)
        rows.append((entry.relative_path, entry.source.caption, entry.media_type,
                     info.width, info.height, info.num_frames, fps))
    return _csv_text(METADATA_COLUMNS + PROBE_COLUMNS, rows)


# A spreadsheet runs a cell that starts with one of these as a formula (=HYPERLINK(...), +cmd|..., @SUM(...)).
_FORMULA_STARTS = ("=", "+", "-", "@", "\t", "\r")


def spreadsheet_safe(cell) -> str:
    """``cell`` as text that a spreadsheet shows instead of evaluating: a leading formula character gets an
    apostrophe in front (which spreadsheets hide). For rejects.csv, which people open in one; metadata.csv
    stays raw, since DiffSynth reads it."""
    text = str(cell)
    return "'" + text if text.startswith(_FORMULA_STARTS) else text


def rejects_text(rejects: list[cat.Reject]) -> str:
    ordered = sorted(rejects, key=lambda r: (cat.catalogue_rank(r.catalog), r.row))
    return _csv_text(REJECT_COLUMNS, ([spreadsheet_safe(cell) for cell in (r.row, r.file_path, r.reason, r.catalog,
                                                                            r.line)] for r in ordered))


def left_out_text(left_out: list[cat.Reject]) -> str:
    """not_in_subset.csv: the valid rows --subset did not take (no reason: none of them has a problem)."""
    ordered = sorted(left_out, key=lambda r: r.row)
    return _csv_text(LEFT_OUT_COLUMNS, ([spreadsheet_safe(cell) for cell in (r.row, r.file_path, r.catalog, r.line)]
                                        for r in ordered))


def flagged_text(flags: list[Flag]) -> str:
    """flagged.csv: every file --probe flagged (and still wrote) and every --inspect finding, with what was found
    (--inspect: the measured value, its threshold, the row a duplicate repeats, and whether --exclude moved the
    row to rejects.csv)."""
    ordered = sorted(flags, key=lambda f: (*f.entry.order(), f.flag))
    return _csv_text(FLAGGED_COLUMNS, ([spreadsheet_safe(cell) for cell in (
        f.entry.row, f.entry.source.file_path, f.flag, f.detail, f.entry.catalog, f.entry.source.line,
        _number(f.value), _number(f.threshold), f.duplicate_of or "", "yes" if f.excluded else "")]
        for f in ordered))


def _number(value: float | None) -> str:
    return "" if value is None else f"{value:g}"
