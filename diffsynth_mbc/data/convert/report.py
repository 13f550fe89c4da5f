"""summary.json and the table printed after a conversion: counts per catalogue and reason, the base path hint,
the probe's histograms and aspect mix, and the warnings that name flagged files."""

from __future__ import annotations

import argparse
import os
from dataclasses import asdict

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from diffsynth_mbc.data.convert import catalogue_rows as cat
from diffsynth_mbc.data.convert import selection
from diffsynth_mbc.data.convert.aspect_mix import (CROPPED_MEDIA, UPSCALE_FLAGGED_ABOVE, TrainingShapes, aspect_lines,
                                                  summarise_aspect)
from diffsynth_mbc.data.convert.outputs import FLAGGED_NAME, FLAGGED_SHEET_NAME, NOT_IN_SUBSET_NAME
from diffsynth_mbc.data.convert.probe_rejects import SHORT_VIDEO, SMALL_MEDIA, Flag, ProbeOutcome
from diffsynth_mbc.data.media.media_probe import PIL_PIXEL_LIMIT, histogram

NAMED_IN_A_WARNING = 3  # files a warning names before "and N more"


def _named(flags: list[Flag]) -> list[str]:
    """The first few flagged files, each with what was found, for a warning line."""
    names = []
    for flag in flags[:NAMED_IN_A_WARNING]:
        found = flag.detail if flag.flag == CROPPED_MEDIA else flag.detail.split(",")[0]
        names.append(f"{flag.entry.source.file_path} ({found})")
    return names


NOT_PROBED = ("media files were not opened: --probe would decode each one, count its frames (flagging videos with "
              "fewer than {min_frames} frames) and read its size, and reject truncated or unreadable files, which "
              "otherwise stop training when too many of them are met")


def base_path_hint(catalogs: dict[str, cat.Catalog], rejects: list[cat.Reject], base_path: str) -> str | None:
    """When at least half of a catalogue's rows (and all of them, for a catalogue of one row) are missing files,
    the base path is the likelier mistake than the files: say where the first missing row was looked for."""
    for name, catalog in catalogs.items():
        missing = [r for r in rejects if r.catalog == name and r.code == cat.Reason.MISSING_FILE]
        total = len(catalog.rows)
        if not missing or len(missing) * 2 < total:
            continue
        first = min(missing, key=lambda r: r.row)
        file_path = first.file_path.strip()
        looked_for = os.path.normpath(file_path if os.path.isabs(file_path) else os.path.join(base_path, file_path))
        share = f"all {total}" if len(missing) == total else f"{len(missing)} of {total}"
        return (f"{share} {name} rows' files are missing: is --base_path right? It resolves to {base_path}; "
                f"row {first.row} ({file_path}) was looked for at {looked_for}")
    return None


def summarise_probe(entries: list[cat.Entry], outcome: ProbeOutcome, args: argparse.Namespace) -> dict:
    infos = [outcome.info[id(e)] for e in entries]
    videos = [outcome.info[id(e)] for e in entries if e.media_type == "video"]
    shapes = TrainingShapes.from_args(args)
    return {
        "workers": args.workers,
        "min_frames": args.min_frames,
        "trains_at": shapes.describe(),
        "sized_for": shapes.sized_for(),
        "unreadable": sum(1 for r in outcome.unreadable if r.code != SHORT_VIDEO),
        "rejected_short_videos": sum(1 for r in outcome.unreadable if r.code == SHORT_VIDEO),
        "flagged_short_videos": len(outcome.flagged(SHORT_VIDEO)),
        "flagged_small_media": len(outcome.flagged(SMALL_MEDIA)),
        "named_short_videos": _named(outcome.flagged(SHORT_VIDEO)),
        "named_small_media": _named(outcome.flagged(SMALL_MEDIA)),
        "flagged_cropped_media": len(outcome.flagged(CROPPED_MEDIA)),
        "named_cropped_media": _named(outcome.flagged(CROPPED_MEDIA)),
        "flagged_file": FLAGGED_NAME if outcome.flags else None,
        "width": histogram(i.width for i in infos),
        "height": histogram(i.height for i in infos),
        "num_frames": histogram(i.num_frames for i in infos),
        "video_num_frames": histogram(i.num_frames for i in videos),
        "fps": histogram(None if i.fps is None else round(i.fps, 3) for i in videos),
        "aspect": summarise_aspect(infos, shapes),
        **_over_pixel_limit(entries, outcome),
    }


def _over_pixel_limit(entries: list[cat.Entry], outcome: ProbeOutcome) -> dict:
    """The images over PIL's decompression-bomb pixel limit: how many, and the first few with their sizes."""
    large = [(e, outcome.info[id(e)]) for e in entries if e.media_type == "image"
             and (outcome.info[id(e)].width or 0) * (outcome.info[id(e)].height or 0) > PIL_PIXEL_LIMIT]
    return {"over_pil_pixel_limit_count": len(large),
            "over_pil_pixel_limit": [f"{e.source.file_path} ({info.width}x{info.height})"
                                     for e, info in large[:NAMED_IN_A_WARNING]]}


def build_summary(args, catalogs: dict[str, cat.Catalog], plan: selection.ConversionPlan, rejects: list[cat.Reject],
                  probe_summary: dict | None, outputs: list[str], left_out: list[cat.Reject] = ()) -> dict:
    rejects_by_catalog = {name: [r for r in rejects if r.catalog == name] for name in catalogs}
    left_out_by_catalog = {name: sum(1 for r in left_out if r.catalog == name) for name in catalogs}
    base_path = cat.normalise_base_path(args.base_path)
    return {
        "input_rows": dict(plan.input_rows),
        "input_rows_total": sum(plan.input_rows.values()),
        "blank_lines_skipped": dict(plan.blank_lines),
        "written_rows": {"train": len(plan.train), "val": len(plan.val)},
        "rejected_rows": {name: len(items) for name, items in rejects_by_catalog.items()},
        "rejects_by_reason": {name: selection.count_reasons(items) for name, items in rejects_by_catalog.items()},
        "not_in_subset_rows": left_out_by_catalog if plan.subset else None,
        "media_types": {"train": selection.count_media_types(plan.train), "val": selection.count_media_types(plan.val)},
        "subset": asdict(plan.subset) if plan.subset else None,
        "split": {
            "mode": plan.split_mode,
            "val_fraction": args.val_fraction,
            "train": selection.count_media_types(plan.train),
            "val": selection.count_media_types(plan.val),
        },
        "seed": args.seed,
        "media": args.media,
        "files_checked": not args.no_check_files,
        "note": None if not args.no_check_files else "file existence was not checked (--no_check_files)",
        "inputs": {name: {"path": os.path.abspath(c.path), "sha256": c.sha256, "columns": c.columns}
                   for name, c in catalogs.items()},
        "base_path": base_path,
        "base_path_hint": None if args.no_check_files else base_path_hint(catalogs, rejects, base_path),
        "outputs": outputs,
        "arguments": vars(args),
        "probe": probe_summary,
        "not_probed": None if probe_summary is not None else NOT_PROBED.format(min_frames=args.min_frames),
        "accounting": {
            name: {"input": plan.input_rows[name],
                   "written": sum(1 for e in plan.train + plan.val if e.catalog == name),
                   "rejected": len(rejects_by_catalog[name]),
                   **({"not_in_subset": left_out_by_catalog[name]} if plan.subset else {})}
            for name in catalogs
        },
    }


def print_summary_table(console: Console, summary: dict) -> None:
    table = Table(title="MBC catalogue conversion")
    table.add_column("catalogue")
    table.add_column("input rows", justify="right")
    table.add_column("written (train / val)", justify="right")
    table.add_column("rejected", justify="right")
    table.add_column("rejects by reason")
    for name, accounting in summary["accounting"].items():
        written = accounting["written"]
        reasons = "\n".join(f"{reason}: {count}" for reason, count in summary["rejects_by_reason"][name].items())
        split = ""
        if name == "train" and summary["split"]["mode"] == "fraction":
            split = f" ({summary['written_rows']['train']} / {summary['written_rows']['val']})"
        table.add_row(name, str(accounting["input"]), f"{written}{split}", str(accounting["rejected"]), reasons or "-")
    console.print(table)
    for name, counts in summary["media_types"].items():
        if any(counts.values()):
            console.print(f"{name}: " + ", ".join(f"{count} {media}" for media, count in counts.items()))
    subset = summary["subset"]
    if subset and subset["took_all"]:
        console.print(f"[yellow]--subset {subset['requested']} is not less than the {subset['available']} "
                      f"valid rows: took all of them[/yellow]")
    left_out = sum((summary["not_in_subset_rows"] or {}).values())
    if left_out:
        console.print(f"{left_out} rows not taken by --subset {subset['requested']} are listed in "
                      f"{NOT_IN_SUBSET_NAME} (they are not rejects)", highlight=False)
    if summary["base_path_hint"]:
        console.print(f"[yellow]{escape(summary['base_path_hint'])}[/yellow]", highlight=False)
    if summary["probe"]:
        _print_probe(console, summary["probe"])
    if summary.get("inspect"):
        for line in inspect_lines(summary["inspect"]):
            console.print(line, highlight=False)
    if summary["not_probed"]:
        console.print(f"note: {summary['not_probed']}", highlight=False)
    if summary["note"]:
        console.print(f"[yellow]{summary['note']}[/yellow]")
    console.print(f"wrote {', '.join(summary['outputs'])}")


def _print_probe(console: Console, probe: dict) -> None:
    for line in aspect_lines(probe["aspect"]):
        console.print(line, highlight=False)
    if probe["flagged_short_videos"]:
        _print_flagged(console, f"{probe['flagged_short_videos']} videos have fewer than {probe['min_frames']} "
                                "frames", probe["named_short_videos"], probe["flagged_short_videos"])
    if probe["flagged_small_media"]:
        _print_flagged(console, f"{probe['flagged_small_media']} files would train upscaled by more than "
                                f"{UPSCALE_FLAGGED_ABOVE:g}x to {probe['trains_at']}",
                       probe["named_small_media"], probe["flagged_small_media"])
        console.print("  they train blurrier than the rest: re-export them from a larger source, or leave their rows "
                      "out of the catalogue if it has enough without them (docs/convert.md, Small media)",
                      highlight=False)
        console.print(f"  {probe['sized_for']}", highlight=False)
    if probe["flagged_cropped_media"]:
        _print_flagged(console, f"{probe['flagged_cropped_media']} files lose more than 10% of their frame to "
                                f"cropping (--buckets {probe['aspect']['buckets']})", probe["named_cropped_media"],
                       probe["flagged_cropped_media"])
    _print_large_images(console, probe)


def _print_large_images(console: Console, probe: dict) -> None:
    count = probe.get("over_pil_pixel_limit_count") or 0
    if count:
        more = f" and {count - len(probe['over_pil_pixel_limit'])} more" if count > len(probe["over_pil_pixel_limit"]) \
            else ""
        console.print(f"note: {count} image(s) have more than {PIL_PIXEL_LIMIT:,} pixels, where PIL warns of a "
                      f"possible decompression bomb: {escape(', '.join(probe['over_pil_pixel_limit']))}{more}; they "
                      "are read (each decode is slow), the warning is said here once", highlight=False)


def _print_flagged(console: Console, what: str, named: list[str], count: int) -> None:
    more = f" and {count - len(named)} more" if count > len(named) else ""
    console.print(f"[yellow]warning: {escape(what)}: {escape(', '.join(named))}{more}; all are listed in "
                  f"{FLAGGED_NAME}[/yellow]", highlight=False)


def inspect_lines(inspect: dict) -> list[str]:
    """--inspect's part of the printout: what was decoded, how fast, and the findings by reason."""
    rows, reused = inspect["rows"], inspect["reused"]
    rate = f", {inspect['rows_per_second']} rows/s" if inspect["rows_per_second"] else ""
    lines = [f"inspected the training windows of {rows} rows ({reused} reused from an earlier run) in "
             f"{inspect['seconds']:g} s{rate}"]
    found = {reason: count for reason, count in inspect["flagged_rows"].items() if count}
    if found:
        counts = ", ".join(f"{reason} {count}" for reason, count in found.items())
        lines.append(f"[yellow]flagged: {counts}; see {FLAGGED_NAME} and {FLAGGED_SHEET_NAME}[/yellow]")
    else:
        lines.append("flagged: nothing (no scene cut, black, frozen, letterboxed or pillarboxed window, no "
                     "near-duplicate)")
    excluded = {reason: count for reason, count in inspect["excluded_rows"].items() if count}
    if excluded:
        counts = ", ".join(f"{reason} {count}" for reason, count in excluded.items())
        lines.append(f"moved to rejects.csv by --exclude: {counts}")
    return lines
