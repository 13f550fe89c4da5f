"""How a training flag's text (or a preset's value) becomes its value: true or false, a number of validations or
off, and the list options' values (module names, timestep quantiles), each parsed once. A bad value raises argparse's
ArgumentTypeError on the command line; a list option's ValueError says what the value must be, and its declaration
names the flag and the value (``Declaration.typed``). No torch."""

from __future__ import annotations

import argparse
import re

_MODULE_NAME = re.compile(r"^[A-Za-z0-9_]+(\.[A-Za-z0-9_]+)*$")


def parse_bool(text) -> bool:
    lowered = str(text).strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")


def validations_or_off(text) -> int | None:
    """``--early_stop``: a number of validations (1 or more), or off / none."""
    if str(text).strip().lower() in ("off", "none"):
        return None
    try:
        number = int(str(text).strip())
    except ValueError:
        number = 0
    if number < 1:
        raise argparse.ArgumentTypeError(f"expected a number of validations (1 or more) or off, got {text!r}")
    return number


def module_names(text) -> tuple[str, ...]:
    """``q,k,v,o,ffn.0,ffn.2`` (``--lora_target_modules``): the names, in order."""
    if not isinstance(text, str) or not all(_MODULE_NAME.match(name) for name in text.split(",")):
        raise ValueError("must be a comma-separated list of module names (q,k,v,o,ffn.0, ...)")
    return tuple(text.split(","))


def quantiles(text) -> tuple[float, ...]:
    """``0.1,0.5,0.9`` (the validation's timestep quantiles): points of the noise schedule in [0, 1), in order."""
    try:
        points = tuple(float(point) for point in str(text).split(","))
    except ValueError:
        points = ()
    if not points or not all(0 <= point < 1 for point in points):
        raise ValueError("must be comma-separated numbers in [0, 1)")
    return points
