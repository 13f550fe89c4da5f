"""Each catalogue's samples trained this epoch on this rank, when a run trains several (``--datasets``). No torch.

The loop counts every batch it trains by the catalogue of each sample's metadata row (the combined metadata's
``dataset`` column, ``data/dataset_list.py``); the status file carries ``catalogue_progress``: ``[{"name", "seen",
"per_epoch"}]`` (``per_epoch``: about this rank's share of the catalogue's samples per epoch, its rows x repeats
/ ranks), rewritten with every step (nothing grows) and back to 0 when an epoch begins; the terminal's progress
line ends with ``seen: news 10/~15, drama 4/~18``. A run resumed in the middle of an epoch counts from where it went on.
With one catalogue nothing is counted or shown.
"""

from __future__ import annotations

from typing import Sequence

from diffsynth_mbc.data.dataset_list import dataset_column


class CatalogueProgress:
    def __init__(self, names: Sequence[str], per_epoch: Sequence[int], catalogue_of_row: Sequence[int]):
        self.names, self.per_epoch = list(names), list(per_epoch)
        self.catalogue_of_row = list(catalogue_of_row)   # metadata row r (1-based) -> catalogue at r - 1
        self.seen = [0] * len(self.names)

    @classmethod
    def from_run(cls, options, plan, world_size: int) -> CatalogueProgress | None:
        """From the options' catalogues and the step plan's counts; None with fewer than two catalogues."""
        catalogues = plan.dataset_dicts()
        if not options.datasets or len(catalogues) < 2:
            return None
        return cls([item["name"] for item in catalogues],
                   [-(-item["samples_per_epoch"] // world_size) for item in catalogues],
                   dataset_column(options.dataset_metadata_path))

    def count(self, batch: Sequence[dict]) -> None:
        """A batch trained: each sample counts for the catalogue of its metadata row (``sample["row"]``)."""
        for sample in batch:
            row = sample.get("row")
            if isinstance(row, int) and 1 <= row <= len(self.catalogue_of_row):
                self.seen[self.catalogue_of_row[row - 1]] += 1

    def reset(self) -> None:
        self.seen = [0] * len(self.names)

    def as_list(self) -> list[dict]:
        return [{"name": name, "seen": seen, "per_epoch": per_epoch}
                for name, seen, per_epoch in zip(self.names, self.seen, self.per_epoch)]


def catalogues_text(progress) -> str:
    """``news 10/~15, drama 4/~18`` from a status file's ``catalogue_progress`` (``~``: the share per epoch is the
    plan's even split over the ranks; one rank may draw a few more of a catalogue); '' with fewer than two."""
    if not isinstance(progress, list) or len(progress) < 2:
        return ""
    return ", ".join(f"{item.get('name')} {item.get('seen')}/~{item.get('per_epoch')}" for item in progress
                     if isinstance(item, dict))
