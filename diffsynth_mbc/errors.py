"""Errors shared by every stage. No torch, no diffsynth."""


class OptionsError(ValueError):
    """A bad option or input setting; the message names the flag, preset key or file."""
