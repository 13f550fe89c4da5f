"""Several catalogues in one run: the ``datasets:`` list of a preset (or ``--datasets FILE``). No torch, no pandas.

Each item names one converted catalogue and how it joins the run::

    datasets:
      - {base_path: data/news, metadata_path: data/news/metadata.csv}
      - {base_path: data/drama, metadata_path: data/drama/metadata.csv, repeat: 3,
         caption_prefix: "mbc drama, ", media: video, name: drama}

The items are combined into ONE metadata file (``OUTPUT_PATH/datasets/metadata.csv``: absolute file paths,
each caption with its catalogue's prefix, a ``dataset`` column with the item's position), which the run then
trains from as ``--dataset_metadata_path``: the latent cache, the batch sampler, the step plan, the ETA and the
monitor all see one catalogue. A catalogue's ``repeat`` is applied by the sampler (each of its rows is drawn that
many times per epoch, times ``--dataset_repeat``), not by copying rows, so the cache encodes each row once and a
changed repeat keeps the cache. ``--dataset_base_path``/``--dataset_metadata_path``/``--dataset_repeat`` remain
the one-catalogue shorthand.
"""

from __future__ import annotations

import csv
import io
import os
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from diffsynth_mbc.atomic import atomic_open
from diffsynth_mbc.data.media.buckets import media_kind
from diffsynth_mbc.data.media.shapes import IMAGE, VIDEO, shape_key
from diffsynth_mbc.data.metadata_csv import read_metadata
from diffsynth_mbc.errors import MetadataError, OptionsError, clipped, quoted
from diffsynth_mbc.run_layout import COMBINED_METADATA
from diffsynth_mbc.yaml_input import load_yaml

MEDIA = ("all", VIDEO, IMAGE)
KEYS = ("base_path", "metadata_path", "repeat", "caption_prefix", "media", "name")
COLUMNS = ("video", "prompt", "media_type", "dataset")
# The largest plan a run takes. The batch sampler draws every sample of an epoch on every rank before the first step
# (one index each: 10 million samples took 1.3 GB and 51 s per rank and epoch, measured), and no repeat needs more:
# more passes over the data are --num_epochs, which the sampler draws one at a time.
MAX_REPEAT = 10_000                   # a catalogue's repeat, and --dataset_repeat
MAX_SAMPLES_PER_EPOCH = 10_000_000    # rows x repeats of all catalogues together


@dataclass(frozen=True)
class Catalogue:
    name: str
    base_path: str
    metadata_path: str
    repeat: int = 1
    caption_prefix: str = ""
    media: str = "all"


@dataclass(frozen=True)
class DatasetCount:
    """One catalogue's share of an epoch, for the step plan and the status files."""
    name: str
    videos: int
    images: int
    repeat: int   # the catalogue's own; the plan multiplies by --dataset_repeat


def dataset_caption(caption: str, catalogue: Catalogue) -> str:
    """The caption a row of ``catalogue`` trains with: its ``caption_prefix`` then the caption, as written (so
    ``"mbc drama, "`` gives ``"mbc drama, a man walks"``). It is written into the combined metadata, so the
    latent cache keys each caption's embedding on the prefixed text."""
    return f"{catalogue.caption_prefix}{caption}"


def parse_datasets(value, source: str = "datasets") -> list[Catalogue]:
    """The ``datasets`` option (a list of mappings, or the path of a YAML file holding one), checked; OptionsError
    names the item and the key."""
    if isinstance(value, (str, os.PathLike)):
        path = Path(value)
        try:
            value = load_yaml(path, "--datasets")
        except FileNotFoundError:
            raise OptionsError(f"--datasets: file not found: {path}") from None
        source = f"--datasets {path}"
        if isinstance(value, dict) and set(value) == {"datasets"}:
            value = value["datasets"]
    if not isinstance(value, list) or not value:
        raise OptionsError(f"{source} must be a non-empty list of catalogues ({{base_path, metadata_path, repeat, "
                           f"caption_prefix, media}}), got {quoted(value)}")
    catalogues, names = [], set()
    for position, item in enumerate(value):
        where = f"{source}[{position}]"
        if not isinstance(item, dict):
            raise OptionsError(f"{where} must be a mapping with base_path and metadata_path, got {quoted(item)}")
        unknown = sorted(map(str, set(item) - set(KEYS)))
        if unknown:
            raise OptionsError(f"{where}: unknown key(s) {clipped(', '.join(unknown))} (known: {', '.join(KEYS)})")
        for key in ("base_path", "metadata_path"):
            if not isinstance(item.get(key), str) or not item[key]:
                raise OptionsError(f"{where}: {key} is required (a path), got {quoted(item.get(key))}")
        name = clipped(str(item.get("name", Path(item["metadata_path"]).parent.name or f"dataset{position}")), 100)
        name = name if name not in names else f"{name}#{position}"
        repeat = item.get("repeat", 1)
        if isinstance(repeat, bool) or not isinstance(repeat, int) or repeat < 1:
            raise OptionsError(f"{where}: repeat must be a positive integer, got {quoted(repeat)}")
        if repeat > MAX_REPEAT:
            raise OptionsError(f"{where} ({name}, {item['metadata_path']}): repeat {repeat:,} is above {MAX_REPEAT:,}, "
                               "the most a catalogue is repeated per epoch; train more epochs (--num_epochs) instead")
        prefix = item.get("caption_prefix", "") or ""
        if not isinstance(prefix, str):
            raise OptionsError(f"{where}: caption_prefix must be text, got {quoted(prefix)}")
        media = item.get("media", "all")
        if media not in MEDIA:
            raise OptionsError(f"{where}: media must be one of {', '.join(MEDIA)}, got {quoted(media)}")
        names.add(name)
        catalogues.append(Catalogue(name, item["base_path"], item["metadata_path"], repeat, prefix, media))
    return catalogues


def combined_rows(catalogues: Sequence[Catalogue]) -> list[dict]:
    """Every kept row of every catalogue, in order: absolute file path, prefixed caption, media type, and the
    catalogue's position. OptionsError names the catalogue (and row) that cannot be read or keeps no rows."""
    rows = []
    for position, catalogue in enumerate(catalogues):
        where = f"datasets[{position}] ({catalogue.name})"
        base = os.path.abspath(catalogue.base_path)
        if not os.path.isdir(base):
            raise OptionsError(f"{where}: base_path {catalogue.base_path} is not a folder")
        try:
            records = read_metadata(catalogue.metadata_path)
            fields = set(records[0]) if records else set()
        except FileNotFoundError:
            raise OptionsError(f"{where}: metadata_path {catalogue.metadata_path} not found") from None
        except MetadataError as exc:
            raise MetadataError(f"{where}: metadata_path {exc}") from None
        missing = [column for column in ("video", "prompt") if records and column not in fields]
        if missing:
            raise OptionsError(f"{where}: {catalogue.metadata_path} has no {' or '.join(missing)} column (use "
                               "the metadata.csv written by `python -m diffsynth_mbc.convert`)")
        kept = 0
        for line, record in enumerate(records, start=2):
            file_name, kind = record.get("video") or "", shape_key(record.get("media_type"), record.get("video"))
            if not file_name:
                raise OptionsError(f"{where}: {catalogue.metadata_path} line {line}: no file in the video column")
            if catalogue.media != "all" and kind != catalogue.media:
                continue
            rows.append({"video": os.path.join(base, file_name),
                         "prompt": dataset_caption(record.get("prompt") or "", catalogue),
                         "media_type": kind, "dataset": position})
            kept += 1
        if not kept:
            raise OptionsError(f"{where}: {catalogue.metadata_path} keeps no rows"
                               + (f" with media: {catalogue.media}" if catalogue.media != "all" else ""))
    return rows


def check_epoch_size(counts: Sequence[tuple[str, int, int]], dataset_repeat: int) -> None:
    """``counts``: (the catalogue, named, its rows, its repeat) of each catalogue. OptionsError naming the catalogue
    that weighs most, its values and the limit when an epoch would hold more than MAX_SAMPLES_PER_EPOCH samples."""
    total = sum(rows * repeat for _, rows, repeat in counts) * dataset_repeat
    if total <= MAX_SAMPLES_PER_EPOCH:
        return
    name, rows, repeat = max(counts, key=lambda count: count[1] * count[2])
    times = (f" x repeat {repeat:,}" if repeat != 1 else "") + \
        (f" x --dataset_repeat {dataset_repeat:,}" if dataset_repeat != 1 else "")
    every = f" ({total:,} with every catalogue)" if len(counts) > 1 else ""
    raise OptionsError(f"{name}: {rows:,} rows{times} = {rows * repeat * dataset_repeat:,} samples per epoch{every}, "
                       f"above {MAX_SAMPLES_PER_EPOCH:,}, the most one epoch takes (every rank draws all of an "
                       "epoch's samples before its first step); lower the repeat and train more epochs "
                       "(--num_epochs) instead")


def write_combined(catalogues: Sequence[Catalogue], output_path: str | os.PathLike, dataset_repeat: int = 1) -> Path:
    """The combined metadata under ``output_path``, written atomically; an epoch too large for the batch sampler
    (``check_epoch_size``) is refused first. Every process of a launch (the plan, the doctor, each rank) and each
    resume makes it: a file that already holds these bytes is left as it is, so its time says when it last changed."""
    path = Path(output_path) / COMBINED_METADATA
    rows = combined_rows(catalogues)
    kept = Counter(row["dataset"] for row in rows)
    check_epoch_size([(f"datasets[{position}] ({catalogue.name}, {catalogue.metadata_path})", kept[position],
                       catalogue.repeat) for position, catalogue in enumerate(catalogues)], dataset_repeat)
    text = io.StringIO(newline="")
    writer = csv.DictWriter(text, fieldnames=COLUMNS, lineterminator="\n")
    writer.writeheader()
    writer.writerows(rows)
    content = text.getvalue().encode("utf-8")
    if path.is_file() and path.stat().st_size == len(content) and path.read_bytes() == content:
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_open(path, "wb") as handle:
        handle.write(content)
    return path


def apply_datasets(options: dict, preset: dict | None = None, given: dict | None = None) -> None:
    """With ``datasets``: write the combined metadata and point ``dataset_metadata_path``/``dataset_base_path`` at
    it; ``datasets`` becomes the checked list. Command line beats preset: ``--datasets`` replaces a preset's
    one-catalogue paths and ``--dataset_metadata_path`` a preset's ``datasets``; both at one level are refused."""
    single = ("dataset_metadata_path", "dataset_base_path")
    levels = [level for level in (given or {}, preset or {}) if level.get("datasets") or
              any(level.get(key) for key in single)]
    if levels and not levels[0].get("datasets"):   # the highest level naming data names one catalogue
        options["datasets"] = None
    if not options.get("datasets"):
        options["datasets"] = None
        return
    both = [key for key in single if levels[0].get(key)]
    if both:
        raise OptionsError(f"--datasets lists the catalogues; do not give --{both[0]} beside it (it is the "
                           "one-catalogue shorthand)")
    catalogues = parse_datasets(options["datasets"])
    repeat = options.get("dataset_repeat") or 1
    path = write_combined(catalogues, options["output_path"], repeat if isinstance(repeat, int) else 1)
    options["datasets"] = catalogues
    options["dataset_metadata_path"], options["dataset_base_path"] = str(path), str(path.parent)


def dataset_column(metadata_path: str | os.PathLike) -> list[int]:
    """The combined metadata's ``dataset`` column: the catalogue position of metadata row ``i + 1`` at ``i``."""
    with open(metadata_path, newline="", encoding="utf-8") as handle:
        return [int(record["dataset"]) for record in csv.DictReader(handle)]


def row_datasets(metadata_path: str | os.PathLike, metadata_rows: Sequence[int]) -> list[int]:
    """The catalogue position of each training row, given each row's 1-based metadata row."""
    column = dataset_column(metadata_path)
    return [column[row - 1] for row in metadata_rows]


def row_repeats(catalogues: Sequence[Catalogue] | None, datasets_of_rows: Sequence[int]) -> list[int] | None:
    """Each row's catalogue repeat, or None when every one is 1 (the sampler then draws as with one catalogue)."""
    if not catalogues or all(catalogue.repeat == 1 for catalogue in catalogues):
        return None
    return [catalogues[position].repeat for position in datasets_of_rows]


def dataset_counts(catalogues: Sequence[Catalogue] | None, datasets_of_rows: Sequence[int],
                   keys: Sequence[str]) -> tuple[DatasetCount, ...]:
    """Each catalogue's videos and images among the training rows (``keys``: each row's shape key)."""
    if not catalogues:
        return ()
    videos, images = [0] * len(catalogues), [0] * len(catalogues)
    for position, key in zip(datasets_of_rows, keys):
        (images if media_kind(key) == IMAGE else videos)[position] += 1
    return tuple(DatasetCount(c.name, videos[i], images[i], c.repeat) for i, c in enumerate(catalogues))


def training_rows_of(dataset) -> list[int]:
    """1-based metadata rows of a training dataset's rows: a latent cache keeps only the rows it could encode."""
    entries = getattr(dataset, "entries", None)
    if entries is not None:
        return [int(entry["row"]) for entry in entries]
    return list(range(1, dataset.rows + 1))


def catalogue_plan(options, dataset, keys: Sequence[str]) -> tuple[list[int] | None, tuple[DatasetCount, ...]]:
    """(per-row repeats for the sampler, per-catalogue counts for the step plan); (None, ()) with one catalogue."""
    catalogues = options.datasets
    if not catalogues:
        return None, ()
    positions = row_datasets(options.dataset_metadata_path, training_rows_of(dataset))
    return row_repeats(catalogues, positions), dataset_counts(catalogues, positions, keys)


def metadata_counts(options) -> tuple[DatasetCount, ...]:
    """Per-catalogue counts from the combined metadata alone (before any dataset is opened: the plan command)."""
    catalogues = options.datasets
    if not catalogues:
        return ()
    with open(options.dataset_metadata_path, newline="", encoding="utf-8") as handle:
        records = list(csv.DictReader(handle))
    return dataset_counts(catalogues, [int(r["dataset"]) for r in records],
                          [shape_key(r.get("media_type"), r.get("video")) for r in records])
