"""Loss by timestep: each rank's training loss binned by the timestep it was drawn at, an exponential moving
average per bin over the run, and the same average as it was about ``LAG`` of the bin's samples earlier. No torch.

Fed incrementally from the history's ``timesteps`` / ``timestep_losses`` (one pair per trained sample), so a
poll costs what was appended since the last one, however long the run. A bin whose average is now below its
earlier one is where the loss still fell over the bin's last ``LAG`` samples; one where both agree has
flattened. The earlier average comes from marks taken every ``MARK_EVERY`` samples of the bin (the bin's
count and its average then); the newest mark at least ``LAG`` samples old is the earlier one, so it is
``LAG`` to ``LAG + MARK_EVERY - 1`` samples old, and a bin with fewer than ``LAG + MARK_EVERY`` samples has none.
"""

from __future__ import annotations

from collections import deque

TIMESTEPS = 1000.0   # DiffSynth's training schedule runs over [0, 1000]
BINS = 20
ALPHA = 0.05         # weight of each new sample in its bin's average (about the last 20 samples of the bin)
LAG = 100            # samples of a bin between its average and the earlier one (5 spans of the average: the two
                     # averages are of nearly disjoint samples)
MARK_EVERY = 10      # a bin's average is marked every this many of its samples
MAX_PAIRS_PER_RECORD = 4096   # more than any batch: a record claiming more is read up to this


def finite_number(value) -> bool:
    """A finite int or float (not a bool); an int too large for a float (a hostile file's) is none."""
    kind = type(value)
    return (kind is float and value - value == 0.0) or (kind is int and -1e300 < value < 1e300)


def _six(value: float) -> float:
    return float(f"{value:.6g}")


class LossByTimestep:
    """Per bin of [0, 1000): the EMA of the loss (started at the bin's first value), how many samples fell
    in it, and the marks ``(count, EMA)`` from which its earlier average is read (see the module's docstring)."""

    __slots__ = ("bins", "alpha", "ema", "count", "marks")

    def __init__(self, bins: int = BINS, alpha: float = ALPHA):
        self.bins = bins
        self.alpha = alpha
        self.ema: list[float | None] = [None] * bins
        self.count = [0] * bins
        self.marks: list[deque] = [deque() for _ in range(bins)]   # oldest first, at most LAG / MARK_EVERY + 1

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
        count = self.count[index] = self.count[index] + 1
        marks = self.marks[index]
        if count % MARK_EVERY == 0:
            marks.append((count, self.ema[index]))
        while len(marks) > 1 and marks[1][0] <= count - LAG:   # only the newest mark old enough is needed
            marks.popleft()

    def earlier(self, index: int) -> tuple[int, float] | None:
        """``(count, EMA)`` of bin ``index`` at least ``LAG`` samples ago; None while the bin is too young."""
        marks = self.marks[index]
        return marks[0] if marks and marks[0][0] <= self.count[index] - LAG else None

    def as_dict(self) -> dict:
        width = TIMESTEPS / self.bins
        earlier = [self.earlier(i) for i in range(self.bins)]
        return {"edges": [round(i * width, 6) for i in range(self.bins + 1)], "alpha": self.alpha,
                "ema": [None if v is None else _six(v) for v in self.ema], "count": list(self.count),
                "lag": LAG, "mark_every": MARK_EVERY,
                "earlier": [None if e is None else _six(e[1]) for e in earlier],
                "earlier_count": [None if e is None else e[0] for e in earlier],
                "marks": [[[c, _six(v)] for c, v in marks] for marks in self.marks]}
