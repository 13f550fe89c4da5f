"""Loss by timestep: each rank's training loss binned by the timestep it was drawn at, an exponential moving
average per bin over the run. No torch.

Fed incrementally from the history's ``timesteps`` / ``timestep_losses`` (one pair per trained sample), so a
poll costs what was appended since the last one, however long the run. A bin whose average still falls is
where the LoRA still learns; one that has flattened has stopped.
"""

from __future__ import annotations

TIMESTEPS = 1000.0   # DiffSynth's training schedule runs over [0, 1000]
BINS = 20
ALPHA = 0.05         # weight of each new sample in its bin's average (about the last 20 samples of the bin)
MAX_PAIRS_PER_RECORD = 4096   # more than any batch: a record claiming more is read up to this


def finite_number(value) -> bool:
    """A finite int or float (not a bool); an int too large for a float (a hostile file's) is none."""
    kind = type(value)
    return (kind is float and value - value == 0.0) or (kind is int and -1e300 < value < 1e300)


class LossByTimestep:
    """Per bin of [0, 1000): the EMA of the loss (started at the bin's first value) and how many samples fell
    in it."""

    __slots__ = ("bins", "alpha", "ema", "count")

    def __init__(self, bins: int = BINS, alpha: float = ALPHA):
        self.bins = bins
        self.alpha = alpha
        self.ema: list[float | None] = [None] * bins
        self.count = [0] * bins

    def add(self, timesteps, losses) -> None:
        """Pairs from one history record; anything not a finite number in [0, 1000] is left out."""
        if type(timesteps) is not list or type(losses) is not list:
            return
        for t, value in zip(timesteps[:MAX_PAIRS_PER_RECORD], losses[:MAX_PAIRS_PER_RECORD]):
            self.add_pair(t, value)

    def add_pair(self, t, value) -> None:
        """One sample's timestep and loss, left out unless both are finite numbers and ``t`` is in [0, 1000]."""
        if not (finite_number(t) and finite_number(value)) or not 0 <= t <= TIMESTEPS:
            return
        index = min(self.bins - 1, int(t * self.bins / TIMESTEPS))
        previous = self.ema[index]
        self.ema[index] = value if previous is None else previous + self.alpha * (value - previous)
        self.count[index] += 1

    def as_dict(self) -> dict:
        width = TIMESTEPS / self.bins
        return {"edges": [round(i * width, 6) for i in range(self.bins + 1)], "alpha": self.alpha,
                "ema": [None if v is None else float(f"{v:.6g}") for v in self.ema], "count": list(self.count)}
