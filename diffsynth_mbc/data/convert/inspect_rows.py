"""--inspect: measure each written row's training window, flag what is found (``data/inspect/measures.py``,
``duplicates.py``), move the reasons ``--exclude`` names to rejects.csv, and draw flagged.html.

Every row stays accounted for: a row whose window cannot be decoded is rejected as unreadable media, a row
excluded for a finding is rejected with it, every other row is written; each finding is one line of
flagged.csv whether its row was kept or excluded.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass, field
from pathlib import Path

from rich.console import Console

from diffsynth_mbc.data.convert import catalogue_rows as cat
from diffsynth_mbc.data.convert.aspect_mix import TrainingShapes
from diffsynth_mbc.data.convert.probe_rejects import Flag
from diffsynth_mbc.data.inspect.duplicates import DUPLICATE_BITS, find_duplicates
from diffsynth_mbc.data.inspect.measure_store import STORE_NAME, MeasureStore
from diffsynth_mbc.data.inspect import measures as m
from diffsynth_mbc.data.inspect.measures import Finding, WindowMeasures, findings, readable_measures
from diffsynth_mbc.data.inspect.reasons import REASONS, parse_exclude
from diffsynth_mbc.data.inspect.run_inspection import (
    MEASURES_VERSION,
    InspectItem,
    ProgressLines,
    inspect_items,
)
from diffsynth_mbc.data.inspect.window import InspectWindow
from diffsynth_mbc.data.media.media_probe import MediaInfo


# summary.json's record of what each reason means here (their reasons: data/inspect/measures.py, duplicates.py)
THRESHOLDS = {
    "scene_cut": {"min_change_luma": m.CUT_MIN_CHANGE, "min_ratio_to_typical": m.CUT_MIN_RATIO},
    "black": {"luma_below": m.BLACK_LUMA, "pixel_share": m.BLACK_PIXEL_SHARE, "frame_share": m.BLACK_FRAME_SHARE},
    "frozen": {"motion_below_luma": m.FROZEN_MOTION, "percentile": m.MOTION_PERCENTILE},
    "letterbox": {"bar_luma_below": m.BAR_LUMA, "bars_over_share": m.BARS_MAX_SHARE},
    "pillarbox": {"bar_luma_below": m.BAR_LUMA, "bars_over_share": m.BARS_MAX_SHARE},
    "duplicate": {"hash_bits_at_most": DUPLICATE_BITS, "of_bits": 63},
}


def inspect_window(args: argparse.Namespace) -> InspectWindow:
    return InspectWindow(num_frames=args.min_frames, sampling=args.frame_sampling, source_fps=args.source_fps,
                         seed=args.seed)


@dataclass
class InspectOutcome:
    flags: list[Flag] = field(default_factory=list)              # every finding, of kept and excluded rows
    excluded: list[cat.Reject] = field(default_factory=list)     # rows moved to rejects.csv for a finding
    unreadable: list[cat.Reject] = field(default_factory=list)   # rows whose window could not be decoded
    measured: dict[int, WindowMeasures] = field(default_factory=dict)   # id(entry) -> its window's measures
    rejected_ids: set[int] = field(default_factory=set)           # id(entry) of the unreadable and excluded rows
    unreadable_ids: set[int] = field(default_factory=set)         # id(entry) of the rows it could not decode
    items: dict[int, InspectItem] = field(default_factory=dict)   # id(entry) -> what was decoded
    originals: dict[int, cat.Entry] = field(default_factory=dict)  # id(entry) of a duplicate -> the row it repeats
    window: InspectWindow | None = None
    summary: dict = field(default_factory=dict)


def inspect_entries(entries: list[cat.Entry], probed: dict[int, MediaInfo], args: argparse.Namespace,
                    console: Console) -> InspectOutcome:
    window = inspect_window(args)
    items = [_item(entry, probed[id(entry)]) for entry in entries]
    started = time.monotonic()
    output = Path(args.output)
    output.mkdir(parents=True, exist_ok=True)
    with MeasureStore(output / STORE_NAME, MEASURES_VERSION, readable=readable_measures) as store:
        if store.spoiled:
            console.print(f"note: {store.spoiled} stored line(s) of {output / STORE_NAME} lacked a measure or held "
                          "a non-number: those rows are measured again", highlight=False)
        results = _run(items, window, args.workers, store, console)
        store.finish({result.key for result in results if result.key and result.measures is not None})
        reused, spoiled = sum(1 for r in results if r.reused), store.spoiled
    outcome = InspectOutcome(items={id(e): item for e, item in zip(entries, items)}, window=window)
    shapes = TrainingShapes.from_args(args)
    found: dict[int, list[Finding]] = {}
    for entry, result in zip(entries, results):
        if result.measures is None:
            reject = cat.Reject.of(entry, cat.Reason.UNREADABLE_MEDIA, f"{cat.Reason.UNREADABLE_MEDIA} (--inspect could "
                                                                         f"not decode its window: {result.error})")
            outcome.unreadable.append(reject)
            outcome.rejected_ids.add(id(entry))
            outcome.unreadable_ids.add(id(entry))
            continue
        measures = WindowMeasures.from_dict(result.measures)
        outcome.measured[id(entry)] = measures
        info = probed[id(entry)]
        target = shapes.target(info.width, info.height)
        label = f"{target.name} {'aspect bucket' if shapes.mode == 'aspect' else 'crop (--buckets off)'}"
        found[id(entry)] = findings(measures, entry.media_type, (target.width, target.height), label,
                                    (info.width, info.height))
    _add_duplicates(entries, outcome.measured, found, outcome.originals)
    exclude = parse_exclude(args.exclude)
    _flag_and_exclude(entries, found, exclude, outcome)
    seconds = time.monotonic() - started
    outcome.summary = {**_summary(args, window, exclude, len(entries), reused, outcome, seconds),
                       "store_lines_measured_again": spoiled}
    return outcome


def _item(entry: cat.Entry, info: MediaInfo) -> InspectItem:
    if entry.media_type == "image":
        return InspectItem(entry.resolved_path, "image", None, None)
    return InspectItem(entry.resolved_path, "video", info.num_frames, info.fps)


def _run(items, window, workers, store, console: Console):
    if console.is_terminal and items:
        from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn,
                                   TimeRemainingColumn)

        columns = (TextColumn("inspecting windows"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                   TextColumn("left:"), TimeRemainingColumn())
        # no refresh thread: the worker processes are forked from this one (run_inspection)
        with Progress(*columns, console=console, transient=True, auto_refresh=False) as progress:
            task = progress.add_task("inspect", total=len(items))

            def advance(rows: int) -> None:
                progress.advance(task, rows)
                progress.refresh()

            return inspect_items(items, window, workers, store, on_done=advance)
    lines = ProgressLines(len(items), lambda line: console.print(line, highlight=False))
    return inspect_items(items, window, workers, store, on_done=lines.advance)


def _add_duplicates(entries: list[cat.Entry], measured: dict[int, WindowMeasures],
                    found: dict[int, list[Finding]], originals: dict[int, cat.Entry]) -> None:
    """A near-duplicate of an earlier row (training catalogue first, then validation, each in row order) is
    flagged, and ``originals`` says which row it repeats; a validation row repeating a training row is training
    data seen twice."""
    ranked = sorted((e for e in entries if id(e) in measured), key=cat.Entry.order)
    pairs = find_duplicates([(e.media_type, measured[id(e)].hashes) for e in ranked])
    for index, (original_index, distance) in pairs.items():
        entry, original = ranked[index], ranked[original_index]
        found[id(entry)].append(Finding(
            "duplicate", float(distance), float(DUPLICATE_BITS),
            f"near-duplicate of {_row_named(original, entry)} ({original.source.file_path}): {distance} of 63 "
            f"perceptual-hash bits differ"))
        originals[id(entry)] = original


def _row_named(original: cat.Entry, entry: cat.Entry) -> str:
    """``row 12``, or ``row 12 of the train catalogue`` for a row of the other catalogue than ``entry``'s."""
    where = "" if original.catalog == entry.catalog else f" of the {original.catalog} catalogue"
    return f"row {original.row}{where}"


def _flag_and_exclude(entries, found, exclude: tuple[str, ...], outcome: InspectOutcome) -> None:
    for entry in entries:
        entry_findings = found.get(id(entry), [])
        excluded = [f for f in entry_findings if f.reason in exclude]
        original = outcome.originals.get(id(entry))
        for finding in entry_findings:
            repeats = (f"{_row_named(original, entry)}: {original.source.file_path}"
                       if finding.reason == "duplicate" else None)
            outcome.flags.append(Flag(entry, finding.reason, finding.detail, value=finding.value,
                                      threshold=finding.threshold, duplicate_of=repeats,
                                      excluded=finding in excluded))
        if excluded:
            reason = "; ".join(f"{f.reason} ({f.detail})" for f in excluded)
            outcome.excluded.append(cat.Reject.of(entry, excluded[0].reason, reason))
            outcome.rejected_ids.add(id(entry))


def _summary(args, window: InspectWindow, exclude: tuple[str, ...], rows: int, reused: int, outcome: InspectOutcome,
             seconds: float) -> dict:
    flagged = {reason: 0 for reason in REASONS}
    excluded = {reason: 0 for reason in REASONS}
    for flag in outcome.flags:
        flagged[flag.flag] += 1
        excluded[flag.flag] += flag.excluded
    measured = rows - reused
    return {
        "window": window.settings(),
        "workers": args.workers,
        "rows": rows,
        "reused": reused,
        "measured": measured,
        "unreadable": len(outcome.unreadable),
        "seconds": round(seconds, 2),
        "rows_per_second": round(rows / seconds, 1) if seconds > 0 else None,
        "flagged_rows": flagged,
        "exclude": list(exclude),
        "excluded_rows": {reason: count for reason, count in excluded.items() if reason in exclude},
        "thresholds": THRESHOLDS,
        "store": STORE_NAME,
    }
