"""How the terminal monitor writes a duration, a loss, a learning rate, a step time, a rate and a clock time: one rule
per kind of number, the loss as the dashboard writes it. Pure: no rich."""

from __future__ import annotations

import math
import time
from decimal import ROUND_HALF_UP, Decimal


def fmt_duration(seconds) -> str:
    if seconds is None:
        return "-"
    seconds = int(round(max(0.0, float(seconds))))
    days, rest = divmod(seconds, 86400)
    hours, rest = divmod(rest, 3600)
    minutes, secs = divmod(rest, 60)
    if days:
        return f"{days}d{hours:02d}h{minutes:02d}m"
    if hours:
        return f"{hours}h{minutes:02d}m{secs:02d}s"
    if minutes:
        return f"{minutes}m{secs:02d}s"
    return f"{secs}s"


def fmt_num(value, spec: str = ".4g") -> str:
    if value is None:
        return "-"
    try:
        return format(value, spec)
    except (TypeError, ValueError):
        return str(value)


def fmt_loss(value) -> str:
    """Every loss the view shows (the mean, each rank's, each mode's), as the dashboard writes it: 4 significant
    digits with their zeros (``0.4100`` beside ``0.4123``, never ``0.41``); 0.001 <= |v| < 10000 plain, else
    ``4.123e-5``."""
    try:
        value = float(value) if type(value) in (int, float) else math.nan
    except OverflowError:   # an int too large for a float
        value = math.nan
    if not math.isfinite(value):
        return "-"
    if value == 0:
        return "0"
    exact = Decimal(value)   # rounded half away from zero, as the page's toFixed / toExponential round
    power = exact.adjusted()
    rounded = exact.quantize(Decimal(1).scaleb(power - 3), ROUND_HALF_UP)
    if rounded.adjusted() > power:   # 9999.6 is 1.000e4
        power += 1
        rounded = exact.quantize(Decimal(1).scaleb(power - 3), ROUND_HALF_UP)
    return f"{rounded:f}" if -3 <= power < 4 else f"{rounded.scaleb(-power):f}e{power}"


def fmt_lr(value) -> str:
    return fmt_num(value, ".3g")


def fmt_seconds(value) -> str:
    """A step time: seconds with 2 decimals."""
    return "-" if value is None else fmt_num(value, ".2f")


def fmt_rate(value) -> str:
    """Samples (or cache rows) per second."""
    return fmt_num(value, ".3g")


def fmt_clock(ts) -> str:
    if ts is None:
        return "-"
    try:
        return time.strftime("%H:%M:%S", time.localtime(float(ts)))
    except (OverflowError, ValueError, OSError):
        return "-"
