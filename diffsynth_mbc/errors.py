"""Errors shared by every stage, and how a message quotes a user's value. No torch, no diffsynth."""

import reprlib

QUOTE_LIMIT = 200   # characters of a value an error message shows


class OptionsError(ValueError):
    """A bad option or input setting; the message names the flag, preset key or file."""


class MetadataError(OptionsError):
    """A metadata CSV that cannot be read as DiffSynth reads it; the message names the file and the line."""


class _Short(reprlib.Repr):
    """reprlib's bounded repr (a few items of each container, a few levels deep), dicts in their own order."""

    def __init__(self, limit: int):
        super().__init__()
        self.maxlevel, self.maxdict, self.maxlist, self.maxtuple = 4, 8, 8, 8
        self.maxset = self.maxfrozenset = self.maxdeque = 8
        self.maxstring = self.maxother = self.maxlong = max(20, limit)

    def repr_dict(self, x, level):
        if not x:
            return "{}"
        if level <= 0:
            return "{...}"
        items = [f"{self.repr1(key, level - 1)}: {self.repr1(value, level - 1)}"
                 for key, value in list(x.items())[:self.maxdict]]
        return "{" + ", ".join(items) + (", ..." if len(x) > self.maxdict else "") + "}"

    def repr_int(self, x, level):
        try:
            return super().repr_int(x, level)
        except ValueError:   # more digits than Python converts to text
            return f"<an integer of {x.bit_length():,} bits>"


def quoted(value, limit: int = QUOTE_LIMIT) -> str:
    """``repr(value)`` for an error message, at most about ``limit`` characters whatever the value holds.

    A YAML alias bomb loads as a list of a billion items sharing a few objects: its full repr is gigabytes. This looks
    at a few items of each level only (reprlib), and cuts what is still longer; a long text says its length."""
    if isinstance(value, str):
        if len(value) <= limit:
            return repr(value)
        return f"{value[:limit]!r}... ({len(value):,} characters)"
    text = _Short(limit).repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


def clipped(text: str, limit: int = QUOTE_LIMIT) -> str:
    """``text`` (names joined for a message, say) cut to ``limit`` characters, saying how long it was."""
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text):,} characters)"
