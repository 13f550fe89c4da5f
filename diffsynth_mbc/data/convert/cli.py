"""Turn an MBC catalogue into metadata that DiffSynth 1.1.8's VideoDataset reads directly.

    python -m diffsynth_mbc.convert CATALOG.csv --base_path DIR --output OUT_DIR \\
        [--val_catalog VAL.csv | --val_fraction F] [--subset N] [--seed S] \\
        [--media all|video|image] [--no_check_files] [--probe] [--workers N] \\
        [--min_frames N] [--height H] [--width W] [--buckets aspect|off] [--reject_short] [--source_fps F]
        [--inspect [--frame_sampling head|uniform|random_window] [--exclude REASONS|all]] [--tokenizer UMT5_DIR]

Writes OUT_DIR/metadata.csv (video,prompt,media_type[,width,height,num_frames,fps]),
metadata_val.csv (with a validation catalogue or --val_fraction), rejects.csv (every input row
not written because of a problem, with its reason), not_in_subset.csv (with --subset: the valid rows it did
not take, kept apart so that they do not bury the rejects), flagged.csv (with --probe: the files written but
flagged as short, small or much cropped at the training's shape) and summary.json (with the captions longer
than the text encoder's 512 tokens, which are also named in a warning, and with --probe the orientation and
aspect mix: rows per bucket and the share of pixels centre-cropping discards, under --buckets and the other mode).
With --inspect the frames that will train are looked at (``inspect_rows``): scene cuts, black, frozen, letterboxed
and pillarboxed windows and near-duplicate rows are flagged in flagged.csv and shown in flagged.html; --exclude
moves the rows of the reasons it names to rejects.csv; what was measured is kept in inspect_measures.jsonl, so a
second run over an unchanged catalogue decodes nothing.
Each file is written to a temp file and renamed.
Exit status: 0 when at least one row was written, 1 when none was, 2 for usage errors or a
catalogue that cannot be read.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

from rich.console import Console
from rich.markup import escape

from diffsynth_mbc.data.convert import catalogue_rows as cat
from diffsynth_mbc.data.convert import selection
from diffsynth_mbc.data.convert.aspect_mix import PRESETS_SIZE
from diffsynth_mbc.data.convert.caption_lengths import TokenizerError, long_captions
from diffsynth_mbc.data.convert.console import PrintableConsole
from diffsynth_mbc.data.convert.output_set import OutputError, publish_output_set
from diffsynth_mbc.data.convert.outputs import (
    FLAGGED_NAME,
    FLAGGED_SHEET_NAME,
    METADATA_NAME,
    METADATA_VAL_NAME,
    NOT_IN_SUBSET_NAME,
    OUTPUT_NAMES,
    REJECTS_NAME,
    SUMMARY_NAME,
    flagged_text,
    left_out_text,
    metadata_text,
    rejects_text,
)
from diffsynth_mbc.data.convert.probe_rejects import probe_entries
from diffsynth_mbc.data.convert.report import build_summary, print_summary_table, summarise_probe
from diffsynth_mbc.data.inspect.reasons import REASONS, parse_exclude
from diffsynth_mbc.data.media.buckets import BUCKET_MODES, STEP
from diffsynth_mbc.data.media.frame_selection import FRAME_SAMPLING
from diffsynth_mbc.data.media.media_probe import default_workers, quiet_pil_pixel_warnings
from diffsynth_mbc.flags import FlagParser
from diffsynth_mbc.values import positive_number


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
    parser.add_argument("--min-frames", "--num-frames", type=int, default=17, dest="min_frames",
                        help="the training's --num_frames (either name): flag videos with fewer frames, and the "
                             "window --inspect looks at (default 17)")
    parser.add_argument("--reject-short", action="store_true",
                        help="with --probe: reject videos with fewer than --min_frames frames (the training's "
                             "--num_frames), naming their count, instead of only flagging them")
    parser.add_argument("--source-fps", type=float,
                        help="with --probe: count frames at this rate, as the training's --source_fps does (for "
                             "--reject_short, the short-video flag and --inspect's window)")
    parser.add_argument("--inspect", action="store_true",
                        help="with --probe: decode the frames that will train (small) and flag scene cuts, black, "
                             "frozen, letterboxed and pillarboxed windows and near-duplicate rows in flagged.csv, "
                             "with a contact sheet, flagged.html")
    parser.add_argument("--frame-sampling", choices=FRAME_SAMPLING, default="head",
                        help="with --inspect: the training's --frame_sampling, which decides the window (default "
                             "head; random_window: every frame some epoch's window can take)")
    parser.add_argument("--exclude", metavar="REASONS",
                        help="with --inspect: move the rows flagged for these reasons to rejects.csv: a comma list "
                             f"of {', '.join(REASONS)}, or all")
    parser.add_argument("--height", type=int, default=PRESETS_SIZE.height,
                        help=f"with --probe: the training's --height (default {PRESETS_SIZE.height}, as the presets)")
    parser.add_argument("--width", type=int, default=PRESETS_SIZE.width,
                        help=f"with --probe: the training's --width (default {PRESETS_SIZE.width}, as the presets)")
    parser.add_argument("--buckets", choices=BUCKET_MODES, default="aspect",
                        help="with --probe: the training's --buckets, for the report only (default aspect, the "
                             "presets' choice): aspect trains each row at the bucket nearest its aspect, off at "
                             "--height x --width, centre-cropped. The summary counts rows per orientation and "
                             "bucket and the share of pixels cropping discards, under both modes; flagged.csv "
                             "names the rows smaller than their shape and those whose crop keeps under 90%%")
    return parser


def _check_arguments(args: argparse.Namespace) -> None:
    if args.subset is not None and args.subset < 1:
        raise UsageError(f"--subset must be at least 1, got {args.subset}")
    if args.val_fraction is not None and not 0 < args.val_fraction < 1:
        raise UsageError(f"--val_fraction must be between 0 and 1 (exclusive), got {args.val_fraction}")
    if args.workers < 1:
        raise UsageError(f"--workers must be at least 1, got {args.workers}")
    if args.min_frames < 0:
        raise UsageError("--min_frames must not be negative")
    for name, value in (("height", args.height), ("width", args.width)):
        if value < STEP or value % STEP:
            raise UsageError(f"--{name} must be a positive multiple of {STEP}, as the training's, got {value}")
    if (args.reject_short or args.source_fps is not None or args.inspect) and not args.probe:
        raise UsageError("--reject_short, --source_fps and --inspect need --probe (the frame counts come from probing)")
    if (args.exclude is not None or args.frame_sampling != "head") and not args.inspect:
        raise UsageError("--exclude and --frame_sampling need --inspect (they act on what it finds)")
    try:
        parse_exclude(args.exclude)
    except ValueError as error:
        raise UsageError(str(error)) from None
    if args.inspect and args.min_frames < 1:
        raise UsageError("--inspect needs --min_frames of at least 1 (the frames that train)")
    if args.source_fps is not None and positive_number(args.source_fps) is None:
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
        outcome = probe_entries(plan.train + plan.val, args, console)
        rejects += outcome.unreadable
        plan.train = [e for e in plan.train if id(e) in outcome.info]
        plan.val = [e for e in plan.val if id(e) in outcome.info]
        probed = outcome.info
    inspected = None
    if args.inspect:   # the inspection (numpy, PIL, the decoder) is loaded only when asked for
        from diffsynth_mbc.data.convert.inspect_rows import inspect_entries

        inspected = inspect_entries(plan.train + plan.val, probed, args, console)
        rejects += inspected.unreadable + inspected.excluded
        plan.train = [e for e in plan.train if id(e) not in inspected.rejected_ids]
        plan.val = [e for e in plan.val if id(e) not in inspected.rejected_ids]
        # a row it could not decode is rejected: what --probe flagged of it (short, small, cropped) is not written
        outcome.flags = [flag for flag in outcome.flags if id(flag.entry) not in inspected.unreadable_ids]
        outcome.flags += inspected.flags
    if args.probe:   # the written rows' mix, after --inspect's exclusions
        probe_summary = summarise_probe(plan.train + plan.val, outcome, args)

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
    if inspected is not None:
        from diffsynth_mbc.data.convert.flagged_sheet import flagged_sheet

        files[FLAGGED_SHEET_NAME] = flagged_sheet(inspected, args)
    summary = build_summary(args, catalogs, plan, rejects, probe_summary, list(files) + [SUMMARY_NAME], left_out)
    summary["captions"] = captions.summary()
    summary["inspect"] = inspected.summary if inspected is not None else None
    files[SUMMARY_NAME] = json.dumps(summary, indent=2, ensure_ascii=False) + "\n"
    # The optional files of an earlier run (with validation, --subset or flags) do not belong to this one.
    removed = publish_output_set(Path(args.output), files, stale=[METADATA_VAL_NAME, NOT_IN_SUBSET_NAME, FLAGGED_NAME,
                                                                     FLAGGED_SHEET_NAME])
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
    the table's cells over lines (COLUMNS, when set, still decides). Lines of text are never broken by rich (the
    terminal wraps them), so a path in a message stays whole for copying."""
    console = PrintableConsole(stderr=True, soft_wrap=True)
    if not console.is_terminal and not os.environ.get("COLUMNS"):
        console = PrintableConsole(stderr=True, soft_wrap=True, width=UNCUT_WIDTH)
    return console


def main(argv: list[str] | None = None) -> int:
    console = _console()
    quiet_pil_pixel_warnings()
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
