"""The media sizes a checkpoint trained with (``--buckets aspect``): every row's size as displayed, saved in the
checkpoint (``row_sizes.json``) with its digest in the manifest. A resume whose files changed size since would plan
other buckets and totals ("finished: 7/6 steps"); it is refused naming the rows, as a changed metadata file is.
No torch."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from diffsynth_mbc.atomic import atomic_write_text
from diffsynth_mbc.run_layout import ROW_SIZES
ROWS_NAMED = 3


def sizes_digest(sized_rows: list | None) -> str | None:
    """sha256 of the rows' sizes in order; None under ``--buckets off`` (no sizes). The metadata file's own sha256
    is in the fingerprint, so the rows are the same ones."""
    if sized_rows is None:
        return None
    sizes = [list(size) if size else None for _, size in sized_rows]
    return hashlib.sha256(json.dumps(sizes, separators=(",", ":")).encode()).hexdigest()


def _plain(sized_rows: list) -> list:
    return [[video, *(size or (None, None))] for video, size in sized_rows]


def write_row_sizes(folder: Path, sized_rows: list) -> None:
    atomic_write_text(folder / ROW_SIZES, json.dumps({"rows": _plain(sized_rows)}, separators=(",", ":")) + "\n")


def changed_sizes(folder: Path, manifest: dict, sized_rows: list | None) -> str | None:
    """The refusal of a resume from ``folder`` whose rows' sizes changed since, naming the rows; None when none did
    (or the checkpoint has no sizes: saved under ``--buckets off`` or before sizes were kept)."""
    saved_digest = manifest.get("row_sizes_sha256")
    if not saved_digest or sized_rows is None or saved_digest == sizes_digest(sized_rows):
        return None
    saved = json.loads((folder / ROW_SIZES).read_text(encoding="utf-8"))["rows"]
    now = _plain(sized_rows)
    changed = [(number, then, current) for number, (then, current) in enumerate(zip(saved, now), 1)
               if then[1:] != current[1:]]
    if len(saved) != len(now):
        changed.append((min(len(saved), len(now)) + 1, [f"{len(saved):,} rows"], [f"{len(now):,} rows"]))
    shown = "; ".join(f"metadata row {number} ({current[0]}): {_size(then)} then, {_size(current)} now"
                      for number, then, current in changed[:ROWS_NAMED])
    more = f"; and {len(changed) - ROWS_NAMED:,} more rows" if len(changed) > ROWS_NAMED else ""
    return (f"checkpoint {folder.name} trained on media of other sizes: {shown}{more}. Resuming would put these "
            "rows in other buckets and change the step plan. Restore the files as they were, start a new run "
            "(--start_over true), or pass --force_resume true to go on with the new sizes")


def resized_since(options, folder: Path, manifest: dict) -> str | None:
    """``changed_sizes`` before the run loads anything (the launcher's plan, every rank at start): the rows' sizes
    from the run's size table. None where the metadata or a size cell cannot be read: opening the dataset says so."""
    if options.buckets != "aspect" or options.cache or not manifest.get("row_sizes_sha256"):
        return None
    from diffsynth_mbc.data.media.row_buckets import row_sizes
    from diffsynth_mbc.data.media.size_table import table_path_in
    from diffsynth_mbc.data.metadata_csv import read_metadata
    from diffsynth_mbc.errors import MetadataError

    try:
        rows = read_metadata(options.dataset_metadata_path)
        sizes = row_sizes(rows, options.dataset_base_path, table_path=table_path_in(options.output_path))
    except (OSError, MetadataError):
        return None
    return changed_sizes(folder, manifest, [(str(row.get("video")), size) for row, size in zip(rows, sizes)])


def _size(entry: list) -> str:
    if len(entry) == 1:
        return entry[0]
    return f"{entry[1]}x{entry[2]}" if entry[1] else "unreadable"
