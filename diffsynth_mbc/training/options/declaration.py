"""How an option of the training is declared, once: ``option(group, default, help, ...)`` is the ``TrainOptions``
field (``run_options.py``) whose metadata carries the rest, and ``declared(TrainOptions)`` reads it back as one
``Declaration`` per option. Built from them: the command line (``parser.py``, and the flags ``python -m
diffsynth_mbc.sample`` takes too: ``sample=True``), the range and choice checks (``checks.py``), the path options of the run's record
(``run_record.py``), the fingerprint's plain keys (``training/checkpoints/fingerprint.py``) and the recipe panel
(``training/reporting/recipe.py``). No torch.

The help ends with ``(default X)`` written from the declared default, so the two cannot drift; a default of None
says what it means instead (``unset``). A list option (``listed``) holds its values parsed once: a ``ListValue``, the
tuple of its values that keeps the text it was given as, which is what presets, the run's records and the fingerprint
hold.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

from diffsynth_mbc.errors import OptionsError, quoted

# The help's groups, in the order ``--help`` shows them.
GROUPS = ("data", "model", "LoRA", "optimisation", "timesteps (docs/recipe/timestep-sampling.md)",
          "objective (docs/recipe/objective.md)", "output and logging", "checkpoints, resume and stopping",
          "bad media and validation", "sample clips", "captions", "EMA of the LoRA weights")
DATA, MODEL, LORA, OPTIMISATION, TIMESTEPS, OBJECTIVE, OUTPUT, CHECKPOINTS, VALIDATION, SAMPLES, CAPTIONS, EMA = GROUPS
NONE_CLEARS = "none: unset, over a preset"


class ListValue(tuple):
    """A list option's values, parsed once, with the text they were given as (a flag, a preset, run_options.json):
    ``ListValue((0.25, 0.75), "0.25,0.75")``; unset: empty, with the text None. Compares as the tuple it is."""

    def __new__(cls, values=(), text: str | None = None):
        value = super().__new__(cls, values)
        value.text = text
        return value

    def __reduce__(self):   # copied and pickled with its text
        return type(self), (tuple(self), self.text)

    def __repr__(self) -> str:
        return f"ListValue({tuple(self)!r}, {self.text!r})"


@dataclasses.dataclass(frozen=True)
class Declaration:
    """One option: its name and default (the field's), and what ``option`` declared."""
    name: str
    default: object
    group: str
    help: str
    parse: Callable | None = None     # the flag's (or a preset's) text -> the value; None: the text as it is
    listed: Callable | None = None    # a list option: its text -> its values, parsed once into a ListValue
    choices: tuple = ()
    low: float | None = None
    low_included: bool = True
    high: float | None = None
    high_included: bool = True
    optional: bool = False            # ``none`` on the command line clears what a preset set
    unset: str | None = None          # what the default None means, for the help
    switch: bool = False              # a flag without a value (``--demo``)
    path: bool = False                # a file or folder the run reads or writes (relative: to where it started)
    fingerprint: bool = False         # a key of what a checkpoint must share with the run resuming it, as it is
    recipe: str | None = None         # where the recipe panel shows it: "lora.rank" is its "rank" under "lora"
    sample: bool = False              # ``python -m diffsynth_mbc.sample`` takes it too (default: the run's)

    @property
    def flag(self) -> str:
        return f"--{self.name}"

    @property
    def default_said(self) -> str:
        """``default 704``, ``default true``, ``default q,k,v``; a default of None: ``default: `` and what it means."""
        if self.switch:
            return "default off"
        if self.default is None or isinstance(self.default, ListValue) and self.default.text is None:
            return f"default: {self.unset}"
        return f"default {said(self.default)}"

    def help_text(self, default_said: str | None = None) -> str:
        """The help, ending with the default (``default_said``: said otherwise) and what ``none`` does."""
        return f"{self.help} ({default_said or self.default_said}" + (f"; {NONE_CLEARS})" if self.optional else ")")

    @property
    def reader(self) -> Callable | None:
        """The flag's text (or a preset's value) -> the value; ``none`` -> None for an optional one. None: text."""
        parse = str if self.listed else self.parse
        if not self.optional:
            return parse

        def read(text):
            return None if str(text).strip().lower() == "none" else (parse or str)(text)

        read.__name__ = (parse or str).__name__   # errors still say "invalid int value", "cannot read ... as float"
        return read

    def typed(self, value):
        """A list option's ListValue from its text (None: unset); a value already typed as it is. OptionsError naming
        the flag and the value."""
        if isinstance(value, ListValue):
            return value
        try:
            return ListValue(self.listed(value), value)
        except OptionsError:   # it names the flag itself
            raise
        except ValueError as exc:
            raise OptionsError(f"{self.flag} {exc}, got {quoted(value)}") from None

    def recorded(self, value):
        """The value as a preset, ``run_options.json`` and a checkpoint's fingerprint hold it (a list option: text)."""
        return value.text if isinstance(value, ListValue) else value


def said(value) -> str:
    """A default as the help says it."""
    if isinstance(value, ListValue):
        return str(value.text)
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return f"{value:g}"
    return "empty" if value == "" else str(value)


def option(group: str, default, help: str, *, at_least=None, above=None, at_most=None, below=None,
           listed: Callable | None = None, **declared):
    """The ``TrainOptions`` field of one option: ``default`` (a list option: its text), its help (without the
    default: that is added), its group (``GROUPS``), and any of ``Declaration``'s other fields; a range as
    ``at_least``/``above`` and ``at_most``/``below``."""
    low = at_least if at_least is not None else above
    high = at_most if at_most is not None else below
    metadata = {"group": group, "help": help, "listed": listed, "low": low, "low_included": above is None,
                "high": high, "high_included": below is None, **declared}
    if listed is not None:
        default = ListValue(listed(default), default)
    return dataclasses.field(default=default, metadata={"option": metadata})


def declared(options_class) -> dict[str, Declaration]:
    """Every option of ``options_class`` (a dataclass of ``option`` fields) by name, in the order declared."""
    return {field.name: Declaration(name=field.name, default=field.default, **field.metadata["option"])
            for field in dataclasses.fields(options_class)}
