"""Choosing rows of a validated catalogue and accounting for every one: --media, --subset, --val_fraction,
the conversion plan and the check that written + rejected == input. Pure logic, like ``catalog``.
"""

from __future__ import annotations

import random
from collections import Counter
from dataclasses import dataclass
from typing import Iterable, Sequence

from diffsynth_mbc.data.convert.catalogue_rows import (MEDIA_TYPES, Catalog, Entry, Reason, Reject,
                                                       normalise_base_path, validate_rows)

# ---------------------------------------------------------------------------------------------
# Selection: --media, --subset, --val_fraction


def select_media(entries: Sequence[Entry], media: str) -> tuple[list[Entry], list[Entry]]:
    """Split entries into (kept, not selected) by --media (all, video or image)."""
    if media == "all":
        return list(entries), []
    kept = [e for e in entries if e.media_type == media]
    dropped = [e for e in entries if e.media_type != media]
    return kept, dropped


def stratified_counts(group_sizes: dict[str, int], total: int) -> dict[str, int]:
    """Share ``total`` over groups in proportion to their sizes (largest remainder, ties by name)."""
    available = sum(group_sizes.values())
    if total >= available:
        return dict(group_sizes)
    exact = {name: total * size / available for name, size in group_sizes.items()}
    counts = {name: int(value) for name, value in exact.items()}
    leftover = total - sum(counts.values())
    by_remainder = sorted(group_sizes, key=lambda name: (-(exact[name] - counts[name]), name))
    for name in by_remainder[:leftover]:
        counts[name] += 1
    return counts


def _group_by_media_type(entries: Sequence[Entry]) -> dict[str, list[Entry]]:
    groups: dict[str, list[Entry]] = {}
    for entry in entries:
        groups.setdefault(entry.media_type, []).append(entry)
    return groups


def _pick_per_group(entries: Sequence[Entry], counts: dict[str, int], seed: int) -> tuple[list[Entry], list[Entry]]:
    """Pick counts[media_type] entries of each media type at random; both lists keep catalogue order."""
    picked_rows: set[int] = set()
    for media_type, group in sorted(_group_by_media_type(entries).items()):
        rng = random.Random(f"{seed}:{media_type}")
        picked_rows.update(e.row for e in rng.sample(group, counts.get(media_type, 0)))
    picked = [e for e in entries if e.row in picked_rows]
    rest = [e for e in entries if e.row not in picked_rows]
    return picked, rest


def stratified_subset(entries: Sequence[Entry], size: int, seed: int) -> tuple[list[Entry], list[Entry]]:
    """(subset, not picked): ``size`` entries whose video/image ratio matches ``entries``."""
    group_sizes = {k: len(v) for k, v in _group_by_media_type(entries).items()}
    return _pick_per_group(entries, stratified_counts(group_sizes, size), seed)


def stratified_split(entries: Sequence[Entry], val_fraction: float, seed: int) -> tuple[list[Entry], list[Entry]]:
    """(train, val): round(fraction * n) of each media type go to validation."""
    counts = {k: round(val_fraction * len(v)) for k, v in _group_by_media_type(entries).items()}
    val, train = _pick_per_group(entries, counts, seed + 1_000_003)
    return train, val


# ---------------------------------------------------------------------------------------------
# Accounting


def count_media_types(entries: Iterable[Entry]) -> dict[str, int]:
    counts = Counter(e.media_type for e in entries)
    return {media_type: counts.get(media_type, 0) for media_type in MEDIA_TYPES}


def count_reasons(rejects: Iterable[Reject]) -> dict[str, int]:
    return dict(sorted(Counter(r.code for r in rejects).items()))


def check_accounting(input_rows: int, written: Sequence[Entry], rejects: Sequence[Reject]) -> None:
    """Every input row is written or rejected, exactly once; raise AssertionError otherwise."""
    written_rows = [e.row for e in written]
    rejected_rows = [r.row for r in rejects]
    all_rows = sorted(written_rows + rejected_rows)
    if all_rows != list(range(1, input_rows + 1)):
        raise AssertionError(
            f"row accounting broken: {input_rows} input rows, {len(written_rows)} written, "
            f"{len(rejected_rows)} rejected"
        )


# ---------------------------------------------------------------------------------------------
# The whole plan, before probing


@dataclass
class SubsetInfo:
    requested: int
    available: int  # valid, selected rows it was drawn from
    taken: int
    took_all: bool  # requested >= available
    available_by_media_type: dict[str, int]
    taken_by_media_type: dict[str, int]


@dataclass
class ConversionPlan:
    train: list[Entry]
    val: list[Entry]
    rejects: list[Reject]
    input_rows: dict[str, int]  # catalogue name -> numbered data rows
    blank_lines: dict[str, int]
    subset: SubsetInfo | None = None
    split_mode: str | None = None  # "catalog", "fraction" or None


def _not_selected(entries: Iterable[Entry], code: str, detail: str) -> list[Reject]:
    reason = f"{code} ({detail})" if detail else code
    return [Reject.of(e, code, reason) for e in entries]


def plan_conversion(
    train_catalog: Catalog,
    base_path: str,
    *,
    val_catalog: Catalog | None = None,
    val_fraction: float | None = None,
    subset: int | None = None,
    seed: int = 0,
    media: str = "all",
    check_files: bool = True,
) -> ConversionPlan:
    """Validate, filter by --media, take --subset, split off validation rows.

    Order for the training catalogue: validate (every row, incl. duplicates of validation rows),
    --media, --subset (of what is left), then --val_fraction (of the subset). The validation
    catalogue is validated and filtered by --media but never subset. Every row not kept becomes
    a Reject, so written + rejected == input rows per catalogue.
    """
    base_path = normalise_base_path(base_path)
    rejects: list[Reject] = []
    val_entries: list[Entry] = []
    validation_paths: dict[str, int] = {}
    input_rows = {"train": len(train_catalog.rows)}
    blank_lines = {"train": train_catalog.blank_lines}
    split_mode = None

    if val_catalog is not None:
        split_mode = "catalog"
        input_rows["val"] = len(val_catalog.rows)
        blank_lines["val"] = val_catalog.blank_lines
        val_result = validate_rows(val_catalog, base_path, "val", check_files)
        rejects += val_result.rejects
        validation_paths = {e.resolved_path: e.row for e in val_result.accepted}
        val_entries, unselected = select_media(val_result.accepted, media)
        rejects += _not_selected(unselected, Reason.NOT_SELECTED, f"--media {media}")

    train_result = validate_rows(train_catalog, base_path, "train", check_files, validation_paths)
    rejects += train_result.rejects
    train_entries, unselected = select_media(train_result.accepted, media)
    rejects += _not_selected(unselected, Reason.NOT_SELECTED, f"--media {media}")

    subset_info = None
    if subset is not None:
        available = count_media_types(train_entries)
        picked, not_picked = stratified_subset(train_entries, subset, seed)
        rejects += _not_selected(not_picked, Reason.NOT_IN_SUBSET, f"--subset {subset}")
        subset_info = SubsetInfo(subset, len(train_entries), len(picked), subset >= len(train_entries),
                                 available, count_media_types(picked))
        train_entries = picked

    if val_fraction is not None:
        split_mode = "fraction"
        train_entries, val_from_train = stratified_split(train_entries, val_fraction, seed)
        val_entries = val_from_train

    return ConversionPlan(train_entries, val_entries, rejects, input_rows, blank_lines, subset_info, split_mode)
