"""Turn an MBC catalogue into metadata that DiffSynth 1.1.8's VideoDataset reads directly.

    python -m diffsynth_mbc.convert CATALOG.csv --base_path DIR --output OUT_DIR \\
        [--val_catalog VAL.csv | --val_fraction F] [--subset N] [--seed S] \\
        [--media all|video|image] [--no_check_files] [--probe] [--workers N] \\
        [--min_frames N] [--min_width W] [--min_height H] [--reject_short [--source_fps F]]
        [--tokenizer UMT5_DIR]

Writes OUT_DIR/metadata.csv (video,prompt,media_type[,width,height,num_frames,fps]),
metadata_val.csv (with a validation catalogue or --val_fraction), rejects.csv (every input row
not written because of a problem, with its reason), not_in_subset.csv (with --subset: the valid rows it did
not take, kept apart so that they do not bury the rejects), flagged.csv (with --probe: the files written but
flagged as short or small) and summary.json (with the captions longer than the text encoder's 512 tokens,
which are also named in a warning). Each file is written to a temp file and renamed.
Exit status: 0 when at least one row was written, 1 when none was, 2 for usage errors or a
catalogue that cannot be read.
"""

from __future__ import annotations

import argparse
import json
import csv
import io
import os
from dataclasses import asdict, dataclass
from pathlib import Path

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from diffsynth_mbc.data import catalog as cat
from diffsynth_mbc.data import selection
from diffsynth_mbc.data.captions import TokenizerError, long_captions
from diffsynth_mbc.data.output_set import OutputError, publish_output_set
from diffsynth_mbc.data.probe import MediaInfo, default_workers, histogram, probe_files
from diffsynth_mbc.flags import FlagParser

METADATA_NAME = "metadata.csv"
METADATA_VAL_NAME = "metadata_val.csv"
REJECTS_NAME = "rejects.csv"
NOT_IN_SUBSET_NAME = "not_in_subset.csv"
FLAGGED_NAME = "flagged.csv"
SUMMARY_NAME = "summary.json"
OUTPUT_NAMES = (METADATA_NAME, METADATA_VAL_NAME, REJECTS_NAME, NOT_IN_SUBSET_NAME, FLAGGED_NAME, SUMMARY_NAME)

METADATA_COLUMNS = ("video", "prompt", "media_type")
PROBE_COLUMNS = ("width", "height", "num_frames", "fps")
REJECT_COLUMNS = ("row", "file_path", "reason", "catalog", "line")
LEFT_OUT_COLUMNS = ("row", "file_path", "catalog", "line")
FLAGGED_COLUMNS = ("row", "file_path", "flag", "detail", "catalog", "line")
NAMED_IN_A_WARNING = 3  # files a warning names before "and N more"


class UsageError(Exception):
    """Bad arguments or inputs: exit status 2."""


def build_parser() -> argparse.ArgumentParser:
    parser = FlagParser(
        allow_abbrev=False,
        prog="python -m diffsynth_mbc.convert",
        description="Convert an MBC catalogue (file_path,caption,media_type) into DiffSynth metadata.",
    )
    parser.add_argument("catalog", help="training catalogue CSV (file_path,caption,media_type)")
    parser.add_argument("--base-path", required=True,
                        help="folder the catalogue's file paths are relative to (DiffSynth's dataset_base_path)")
    parser.add_argument("--output", required=True, help="folder to write metadata.csv, rejects.csv, summary.json into")
    val = parser.add_mutually_exclusive_group()
    val.add_argument("--val-catalog", help="validation catalogue CSV, written to metadata_val.csv")
    val.add_argument("--val-fraction", type=float,
                     help="split this fraction (0 < F < 1) of the training rows off as validation, per media type")
    parser.add_argument("--subset", type=int, help="keep N training rows, video/image ratio preserved")
    parser.add_argument("--seed", type=int, default=0, help="seed for --subset and --val_fraction (default 0)")
    parser.add_argument("--media", choices=("all", "video", "image"), default="all",
                        help="keep only this media type (default all)")
    parser.add_argument("--no-check-files", action="store_true",
                        help="do not check that media files exist (storage not mounted here)")
    parser.add_argument("--probe", action="store_true",
                        help="read each file's size, frame count and fps; reject unreadable files")
    parser.add_argument("--decoder", choices=("fast", "diffsynth"), default="fast",
                        help="with --probe: fast reads the frame count from the container (PyAV); diffsynth "
                             "counts by decoding the whole clip, as DiffSynth's reader does")
    parser.add_argument("--tokenizer", help="the release's google/umt5-xxl folder: count caption tokens exactly, as "
                                             "DiffSynth's prompter does (default: a stated over-estimate)")
    parser.add_argument("--workers", type=int, default=default_workers(),
                        help="parallel probes (default min(8, CPU count))")
    parser.add_argument("--min-frames", type=int, default=17, help="flag videos with fewer frames (default 17)")
    parser.add_argument("--reject-short", action="store_true",
                        help="with --probe: reject videos with fewer than --min_frames frames (the training's "
                             "--num_frames), naming their count, instead of only flagging them")
    parser.add_argument("--source-fps", type=float,
                        help="with --reject_short: count frames at this rate, as the training's --source_fps does")
    parser.add_argument("--min-width", type=int, default=1280, help="flag media narrower than this (default 1280)")
    parser.add_argument("--min-height", type=int, default=704, help="flag media lower than this (default 704)")
    return parser


def _check_arguments(args: argparse.Namespace) -> None:
    if args.subset is not None and args.subset < 1:
        raise UsageError(f"--subset must be at least 1, got {args.subset}")
    if args.val_fraction is not None and not 0 < args.val_fraction < 1:
        raise UsageError(f"--val_fraction must be between 0 and 1 (exclusive), got {args.val_fraction}")
    if args.workers < 1:
        raise UsageError(f"--workers must be at least 1, got {args.workers}")
    for name in ("min_frames", "min_width", "min_height"):
        if getattr(args, name) < 0:
            raise UsageError(f"--{name.replace('_', '-')} must not be negative")
    if (args.reject_short or args.source_fps is not None) and not args.probe:
        raise UsageError("--reject_short and --source_fps need --probe (the frame counts come from probing)")
    if args.source_fps is not None and not (args.source_fps > 0 and args.source_fps != float("inf")):
        raise UsageError(f"--source_fps must be a finite number above 0, got {args.source_fps}")
    if not args.no_check_files and not os.path.isdir(args.base_path):
        raise UsageError(f"--base_path {args.base_path}: not a folder (use --no_check_files if it is not mounted here)")
    if os.path.exists(args.output) and not os.path.isdir(args.output):
        raise UsageError(f"--output {args.output}: exists and is not a folder")
    inputs = [args.catalog] + ([args.val_catalog] if args.val_catalog else [])
    if args.val_catalog and _same_file(args.catalog, args.val_catalog):
        raise UsageError(f"--val_catalog {args.val_catalog} is the training catalogue itself")
    for name in OUTPUT_NAMES:
        output_path = os.path.join(args.output, name)
        for input_path in inputs:
            if _same_file(output_path, input_path):
                raise UsageError(
                    f"--output {args.output} would overwrite the input catalogue {input_path} ({name}); "
                    "choose another output folder"
                )


def _same_file(a: str, b: str) -> bool:
    if os.path.realpath(a) == os.path.realpath(b):
        return True
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False


# ---------------------------------------------------------------------------------------------
# Probing


@dataclass(frozen=True)
class Flag:
    entry: cat.Entry
    flag: str    # SHORT_VIDEO or SMALL_MEDIA
    detail: str  # e.g. "5 frames, fewer than 17"


SHORT_VIDEO = "short video"
SMALL_MEDIA = "small media"


@dataclass
class ProbeOutcome:
    info: dict[int, MediaInfo]  # id(entry) -> info, for entries that were readable
    unreadable: list[cat.Reject]
    flags: list[Flag]

    def flagged(self, flag: str) -> list[Flag]:
        return [f for f in self.flags if f.flag == flag]


def _probe_entries(entries: list[cat.Entry], args: argparse.Namespace, console: Console) -> ProbeOutcome:
    items = [(e.resolved_path, e.media_type) for e in entries]
    if console.is_terminal and items:
        from rich.progress import Progress

        with Progress(console=console, transient=True) as progress:
            task = progress.add_task("probing media", total=len(items))
            results = probe_files(items, args.workers, on_done=lambda _result: progress.advance(task),
                                  decoder=args.decoder)
    else:
        results = probe_files(items, args.workers, decoder=args.decoder)
    info: dict[int, MediaInfo] = {}
    unreadable: list[cat.Reject] = []
    flags: list[Flag] = []
    for entry, result in zip(entries, results):
        if result.info is None:
            unreadable.append(cat.Reject(entry.catalog, entry.row, entry.source.line, entry.source.file_path,
                                         cat.Reason.UNREADABLE_MEDIA, f"{cat.Reason.UNREADABLE_MEDIA} ({result.error})"))
            continue
        short = short_video_reason(result.info, args) if entry.media_type == "video" else None
        if short and args.reject_short:
            unreadable.append(cat.Reject(entry.catalog, entry.row, entry.source.line, entry.source.file_path,
                                         SHORT_VIDEO, short))
            continue
        info[id(entry)] = result.info
        if short:   # "short video (N frames..., fewer than ...)": the part in brackets
            flags.append(Flag(entry, SHORT_VIDEO, short[len(SHORT_VIDEO) + 2:-1]))
        if result.info.width < args.min_width or result.info.height < args.min_height:
            flags.append(Flag(entry, SMALL_MEDIA, f"{result.info.width}x{result.info.height}, smaller than "
                                                  f"{args.min_width}x{args.min_height}"))
    return ProbeOutcome(info, unreadable, flags)




def short_video_reason(info: MediaInfo, args: argparse.Namespace) -> str | None:
    """Why a probed video is shorter than the --min_frames that train (at --source_fps when given), or None."""
    from diffsynth_mbc.data.frame_selection import timeline

    source_fps = getattr(args, "source_fps", None)
    frames = len(timeline(info.num_frames, info.fps, source_fps))
    if frames >= args.min_frames:
        return None
    rate = f" at --source_fps {source_fps:g} ({info.num_frames} at {info.fps:g} fps)" if source_fps and info.fps else ""
    return f"{SHORT_VIDEO} ({frames} frames{rate}, fewer than --min_frames {args.min_frames})"


# ---------------------------------------------------------------------------------------------
# Writing


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
    order = {"train": 0, "val": 1}
    ordered = sorted(rejects, key=lambda r: (order.get(r.catalog, 2), r.row))
    return _csv_text(REJECT_COLUMNS, ([spreadsheet_safe(cell) for cell in (r.row, r.file_path, r.reason, r.catalog,
                                                                            r.line)] for r in ordered))


def left_out_text(left_out: list[cat.Reject]) -> str:
    """not_in_subset.csv: the valid rows --subset did not take (no reason: none of them has a problem)."""
    ordered = sorted(left_out, key=lambda r: r.row)
    return _csv_text(LEFT_OUT_COLUMNS, ([spreadsheet_safe(cell) for cell in (r.row, r.file_path, r.catalog, r.line)]
                                        for r in ordered))


def flagged_text(flags: list[Flag]) -> str:
    """flagged.csv: every file --probe flagged (and still wrote), with what was found."""
    order = {"train": 0, "val": 1}
    ordered = sorted(flags, key=lambda f: (order.get(f.entry.catalog, 2), f.entry.row, f.flag))
    return _csv_text(FLAGGED_COLUMNS, ([spreadsheet_safe(cell) for cell in (
        f.entry.row, f.entry.source.file_path, f.flag, f.detail, f.entry.catalog, f.entry.source.line)]
        for f in ordered))


def _named(flags: list[Flag]) -> list[str]:
    """The first few flagged files, each with what was found, for a warning line."""
    names = []
    for flag in flags[:NAMED_IN_A_WARNING]:
        found = flag.detail.split(",")[0]
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


def _probe_summary(entries: list[cat.Entry], outcome: ProbeOutcome, args: argparse.Namespace) -> dict:
    infos = [outcome.info[id(e)] for e in entries]
    videos = [outcome.info[id(e)] for e in entries if e.media_type == "video"]
    return {
        "workers": args.workers,
        "min_frames": args.min_frames,
        "min_width": args.min_width,
        "min_height": args.min_height,
        "unreadable": sum(1 for r in outcome.unreadable if r.code != SHORT_VIDEO),
        "rejected_short_videos": sum(1 for r in outcome.unreadable if r.code == SHORT_VIDEO),
        "flagged_short_videos": len(outcome.flagged(SHORT_VIDEO)),
        "flagged_small_media": len(outcome.flagged(SMALL_MEDIA)),
        "named_short_videos": _named(outcome.flagged(SHORT_VIDEO)),
        "named_small_media": _named(outcome.flagged(SMALL_MEDIA)),
        "flagged_file": FLAGGED_NAME if outcome.flags else None,
        "width": histogram(i.width for i in infos),
        "height": histogram(i.height for i in infos),
        "num_frames": histogram(i.num_frames for i in infos),
        "video_num_frames": histogram(i.num_frames for i in videos),
        "fps": histogram(None if i.fps is None else round(i.fps, 3) for i in videos),
    }


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
    probe = summary["probe"]
    if probe:
        if probe["flagged_short_videos"]:
            _print_flagged(console, f"{probe['flagged_short_videos']} videos have fewer than {probe['min_frames']} "
                                    "frames", probe["named_short_videos"], probe["flagged_short_videos"])
        if probe["flagged_small_media"]:
            _print_flagged(console, f"{probe['flagged_small_media']} files are smaller than {probe['min_width']}x"
                                    f"{probe['min_height']}", probe["named_small_media"], probe["flagged_small_media"])
    if summary["not_probed"]:
        console.print(f"note: {summary['not_probed']}", highlight=False)
    if summary["note"]:
        console.print(f"[yellow]{summary['note']}[/yellow]")
    console.print(f"wrote {', '.join(summary['outputs'])}")


def _print_flagged(console: Console, what: str, named: list[str], count: int) -> None:
    more = f" and {count - len(named)} more" if count > len(named) else ""
    console.print(f"[yellow]warning: {escape(what)}: {escape(', '.join(named))}{more}; all are listed in "
                  f"{FLAGGED_NAME}[/yellow]", highlight=False)


# ---------------------------------------------------------------------------------------------


def run(args: argparse.Namespace, console: Console) -> int:
    _check_arguments(args)
    catalogs = {"train": cat.read_catalog(args.catalog)}
    if args.val_catalog:
        catalogs["val"] = cat.read_catalog(args.val_catalog)

    plan = selection.plan_conversion(
        catalogs["train"], args.base_path, val_catalog=catalogs.get("val"), val_fraction=args.val_fraction,
        subset=args.subset, seed=args.seed, media=args.media, check_files=not args.no_check_files,
    )
    # The subset's leftovers are valid rows, not rejects: listed apart so that 165,000 of them do not bury
    # the few rows that have a problem.
    left_out = [r for r in plan.rejects if r.code == cat.Reason.NOT_IN_SUBSET]
    rejects = [r for r in plan.rejects if r.code != cat.Reason.NOT_IN_SUBSET]
    probed = probe_summary = outcome = None
    if args.probe:
        outcome = _probe_entries(plan.train + plan.val, args, console)
        rejects += outcome.unreadable
        plan.train = [e for e in plan.train if id(e) in outcome.info]
        plan.val = [e for e in plan.val if id(e) in outcome.info]
        probed = outcome.info
        probe_summary = _probe_summary(plan.train + plan.val, outcome, args)

    for name, catalog in catalogs.items():
        selection.check_accounting(
            len(catalog.rows),
            [e for e in plan.train + plan.val if e.catalog == name],
            [r for r in rejects + left_out if r.catalog == name],
        )

    _refuse_an_empty_split(plan, args)
    captions = long_captions([(e.catalog, e.row, e.source.caption) for e in plan.train + plan.val], args.tokenizer)
    files = {METADATA_NAME: metadata_text(plan.train, probed)}
    if plan.split_mode is not None:
        files[METADATA_VAL_NAME] = metadata_text(plan.val, probed)
    files[REJECTS_NAME] = rejects_text(rejects)
    if plan.subset is not None:
        files[NOT_IN_SUBSET_NAME] = left_out_text(left_out)
    if outcome is not None and outcome.flags:
        files[FLAGGED_NAME] = flagged_text(outcome.flags)
    summary = build_summary(args, catalogs, plan, rejects, probe_summary, list(files) + [SUMMARY_NAME], left_out)
    summary["captions"] = captions.summary()
    files[SUMMARY_NAME] = json.dumps(summary, indent=2, ensure_ascii=False) + "\n"
    # The optional files of an earlier run (with validation, --subset or flags) do not belong to this one.
    removed = publish_output_set(Path(args.output), files, stale=[METADATA_VAL_NAME, NOT_IN_SUBSET_NAME, FLAGGED_NAME])
    for name in removed:
        console.print(f"removed stale {Path(args.output) / name}")

    print_summary_table(console, summary)
    if captions.message():
        console.print(f"[yellow]warning: {escape(captions.message())}[/yellow]")
    if not plan.train and not plan.val:
        console.print("[red]no rows written: see rejects.csv[/red]")
        return 1
    return 0


def _refuse_an_empty_split(plan, args) -> None:
    if plan.split_mode is None or not (plan.train or plan.val) or (plan.train and plan.val):
        return
    given = f"--val_fraction {args.val_fraction}" if plan.split_mode == "fraction" else f"--val_catalog {args.val_catalog}"
    raise UsageError(f"{given} leaves {len(plan.train)} training and {len(plan.val)} validation rows; an empty "
                     "split is refused (nothing was written). Use a smaller --val_fraction or more rows.")


UNCUT_WIDTH = 10_000   # columns when stderr is no terminal: the table at its natural width, a line per row


def _console() -> Console:
    """stderr; piped to a file or another program, it is no terminal and rich would take 80 columns, breaking
    the table's cells over lines (COLUMNS, when set, still decides)."""
    console = Console(stderr=True)
    if not console.is_terminal and not os.environ.get("COLUMNS"):
        console = Console(stderr=True, width=UNCUT_WIDTH)
    return console


def main(argv: list[str] | None = None) -> int:
    console = _console()
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exit_request:  # argparse already printed the message
        return int(exit_request.code or 0)
    try:
        return run(args, console)
    except (UsageError, cat.CatalogError, OutputError, TokenizerError) as error:
        console.print(f"[red]error:[/red] {escape(str(error))}", highlight=False)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
