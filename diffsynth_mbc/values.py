"""What counts as a number in a value someone gave (a flag, a preset key, a file's metadata, a tensor in a file): the
one finite check every option, file and guard asks. Pure: no torch import."""

from __future__ import annotations

import math
import re

_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")


def finite_number(value, text: bool = False) -> float | None:
    """``value`` as a float when it is one finite real number, else None.

    Numbers are ints and floats (never booleans) and one-element tensors or arrays; with ``text``, also strings that
    spell one (metadata values are strings). NaN, infinities, several numbers and anything else are None."""
    if value is None or isinstance(value, bool):
        return None
    if hasattr(value, "numel") or hasattr(value, "ndim"):   # a torch tensor or a numpy array
        size = value.numel() if hasattr(value, "numel") else value.size
        if size != 1:
            return None
        value = value.item()
    elif isinstance(value, str) and not text:
        return None
    try:
        number = float(value)
    except (TypeError, ValueError, OverflowError):
        return None
    return number if math.isfinite(number) else None


def positive_number(value, text: bool = False) -> float | None:
    """``value`` as a float when it is one finite number above 0 (see ``finite_number``), else None."""
    number = finite_number(value, text)
    return number if number is not None and number > 0 else None


def printable(text: str) -> str:
    """``text`` without control characters (escape sequences, OSC titles, NUL...), newlines and tabs kept:
    whatever a file says is shown, never interpreted by the terminal."""
    return _CONTROL.sub("", text) if _CONTROL.search(text) else text
