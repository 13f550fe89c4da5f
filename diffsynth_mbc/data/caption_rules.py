"""What a caption trains as: a trigger word around it (``--caption_prefix`` / ``--caption_suffix``) and, with
``--caption_dropout P``, the empty prompt instead on a share P of the samples. No torch.

The affixes join the caption with one space each, and only when they are not empty, so a run without them
trains on the catalogue's captions exactly as written. Which samples lose their caption is a pure function of
(seed, rank, epoch, the sample's place in that rank's epoch): no random number generator is drawn from, so the
noise and timesteps of a run do not move when dropout is switched on, and a resumed run (which restores its
data position) drops exactly the samples the uninterrupted run drops.
"""

from __future__ import annotations

from diffsynth_mbc.data.sample_draws import draw as sample_draw
from diffsynth_mbc.errors import quoted

EMPTY_PROMPT = ""


def with_affixes(caption: str, prefix: str = "", suffix: str = "") -> str:
    """``prefix caption suffix``, joined by single spaces; an empty affix adds nothing (the caption unchanged)."""
    if not prefix and not suffix:
        return caption
    return " ".join(part for part in (prefix, caption, suffix) if part)


def caption_affixes(options) -> dict:
    """--caption_prefix / --caption_suffix of training or cache options ("" where one is not given)."""
    return {"caption_prefix": options.caption_prefix or "", "caption_suffix": options.caption_suffix or ""}


def draw(seed: int, rank: int, epoch: int, batch: int, place: int) -> float:
    """A number in [0, 1), the same for the same (seed, rank, epoch, batch in the epoch, place in the batch)."""
    return sample_draw("caption-dropout", seed, rank, epoch, batch, place)


def dropped(probability: float, seed: int, rank: int, epoch: int, batch: int, place: int) -> bool:
    """Whether this sample trains on the empty prompt. Probability 0 never draws (and never drops)."""
    return probability > 0 and draw(seed, rank, epoch, batch, place) < probability


def check_caption_options(options: dict) -> str | None:
    """The problem with --caption_dropout / --caption_prefix / --caption_suffix, naming the flag; None if fine."""
    for key in ("caption_prefix", "caption_suffix"):
        value = options.get(key)
        if value is not None and not isinstance(value, str):
            return f"--{key} must be text, got {quoted(value)} (quote it in a YAML preset)"
        if value and (value != value.strip() or "\n" in value or "\r" in value):
            return (f"--{key} must be one line without leading or trailing spaces (it is joined to the caption "
                    f"with one space), got {quoted(value)}")
    return None
