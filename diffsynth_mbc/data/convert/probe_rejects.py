"""--probe: open every written file, reject the unreadable (and, with --reject_short, the short) ones and flag
the short, small or much cropped ones that are still written (what small and cropped mean: ``aspect_mix``)."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from rich.console import Console

from diffsynth_mbc.data.convert import catalogue_rows as cat
from diffsynth_mbc.data.convert.aspect_mix import CROPPED_MEDIA, TrainingShapes
from diffsynth_mbc.data.media.media_probe import MediaInfo, probe_files


@dataclass(frozen=True)
class Flag:
    entry: cat.Entry
    flag: str    # SHORT_VIDEO, SMALL_MEDIA, CROPPED_MEDIA or (--inspect) one of data.inspect.measures.REASONS
    detail: str  # e.g. "5 frames, fewer than 17", "portrait clip, cropping to 1280x704 keeps 31%"
    value: float | None = None       # --inspect: what was measured, in the threshold's unit
    threshold: float | None = None
    duplicate_of: str | None = None  # --inspect duplicate: "row 12: clips/a.mp4"
    excluded: bool = False           # --exclude moved the row to rejects.csv


SHORT_VIDEO = "short video"
SMALL_MEDIA = "small media"


@dataclass
class ProbeOutcome:
    info: dict[int, MediaInfo]  # id(entry) -> info, for entries that were readable
    unreadable: list[cat.Reject]
    flags: list[Flag]

    def flagged(self, flag: str) -> list[Flag]:
        return [f for f in self.flags if f.flag == flag]


def probe_entries(entries: list[cat.Entry], args: argparse.Namespace, console: Console) -> ProbeOutcome:
    items = [(e.resolved_path, e.media_type) for e in entries]
    if console.is_terminal and items:
        from rich.progress import Progress

        with Progress(console=console, transient=True) as progress:
            task = progress.add_task("probing media", total=len(items))
            results = probe_files(items, args.workers, on_done=lambda _result: progress.advance(task),
                                  decoder=args.decoder)
    else:
        results = probe_files(items, args.workers, decoder=args.decoder)
    shapes = TrainingShapes.from_args(args)
    info: dict[int, MediaInfo] = {}
    unreadable: list[cat.Reject] = []
    flags: list[Flag] = []
    for entry, result in zip(entries, results):
        if result.info is None:
            unreadable.append(cat.Reject.of(entry, cat.Reason.UNREADABLE_MEDIA,
                                            f"{cat.Reason.UNREADABLE_MEDIA} ({result.error})"))
            continue
        short = short_video_reason(result.info, args) if entry.media_type == "video" else None
        if short and args.reject_short:
            unreadable.append(cat.Reject.of(entry, SHORT_VIDEO, short))
            continue
        info[id(entry)] = result.info
        if short:   # "short video (N frames..., fewer than ...)": the part in brackets
            flags.append(Flag(entry, SHORT_VIDEO, short[len(SHORT_VIDEO) + 2:-1]))
        small = shapes.small(result.info)
        if small:
            flags.append(Flag(entry, SMALL_MEDIA, small))
        cropped = shapes.cropped(result.info, entry.media_type)
        if cropped:
            flags.append(Flag(entry, CROPPED_MEDIA, cropped))
    return ProbeOutcome(info, unreadable, flags)


def short_video_reason(info: MediaInfo, args: argparse.Namespace) -> str | None:
    """Why a probed video is shorter than the --min_frames that train (at --source_fps when given), or None."""
    from diffsynth_mbc.data.media.frame_selection import timeline

    source_fps = args.source_fps
    frames = len(timeline(info.num_frames, info.fps, source_fps))
    if frames >= args.min_frames:
        return None
    rate = f" at --source_fps {source_fps:g} ({info.num_frames} at {info.fps:g} fps)" if source_fps and info.fps else ""
    return f"{SHORT_VIDEO} ({frames} frames{rate}, fewer than --min_frames {args.min_frames})"
