"""Loss per training mode (``t2i`` an image, ``i2v`` a video conditioned on its first frame, ``t2v`` a video
without a condition), read from each history record's ``modes``. No torch.

A step record lists one mode per trained sample, aligned with its ``timesteps`` and ``timestep_losses``. Per
rank and mode this keeps the mean loss of the mode's samples at each step that had any (a bounded ``Series``,
fed in bulk once per read like the other series), the loss by timestep bin of those samples alone (a
``LossByTimestep``) and the last ``RECENT_STEPS`` step means (the terminal's figure); and, from validation
records, ``val_loss_by_mode``. Histories written before modes existed have no ``modes``: nothing is kept.
"""

from __future__ import annotations

from collections import deque

from diffsynth_mbc.monitor.series import Series
from diffsynth_mbc.monitor.status import to_float
from diffsynth_mbc.values import printable
from diffsynth_mbc.monitor.timestep_bins import MAX_PAIRS_PER_RECORD, LossByTimestep, finite_number

MODE_ORDER = ("t2i", "i2v", "t2v")   # how modes are listed; any other name (a newer training's) after these
MAX_MODES = 8          # mode names kept per rank (the training has three): more in a file are left out
MAX_NAME = 12          # characters of a mode name kept
RECENT_STEPS = 20      # the terminal's loss of a mode: the mean of its last this many step means


def ordered(names) -> list[str]:
    """Mode names in MODE_ORDER, then any other by name."""
    return sorted(names, key=lambda m: (MODE_ORDER.index(m) if m in MODE_ORDER else len(MODE_ORDER), m))


class ModeLosses:
    """One rank's training and validation loss per mode (see the module's docstring)."""

    __slots__ = ("max_points", "series", "by_timestep", "recent", "val", "_xs", "_ys")

    def __init__(self, max_points: int):
        self.max_points = max_points
        self.series: dict[str, Series] = {}              # mode -> mean loss of its samples per step
        self.by_timestep: dict[str, LossByTimestep] = {}  # mode -> loss by timestep bin of its samples
        self.recent: dict[str, deque] = {}                # mode -> its last RECENT_STEPS step means
        self.val: dict[str, Series] = {}                  # mode -> validation loss (val_loss_by_mode)
        self._xs: dict[str, list] = {}   # step means read but not yet in the series (``flush``)
        self._ys: dict[str, list] = {}

    def _name(self, mode, known: dict) -> str | None:
        """The name a mode is kept under; None when it is not a name or ``MAX_MODES`` are kept already."""
        if type(mode) is not str or not mode:
            return None
        if mode in known:
            return mode
        name = printable(mode)[:MAX_NAME]
        return name if name and (name in known or len(known) < MAX_MODES) else None

    def _start(self, name: str) -> None:
        self.series[name] = Series(self.max_points)
        self.by_timestep[name] = LossByTimestep()
        self.recent[name] = deque(maxlen=RECENT_STEPS)
        self._xs[name], self._ys[name] = [], []

    def add(self, step: float, modes, timesteps, losses) -> None:
        """One step record's samples: their modes, timesteps and losses, index by index."""
        if type(modes) is not list or type(losses) is not list:
            return
        drawn = timesteps if type(timesteps) is list else []
        series, bins = self.series, self.by_timestep
        sums: dict[str, list] = {}   # mode -> [sum of its samples' losses, samples]
        for i, (mode, value) in enumerate(zip(modes[:MAX_PAIRS_PER_RECORD], losses)):
            if not finite_number(value):
                continue
            name = mode if type(mode) is str and mode in series else self._name(mode, series)
            if name is None:
                continue
            if name not in series:
                self._start(name)
            if i < len(drawn):   # a sample without a timestep counts in the mean, in no bin
                bins[name].add_pair(drawn[i], value)
            total = sums.get(name)
            if total is None:
                sums[name] = [value, 1]
            else:
                total[0] += value
                total[1] += 1
        for name, (total, count) in sums.items():
            mean = total / count
            self._xs[name].append(step)
            self._ys[name].append(mean)
            self.recent[name].append(mean)

    def flush(self) -> None:
        """Put the step means read since the last flush into the series (once per read, in bulk)."""
        for name, xs in self._xs.items():
            if xs:
                self.series[name].extend(xs, self._ys[name])
                self._xs[name], self._ys[name] = [], []

    def add_validation(self, step: float, by_mode) -> None:
        """A validation record's ``val_loss_by_mode``: ``{mode: loss}`` for the modes of its samples."""
        if type(by_mode) is not dict:
            return
        for mode, value in by_mode.items():
            value, name = to_float(value), self._name(mode, self.val)
            if value is not None and name is not None:
                self.val.setdefault(name, Series(self.max_points)).add(step, value)

    def recent_losses(self) -> dict[str, float]:
        """``{mode: the mean of its last RECENT_STEPS step means}``, in MODE_ORDER; empty without modes."""
        return {name: float(f"{sum(self.recent[name]) / len(self.recent[name]):.6g}")
                for name in ordered(self.recent) if self.recent[name]}

    def payload(self, since: float | None, points: int | None) -> dict:
        """The down-sampled per-mode series and bins, for the metrics API (the fields beside ``loss``)."""
        names = ordered(self.series)
        return {
            "loss_by_mode": {name: self.series[name].points(since, points) for name in names},
            "loss_by_timestep_by_mode": {name: self.by_timestep[name].as_dict() for name in names},
            "val_loss_by_mode": {name: self.val[name].points(since, points) for name in ordered(self.val)},
        }
