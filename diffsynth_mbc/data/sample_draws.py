"""A number in [0, 1) that a run decides a sample by, without drawing from a random number generator. No torch.

Caption dropout and the training mode of a video (``training/step/objective.py``) are decided per sample from the run's
seed and the sample's place in the run (rank, epoch, batch, place in the batch) or in the validation set. Hashing
them instead of drawing keeps the noise and timesteps where they would be without the decision, and gives a
resumed run, which restores its data position, the same decisions as the uninterrupted run.

A loader index names its sample too: ``epoch x span + k x rows + r`` is copy ``k`` of row ``r`` in that epoch
(``epoch_span``, ``sample_place``; the batch sampler lays them out, ``training/plan/batches.py``).
"""

from __future__ import annotations

import hashlib
from typing import Sequence


def draw(purpose: str, *key: int) -> float:
    """The same number in [0, 1) for the same purpose and key; independent across purposes."""
    text = ":".join([purpose, *(str(int(part)) for part in key)])
    digest = hashlib.blake2b(text.encode("ascii"), digest_size=8).digest()
    return int.from_bytes(digest, "big") / 2**64


def epoch_span(rows: int, repeat: int, row_repeats: Sequence[int] | None = None) -> int:
    """The sample indices one epoch spans: copy ``k`` of row ``r`` is ``k * rows + r``, and a catalogue's repeat
    (``row_repeats``) makes more copies of its rows than ``repeat`` alone."""
    return rows * repeat * (max(row_repeats) if row_repeats else 1)


def sample_place(index: int, span: int, rows: int) -> tuple[int, int, int]:
    """(epoch, sample within the epoch, which copy of its row) of a loader index (``epoch x span`` + sample)."""
    epoch, sample = divmod(index, span)
    return epoch, sample, sample // rows
