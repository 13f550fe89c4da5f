"""A number in [0, 1) that a run decides a sample by, without drawing from a random number generator. No torch.

Caption dropout and the training mode of a video (``training/step/objective.py``) are decided per sample from the run's
seed and the sample's place in the run (rank, epoch, batch, place in the batch) or in the validation set. Hashing
them instead of drawing keeps the noise and timesteps where they would be without the decision, and gives a
resumed run, which restores its data position, the same decisions as the uninterrupted run.
"""

from __future__ import annotations

import hashlib


def draw(purpose: str, *key: int) -> float:
    """The same number in [0, 1) for the same purpose and key; independent across purposes."""
    text = ":".join([purpose, *(str(int(part)) for part in key)])
    digest = hashlib.blake2b(text.encode("ascii"), digest_size=8).digest()
    return int.from_bytes(digest, "big") / 2**64
