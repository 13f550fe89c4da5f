"""The rows and media a checkpoint trained on: every metadata row's file, its size as displayed (``--buckets
aspect``) and the rows whose file was not found when the run started, saved in the checkpoint (``row_sizes.json``;
the sizes' digest in the manifest). A resume compares them with the metadata and files as they are now
(``MediaNow``) and is refused once, naming every row whose file changed size, vanished or came back, and every row
that left the metadata or is new in it, with what to do (``resume_refusal``); ``--force_resume true`` goes on with
them, and says so. No torch."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

from diffsynth_mbc.atomic import atomic_write_text
from diffsynth_mbc.run_layout import ROW_SIZES

ROWS_NAMED = 5   # rows named for each kind of change (every one is counted)


def sizes_digest(sized_rows: list | None) -> str | None:
    """sha256 of the rows' sizes in order; None under ``--buckets off`` (no sizes). The metadata file's own sha256
    is in the fingerprint, so the rows are the same ones."""
    if sized_rows is None:
        return None
    sizes = [list(size) if size else None for _, size in sized_rows]
    return hashlib.sha256(json.dumps(sizes, separators=(",", ":")).encode()).hexdigest()


def _plain(sized_rows: list) -> list:
    return [[video, *(size or (None, None))] for video, size in sized_rows]


def write_row_sizes(folder: Path, sized_rows: list, missing: list[int]) -> None:
    """The checkpoint's record: every row's file and size (None under ``--buckets off``), and the 1-based rows
    whose file was not found when the run started."""
    atomic_write_text(folder / ROW_SIZES, json.dumps({"rows": _plain(sized_rows), "missing": missing},
                                                     separators=(",", ":")) + "\n")


@dataclass
class MediaNow:
    """The metadata's rows and their files as they are now."""
    videos: list[str]               # each row's file, as the metadata names it
    sizes: list | None              # each row's size as the training takes it (the file's, else its columns);
                                    # None under --buckets off
    missing: list[int]              # 1-based rows whose file is not there
    stale_columns: list[int]        # 1-based rows whose width/height columns are not their file's size
    base_path: str = ""


def media_now(options, rows: list[dict], with_sizes: bool = True) -> MediaNow | None:
    """``rows`` (the metadata as read) and their files now: with ``with_sizes`` (a resume compares them) their sizes
    from the run's size table under ``--buckets aspect``; None where a size cell is no size (opening the dataset
    says so, naming the row)."""
    from diffsynth_mbc.data.media.row_buckets import file_and_column_sizes
    from diffsynth_mbc.data.media.size_table import table_path_in
    from diffsynth_mbc.data.metadata_csv import missing_files
    from diffsynth_mbc.errors import MetadataError

    sizes = stale = None
    if with_sizes and options.buckets == "aspect":
        try:
            headers, columns = file_and_column_sizes(rows, options.dataset_base_path,
                                                     table_path=table_path_in(options.output_path))
        except MetadataError:
            return None
        sizes = [header or column for header, column in zip(headers, columns)]
        stale = [number for number, (header, column) in enumerate(zip(headers, columns), 1)
                 if header and column and header != column]
    return MediaNow([str(row.get("video")) for row in rows], sizes, missing_files(rows, options.dataset_base_path),
                    stale or [], options.dataset_base_path)


def saved_media(folder: Path) -> tuple[list, list[int] | None] | None:
    """(rows as saved: [file, width, height], rows whose file was missing then or None when not kept) of the
    checkpoint ``folder``; None when it kept no rows (saved before rows were kept, or from a latent cache)."""
    try:
        saved = json.loads((folder / ROW_SIZES).read_text(encoding="utf-8"))
        return list(saved["rows"]), saved.get("missing")
    except (OSError, ValueError, TypeError, KeyError):
        return None


def media_changes(saved_rows: list, saved_missing: list[int] | None, now: MediaNow, sizes_kept: bool) -> list[str]:
    """One line per kind of change between the checkpoint's rows and ``now``, naming the first ROWS_NAMED rows of
    each; [] when none. Rows are matched by file (a file listed twice: in order). ``sizes_kept``: the checkpoint
    trained on aspect buckets (its sizes compare); ``saved_missing`` None: whether a file was there is unknown."""
    numbers_now: dict[str, list[int]] = {}
    for number, video in enumerate(now.videos, 1):
        numbers_now.setdefault(video, []).append(number)
    missing_then, missing_now, matched = set(saved_missing or ()), set(now.missing), set()
    resized, gone, back, left = [], [], [], []
    for then_number, (video, *size) in enumerate(saved_rows, 1):
        candidates = numbers_now.get(video) or []
        if not candidates:
            left.append(f"the checkpoint's row {then_number} ({video})")
            continue
        number = candidates.pop(0)
        matched.add(number)
        named = f"metadata row {number} ({video})"
        was_there, is_there = then_number not in missing_then, number not in missing_now
        if saved_missing is not None and was_there != is_there:
            (gone if was_there else back).append(named)
        elif sizes_kept and now.sizes is not None and _size(size) != _size(now.sizes[number - 1]):
            resized.append(f"{named}: {_said(size)} then, {_said(now.sizes[number - 1])} now")
    new = [f"metadata row {number} ({video})" for number, video in enumerate(now.videos, 1) if number not in matched]
    where = f" (not found under --dataset_base_path {now.base_path})" if gone else ""
    kinds = [(resized, "file changed size", "files changed size"),
             (gone, f"file is gone{where}", f"files are gone{where}"),
             (back, "file is back (it was not found when the checkpoint's run started)",
              "files are back (they were not found when the checkpoint's run started)"),
             (left, "row left the metadata", "rows left the metadata"),
             (new, "row is new in the metadata", "rows are new in the metadata")]
    return [f"{len(named):,} {one if len(named) == 1 else many}: " + "; ".join(named[:ROWS_NAMED])
            + (f"; and {len(named) - ROWS_NAMED:,} more" if len(named) > ROWS_NAMED else "")
            for named, one, many in kinds if named]


def _size(value) -> tuple | None:
    value = list(value) if value else []
    return tuple(value) if value and value[0] else None


def _said(value) -> str:
    size = _size(value)
    return f"{size[0]}x{size[1]}" if size else "unreadable"


def changes_since(folder: Path, manifest: dict, now: MediaNow | None) -> list[str]:
    """``media_changes`` between the checkpoint ``folder`` and ``now``; [] when it kept no rows or ``now`` is None."""
    saved = saved_media(folder)
    if saved is None or now is None:
        return []
    return media_changes(saved[0], saved[1], now, sizes_kept=bool(manifest.get("row_sizes_sha256")))


def resume_refusal(folder: Path, differences: list[str], changes: list[str], now: MediaNow | None,
                   missing_media: str | None = None) -> str | None:
    """One refusal of a resume, or None when nothing differs: every row that changed (``changes``), the settings
    that differ, and what to do. The metadata's sha256 line among ``differences`` is said by the rows that changed
    (or, when none did, as its other cells). ``missing_media``: what ``--force_resume`` would still meet."""
    from diffsynth_mbc.training.checkpoints.folder import different_configuration

    settings = [line for line in differences if not line.startswith("metadata_sha256:")]
    if not changes and len(settings) == len(differences):
        return different_configuration(folder, differences) if differences else None
    lines = [f"checkpoint {folder} trained on other media: since it was saved,"]
    lines += [f"  {line}" for line in changes] or [
        "  the metadata file changed, not its rows' files or sizes: their captions or other columns did"]
    if settings:
        lines.append("and it was made with a different configuration:")
        lines += [f"  {line}" for line in settings]
    force = "pass --force_resume true to go on with this run's settings and media as they are now"
    if now is not None and now.stale_columns:
        rows = ", ".join(str(number) for number in now.stale_columns[:ROWS_NAMED])
        force += (f", once their width/height columns are the files' sizes again (metadata "
                  f"row{'s' if len(now.stale_columns) > 1 else ''} {rows}"
                  f"{' and more' if len(now.stale_columns) > ROWS_NAMED else ''}: python -m diffsynth_mbc.convert "
                  "--probe writes them)")
    if missing_media:
        force += f"; that is refused too while {missing_media}"
    return "\n".join(lines) + (
        "\nResuming would train other rows, in other buckets, with another step plan than the checkpoint's. Put the "
        f"files and the metadata back as they were and resume, start a new run (--start_over true), or {force}")


def rows_of(options) -> list[dict] | None:
    """The metadata's rows before the run loads anything; None for a latent cache (its rows are encoded) or where
    they cannot be read (opening the dataset says so, naming the file)."""
    from diffsynth_mbc.data.metadata_csv import read_metadata
    from diffsynth_mbc.errors import MetadataError

    if options.cache or not options.dataset_metadata_path:
        return None
    try:
        return read_metadata(options.dataset_metadata_path)
    except (OSError, MetadataError):
        return None
