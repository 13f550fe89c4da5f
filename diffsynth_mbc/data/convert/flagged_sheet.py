"""flagged.html for --inspect: each flagged row's window as a strip of thumbnails, grouped by reason
(``data/inspect/contact_sheet.py`` draws the page; this module picks the rows and frames).

At most ``ROWS_PER_REASON`` rows per reason are drawn (in row order), so that the page stays quick to open and to
make on a catalogue with thousands of findings; the page says how many more are in flagged.csv.
"""

from __future__ import annotations

import argparse

from diffsynth_mbc.data.inspect.contact_sheet import SheetRow, contact_sheet_html
from diffsynth_mbc.data.inspect.reasons import REASONS
from diffsynth_mbc.data.inspect.window import read_window

ROWS_PER_REASON = 200
FRAMES_PER_ROW = 8
THUMBNAIL_LONG_SIDE = 160


def strip_indices(frames: int, cut_frame: int | None = None, most: int = FRAMES_PER_ROW) -> list[int]:
    """Window indices to show: spread evenly from the first frame to the last and, for a scene cut, the two
    frames either side of it."""
    if frames <= most:
        return list(range(frames))
    around = {cut_frame - 1, cut_frame} if cut_frame is not None and 0 < cut_frame < frames else set()
    spread = most - len(around)
    chosen = {round(k * (frames - 1) / (spread - 1)) for k in range(spread)}
    return sorted(chosen | around)


def flagged_sheet(inspected, args: argparse.Namespace) -> str:
    """The page's HTML for the inspect findings of ``inspected`` (an ``inspect_rows.InspectOutcome``)."""
    by_reason: dict[str, list] = {}
    for flag in inspected.flags:
        if flag.flag in REASONS:
            by_reason.setdefault(flag.flag, []).append(flag)
    rows, left_out = [], 0
    for reason, flags in by_reason.items():
        flags = sorted(flags, key=lambda f: f.entry.order())
        left_out += max(0, len(flags) - ROWS_PER_REASON)
        rows += [_sheet_row(flag, inspected) for flag in flags[:ROWS_PER_REASON]]
    total = sum(len(flags) for flags in by_reason.values())
    line = f"{total} finding(s) in the windows of {inspected.summary.get('rows', 0)} row(s) " \
           f"({args.min_frames} frames, --frame_sampling {args.frame_sampling})"
    if left_out:
        line += f"; {left_out} more are listed in flagged.csv (at most {ROWS_PER_REASON} per reason are drawn)"
    return contact_sheet_html(rows, f"flagged rows: {args.catalog}", line)


def _sheet_row(flag, inspected) -> SheetRow:
    """The row's strip; a duplicate's strip is half its own frames and half those of the row it repeats."""
    entry = flag.entry
    frames, labels, detail = [], [], flag.detail
    original = inspected.originals.get(id(entry)) if flag.flag == "duplicate" else None
    try:
        most = FRAMES_PER_ROW // 2 if original is not None else FRAMES_PER_ROW
        cut = inspected.measured[id(entry)].cut_frame if flag.flag == "scene_cut" else None
        frames, labels = _strip(inspected, entry, most, cut, "")
        if original is not None:
            more, more_labels = _strip(inspected, original, most, None, f"row {original.row}: ")
            frames, labels = frames + more, labels + more_labels
    except Exception as error:   # the row is still listed, saying why it has no strip
        frames, labels = [], []
        detail += f" (no thumbnails: {type(error).__name__}: {error})"
    return SheetRow(row=entry.row, file_path=entry.source.file_path, catalog=entry.catalog, reason=flag.flag,
                    value=flag.value, threshold=flag.threshold, detail=detail, duplicate_of=flag.duplicate_of,
                    frames=frames, labels=labels)


def _strip(inspected, entry, most: int, cut: int | None, prefix: str) -> tuple[list, list[str]]:
    item = inspected.items[id(entry)]
    window = read_window(item.path, item.media_type, inspected.window, available=item.available, fps=item.fps,
                         long_side=THUMBNAIL_LONG_SIDE, keep=lambda count: strip_indices(count, cut, most))
    labels = [prefix + ("image" if item.media_type == "image" else f"frame {position}")
              for position in window.positions]
    return list(window.frames), labels
