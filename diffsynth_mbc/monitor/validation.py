"""Validation loss per timestep quantile and the LoRA's gain over the base model, from ``{"kind": "val"}`` records.
No torch.

A validation record has ``val_loss_by_quantile`` (``{"0.1": loss, ...}``: the loss at each fixed timestep
quantile) and, where the training measured the base model (the LoRA off) on the same samples, noise and
timesteps, ``val_loss_base`` and ``val_loss_base_by_quantile`` (the same keys). Per rank this keeps a bounded
``Series`` per quantile and the gain ``base - LoRA``: of the headline loss (``gain``) and of each quantile
present in both (``gain_by_quantile``). Above 0 the LoRA does better than the base model. A history without base
losses (an older run's) has no gain: its series stay empty and the dashboard hides the chart.
"""

from __future__ import annotations

from diffsynth_mbc.monitor.series import Series
from diffsynth_mbc.monitor.status import to_float
from diffsynth_mbc.values import printable

MAX_QUANTILES = 16   # quantile series kept per rank (the training writes a handful): more in a file are left out
MAX_NAME = 12        # characters of a quantile's key kept


def quantile_losses(value) -> dict[str, float]:
    """``{key: finite loss}`` of a ``..._by_quantile`` object (keys cut to MAX_NAME); {} for anything else."""
    if type(value) is not dict:
        return {}
    out = {}
    for key, loss in value.items():
        loss = to_float(loss)
        if loss is not None:
            out[printable(str(key))[:MAX_NAME]] = loss
    return out


class ValidationQuantiles:
    """One rank's validation loss per quantile and the gain over the base model (see the module's docstring)."""

    __slots__ = ("max_points", "by_quantile", "gain", "gain_by_quantile")

    def __init__(self, max_points: int):
        self.max_points = max_points
        self.by_quantile: dict[str, Series] = {}        # "0.5" -> the LoRA's validation loss at that quantile
        self.gain = Series(max_points)                  # val_loss_base - val_loss
        self.gain_by_quantile: dict[str, Series] = {}   # "0.5" -> base - LoRA at that quantile

    def _add(self, series: dict[str, Series], name: str, step: float, value: float) -> None:
        if name in series or len(series) < MAX_QUANTILES:
            series.setdefault(name, Series(self.max_points)).add(step, value)

    def add(self, step: float, record: dict, val_loss: float | None) -> None:
        """One validation record; ``val_loss``: its headline loss as the history reads it."""
        losses = quantile_losses(record.get("val_loss_by_quantile"))
        for name, value in losses.items():
            self._add(self.by_quantile, name, step, value)
        base = to_float(record.get("val_loss_base"))
        if base is None:
            return
        if val_loss is not None:
            self.gain.add(step, base - val_loss)
        for name, value in quantile_losses(record.get("val_loss_base_by_quantile")).items():
            if name in losses:
                self._add(self.gain_by_quantile, name, step, value - losses[name])

    def payload(self, since: float | None, points: int | None) -> dict:
        """The down-sampled series for the metrics API: ``val_loss_by_quantile``, ``val_gain`` and
        ``val_gain_by_quantile`` (``{quantile: [points]}``, by quantile)."""
        def by_key(series: dict[str, Series]) -> dict:
            return {name: series[name].points(since, points) for name in sorted(series, key=_order)}

        return {"val_loss_by_quantile": by_key(self.by_quantile), "val_gain": self.gain.points(since, points),
                "val_gain_by_quantile": by_key(self.gain_by_quantile)}


def _order(name: str) -> tuple:
    """Quantile keys by their value ("0.05" before "0.5" before "0.95"), any key that is no number after, by name."""
    number = to_float(name)
    return (0, number, name) if number is not None else (1, 0.0, name)
