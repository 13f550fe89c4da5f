"""flagged.html: the rows the inspection flagged, each with the frames that would train, on one static page.

flagged.csv says what was found; this page lets a person see it and decide in minutes whether a row goes. It is
one self-contained file (inline CSS, thumbnails as ``data:`` URIs, no script, nothing fetched), so it opens from
disk, from a copied output folder or as a mail attachment alike. Rows are grouped by reason, in the order the
inspection checks them, each group saying in one line why such a row hurts training.

Page weight: thumbnails are JPEG at quality 80, base64-encoded. Measured per row of 8 frames of 160x90: about
31 KB for colour gradients with the frame number written on them (3.9 KB a frame), 17 KB for nearly black
frames, 57 KB for grainy ones (strong noise on the gradients), so 100 flagged rows make a page of 3 to 6 MB,
which a browser opens at once. Frames taller than MAX_THUMB_HEIGHT are scaled down to it first.
"""

from __future__ import annotations

import base64
import html
import io
import re
from dataclasses import dataclass, field

from PIL import Image

from diffsynth_mbc.data.inspect.reasons import REASONS

REASON_ORDER = REASONS   # the groups in the order the inspection reports its reasons
REASON_EXPLANATIONS = {
    "scene_cut": "The frames cross a cut: the model learns that a shot can jump to another one mid-clip.",
    "black": "The frames are (nearly) black: a fade, a blank lead-in or a dead recording teaches nothing.",
    "frozen": "The frames barely change: a still or a stalled stream trains as if it were motion.",
    "letterbox": "Black bars above and below the picture: the model learns to draw the bars.",
    "pillarbox": "Black bars left and right of the picture: the model learns to draw the bars.",
    "duplicate": "The same frames as another row: the clip trains twice as often as the rest.",
}
THUMB_HEIGHT_PX = 80        # the height each thumbnail is shown at: 8 frames of 16:9 fit a 1280 px window
MAX_THUMB_HEIGHT = 180      # frames taller than this are scaled down before encoding (twice the shown height)
JPEG_QUALITY = 80

STYLE = """
:root { color-scheme: dark; }
* { box-sizing: border-box; }
body { margin: 0; background: #1c1d1f; color: #e2e2e2; line-height: 1.45;
       font: 14px/1.45 system-ui, -apple-system, "Segoe UI", Roboto, "Helvetica Neue", Arial, sans-serif; }
header { background: #242528; border-bottom: 1px solid #3a3b3f; padding: 10px 20px; }
h1 { font-size: 18px; margin: 0 0 2px; font-weight: 600; }
.summary { margin: 0 0 4px; color: #b4b4b4; }
nav { color: #9c9c9c; }
nav a { color: #8fb8ff; text-decoration: none; margin-right: 14px; white-space: nowrap; }
nav a:hover { text-decoration: underline; }
main { padding: 4px 20px 40px; }
section { margin-top: 18px; }
.group-head { display: flex; align-items: baseline; justify-content: space-between; gap: 12px;
              padding-top: 8px; border-top: 1px solid #3a3b3f; }
h2 { font-size: 16px; margin: 0; font-weight: 600; }
.to-contents { color: #8fb8ff; text-decoration: none; font-size: 12px; white-space: nowrap; }
h2 .count { color: #9c9c9c; font-weight: 400; margin-left: 6px; }
.explain { margin: 2px 0 10px; color: #a8a8a8; }
article { background: #26272a; border: 1px solid #34353a; border-radius: 6px; padding: 8px 10px; margin: 8px 0; }
.line { display: flex; flex-wrap: wrap; gap: 4px 14px; align-items: baseline; }
.rownum { font-weight: 600; white-space: nowrap; }
.path { font-family: ui-monospace, "DejaVu Sans Mono", Menlo, Consolas, monospace; color: #f0d9a0;
        user-select: all; overflow-wrap: anywhere; }
.catalog { color: #9c9c9c; }
.numbers { color: #9c9c9c; white-space: nowrap; font-variant-numeric: tabular-nums; }
.detail, .duplicate-of { overflow-wrap: anywhere; }
.duplicate-of { color: #c9a9ff; margin-top: 2px; }
.strip { display: flex; flex-wrap: wrap; gap: 4px; margin-top: 8px; }
figure { margin: 0; }
figure img { display: block; height: %(height)dpx; width: auto; border-radius: 2px; background: #000; }
figcaption { font-size: 11px; color: #9c9c9c; text-align: center; margin-top: 2px; }
.nothing { margin-top: 24px; font-size: 16px; color: #b4b4b4; }
""" % {"height": THUMB_HEIGHT_PX}


@dataclass
class SheetRow:
    """One flagged row as the page shows it: who it is, what was found, and the frames of its training window."""

    row: int                  # the catalogue row number (as in flagged.csv)
    file_path: str            # as written in the catalogue
    catalog: str              # "train" or "val"
    reason: str               # one of REASON_ORDER, or another reason text
    value: float
    threshold: float
    detail: str               # one readable line
    duplicate_of: str | None = None   # for duplicates: "row 12: clips/a.mp4"
    frames: list = field(default_factory=list)        # numpy uint8 [h, w, 3] arrays, left to right
    labels: list[str] = field(default_factory=list)   # one per frame, e.g. "frame 8"


def contact_sheet_html(rows: list[SheetRow], title: str, summary_line: str = "") -> str:
    """The whole page: a contents line linking to each reason's group, then the groups in REASON_ORDER (other
    reasons after them, alphabetically), each row in row order with its thumbnail strip."""
    groups = _grouped(rows)
    anchors = _anchors(list(groups))
    head = [f"<h1>{html.escape(title)}</h1>"]
    if summary_line:
        head.append(f'<p class="summary">{html.escape(summary_line)}</p>')
    if groups:
        links = " ".join(f'<a href="#{anchors[reason]}">{html.escape(reason)} '
                         f'<span class="count">({len(members)})</span></a>' for reason, members in groups.items())
        head.append(f'<nav id="contents" aria-label="contents">{len(rows)} flagged: {links}</nav>')
        body = "\n".join(_group_html(reason, members, anchors[reason]) for reason, members in groups.items())
    else:
        body = '<p class="nothing">Nothing was flagged: every row\'s frames passed the inspection.</p>'
    return ("<!DOCTYPE html>\n<html lang=\"en\">\n<head>\n<meta charset=\"utf-8\">\n"
            "<meta name=\"viewport\" content=\"width=device-width, initial-scale=1\">\n"
            f"<title>{html.escape(title)}</title>\n<style>{STYLE}</style>\n</head>\n<body>\n"
            f"<header>{''.join(head)}</header>\n<main>\n{body}\n</main>\n</body>\n</html>\n")


def _grouped(rows: list[SheetRow]) -> dict[str, list[SheetRow]]:
    """Rows by reason, the known reasons first in REASON_ORDER, then the others alphabetically; each group's
    rows in row order, catalogue by catalogue (train, then val: each numbers its rows from 1)."""
    by_reason: dict[str, list[SheetRow]] = {}
    for row in rows:
        by_reason.setdefault(row.reason, []).append(row)
    order = [r for r in REASON_ORDER if r in by_reason] + sorted(r for r in by_reason if r not in REASON_ORDER)
    return {reason: sorted(by_reason[reason], key=_row_order) for reason in order}


def _row_order(row: SheetRow) -> tuple:
    return {"train": 0, "val": 1}.get(row.catalog, 2), row.catalog, row.row, row.file_path


def _anchors(reasons: list[str]) -> dict[str, str]:
    """An id per reason, safe in a URL fragment whatever the reason text, and unique."""
    anchors: dict[str, str] = {}
    for reason in reasons:
        base = "reason-" + (re.sub(r"[^A-Za-z0-9_-]+", "-", reason).strip("-") or "other")
        anchor, n = base, 2
        while anchor in anchors.values():
            anchor, n = f"{base}-{n}", n + 1
        anchors[reason] = anchor
    return anchors


def _group_html(reason: str, members: list[SheetRow], anchor: str) -> str:
    explanation = REASON_EXPLANATIONS.get(reason, "")
    lines = [f'<section id="{anchor}" data-reason="{html.escape(reason)}">',
             f'<div class="group-head"><h2>{html.escape(reason)} <span class="count">{len(members)}</span></h2>'
             '<a class="to-contents" href="#contents">back to contents</a></div>']
    if explanation:
        lines.append(f'<p class="explain">{html.escape(explanation)}</p>')
    lines += [_row_html(row) for row in members]
    lines.append("</section>")
    return "\n".join(lines)


def _row_html(row: SheetRow) -> str:
    parts = [f'<article data-row="{int(row.row)}">', '<div class="line">',
             f'<span class="rownum">row {int(row.row)}</span>',
             f'<span class="path" title="click to select the whole path">{html.escape(row.file_path)}</span>',
             f'<span class="catalog">{html.escape(row.catalog)}</span>',
             f'<span class="detail">{html.escape(row.detail)}</span>',
             f'<span class="numbers">value {_number(row.value)}, threshold {_number(row.threshold)}</span>',
             "</div>"]
    if row.duplicate_of:
        parts.append(f'<div class="duplicate-of">duplicate of {html.escape(row.duplicate_of)}</div>')
    if row.frames:
        labels = list(row.labels) + [""] * (len(row.frames) - len(row.labels))
        parts.append('<div class="strip">' + "".join(_frame_html(frame, label)
                                                     for frame, label in zip(row.frames, labels)) + "</div>")
    parts.append("</article>")
    return "\n".join(parts)


def _frame_html(frame, label: str) -> str:
    uri, (width, height) = jpeg_data_uri(frame)
    shown_width = max(1, round(width * THUMB_HEIGHT_PX / height))
    return (f'<figure><img src="{uri}" width="{shown_width}" height="{THUMB_HEIGHT_PX}" alt="{html.escape(label)}">'
            f"<figcaption>{html.escape(label)}</figcaption></figure>")


def jpeg_data_uri(frame) -> tuple[str, tuple[int, int]]:
    """A frame (uint8 [h, w, 3], or [h, w] grey) as a ``data:image/jpeg;base64,`` URI, and its encoded size
    (width, height): scaled down to MAX_THUMB_HEIGHT when taller, so a full-size frame cannot swell the page."""
    image = Image.fromarray(frame).convert("RGB")
    if image.height > MAX_THUMB_HEIGHT:
        width = max(1, round(image.width * MAX_THUMB_HEIGHT / image.height))
        image = image.resize((width, MAX_THUMB_HEIGHT), Image.BILINEAR)
    buffer = io.BytesIO()
    image.save(buffer, format="JPEG", quality=JPEG_QUALITY)
    return "data:image/jpeg;base64," + base64.b64encode(buffer.getvalue()).decode("ascii"), image.size


def _number(value: float) -> str:
    """A value or threshold as a person reads it: up to 4 significant digits, integers without a point."""
    try:
        value = float(value)
    except (TypeError, ValueError):
        return html.escape(str(value))
    if value.is_integer() and abs(value) < 1e15:
        return str(int(value))
    return f"{value:.4g}"
