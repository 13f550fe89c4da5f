"""One spelling for every command's flags, and one line for a flag that does not exist. No torch.

Every ``python -m diffsynth_mbc.X`` builds its parser with :class:`FlagParser`. A long flag is shown with
underscores, as DiffSynth's own training scripts spell theirs (``--learning_rate``, ``--base_path``); the
same flag with dashes (``--learning-rate``, ``--base-path``) is accepted too and left out of ``--help``.
Flags are never matched by prefix: ``--num_epoch`` is not silently taken for ``--num_epochs``, it is
refused with a suggestion, so a typo never changes which setting a flag sets.

A flag nobody knows prints one line instead of the whole usage::

    error: unknown flag --lr: did you mean --learning_rate? (full list: python -m diffsynth_mbc.train --help)
"""

from __future__ import annotations

import argparse
import difflib
import re
import sys
from typing import Callable, Iterable, Sequence

# Names people bring from other trainers, and the flag they mean here.
COMMON_ABBREVIATIONS = {
    "lr": "learning_rate", "epochs": "num_epochs", "epoch": "num_epochs", "n_epochs": "num_epochs",
    "bs": "batch_size", "wd": "weight_decay", "grad_accum": "gradient_accumulation_steps",
    "accumulation_steps": "gradient_accumulation_steps", "rank": "lora_rank", "alpha": "lora_alpha",
    "frames": "num_frames", "workers": "dataset_num_workers", "num_workers": "dataset_num_workers",
    "output_dir": "output_path", "warmup": "warmup_steps", "clip_grad_norm": "max_grad_norm",
}
MAX_SUGGESTIONS = 3


def canonical(flag: str) -> str:
    """``--base-path`` -> ``--base_path``; short flags (``-h``) as they are."""
    return "--" + flag[2:].replace("-", "_") if flag.startswith("--") else flag


def dashed(flag: str) -> str:
    """``--base_path`` -> ``--base-path``: the spelling accepted beside the canonical one."""
    return "--" + flag[2:].replace("_", "-") if flag.startswith("--") else flag


def _key(flag: str) -> str:
    return flag.lstrip("-").lower().replace("-", "_")


NEGATIVE_NUMBER = re.compile(r"^-(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?$|^-(inf|infinity|nan)$", re.IGNORECASE)


class FlagParser(argparse.ArgumentParser):
    """An ArgumentParser whose flags have one shown spelling (underscores) and one hidden (dashes).

    ``passes_on_to``: a function returning the parser that reads the flags this one leaves over
    (``parse_known_args``), e.g. the doctor's and the plan's training flags: a flag neither knows is
    refused here, with suggestions from both.
    """

    def __init__(self, *args, passes_on_to: Callable[[], argparse.ArgumentParser] | None = None, **kwargs):
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)
        self.passes_on_to = passes_on_to
        # A value such as -inf, -1e3 or -nan is a (negative) number for the flag before it, as -5 is to argparse,
        # so that the flag's own check refuses it by name instead of argparse's "expected one argument".
        self._negative_number_matcher = NEGATIVE_NUMBER

    def spell(self) -> None:
        """Show each long flag with underscores; accept its dashed spelling too. Idempotent."""
        for action in self._actions:
            spellings = list(action.option_strings)
            action.option_strings = list(dict.fromkeys(canonical(flag) for flag in spellings))
            for flag in spellings:
                for form in (canonical(flag), dashed(flag)):
                    self._option_string_actions.setdefault(form, action)
            if isinstance(action, argparse._SubParsersAction):
                for sub in action.choices.values():
                    if isinstance(sub, FlagParser):
                        sub.spell()

    def format_usage(self) -> str:
        self.spell()
        return super().format_usage()

    def format_help(self) -> str:
        self.spell()
        return super().format_help()

    def parse_known_args(self, args=None, namespace=None):
        self.spell()
        self._given = list(sys.argv[1:] if args is None else args)
        parsed, extras = super().parse_known_args(args, namespace)
        line = self._unknown_line(extras) if self.passes_on_to is not None else None
        if line:
            self.exit(2, f"error: {line}\n")
        return parsed, extras

    def _unknown_line(self, tokens) -> str | None:
        if self.passes_on_to is None:
            return unknown_flag_line(tokens, [self], full_list=f"{self.prog} --help")
        receiver = self.passes_on_to()
        return unknown_flag_line(tokens, [self, receiver], full_list=f"{self.prog} --help; {receiver.prog} --help")

    def parse_args(self, args=None, namespace=None):
        parsed, extras = self.parse_known_args(args, namespace)
        if extras:
            line = self._unknown_line(extras)
            self.exit(2, f"error: {line or 'unexpected argument(s): ' + ' '.join(extras)}\n")
        return parsed

    def error(self, message):
        """One line, not the whole usage (which is 50 lines for the training). A mistyped flag is named first:
        it is usually why a required one is 'missing' (--base_pth DIR)."""
        line = self._unknown_line(getattr(self, "_given", []))
        self.exit(2, f"error: {line or f'{message} (usage: {self.prog} --help)'}\n")


def flags_of(parser: argparse.ArgumentParser) -> dict[str, bool]:
    """The flags a user may be pointed to: canonical long flag -> whether it takes a value; subcommands' too."""
    flags = {}
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                flags.update(flags_of(sub))
        if action.help == argparse.SUPPRESS:
            continue
        for flag in action.option_strings:
            if flag.startswith("--"):
                flags[canonical(flag)] = action.nargs != 0
    return flags


def _known(flag: str, parsers: Sequence[argparse.ArgumentParser], names: Iterable[str]) -> bool:
    name = flag.split("=", 1)[0]
    return (any(name in parser._option_string_actions or canonical(name) in parser._option_string_actions
                for parser in parsers)
            or canonical(name) in {canonical(n) for n in names})


def _looks_like_flag(token: str) -> bool:
    if not token.startswith("-") or token in ("-", "--"):
        return False
    try:
        float(token)
        return False   # a negative number is a value
    except ValueError:
        return True


def unknown_flag_line(tokens: Sequence[str], parsers: Sequence[argparse.ArgumentParser], *,
                      also: Iterable[str] = (), full_list: str) -> str | None:
    """``unknown flag --lr: did you mean --learning_rate? (full list: ...)`` for the first flag in ``tokens``
    that none of ``parsers`` (nor the names in ``also``) knows; None when every flag is known."""
    also = list(also)
    for parser in parsers:
        if isinstance(parser, FlagParser):
            parser.spell()
    unknown = [token.split("=", 1)[0] for token in tokens
               if _looks_like_flag(token) and not _known(token, parsers, also)]
    if not unknown:
        return None
    candidates = {canonical(name): True for name in also}
    for parser in parsers:
        candidates.update(flags_of(parser))
    line = f"unknown flag {unknown[0]}"
    suggestions = suggest(unknown[0], candidates)
    if suggestions:
        line += ": did you mean " + (suggestions[0] if len(suggestions) == 1 else
                                     ", ".join(suggestions[:-1]) + " or " + suggestions[-1]) + "?"
    more = list(dict.fromkeys(unknown[1:]))
    if more:
        line += f" (also unknown: {', '.join(more)})"
    return f"{line} (full list: {full_list})"


def suggest(flag: str, candidates: dict[str, bool]) -> list[str]:
    """The closest real flags to ``flag``, best first: a known abbreviation (--lr), a flag with its value
    glued on (--resume-latest: --resume latest), words that begin the real ones (--num_epoch, --grad_accum_steps),
    initials (--bs), then spelling (difflib); across - and _."""
    typed, keys = _key(flag), {_key(name): name for name in candidates}
    first = []
    if COMMON_ABBREVIATIONS.get(typed) in keys:
        first.append(keys[COMMON_ABBREVIATIONS[typed]])
    glued = flag.lstrip("-")
    for key, name in keys.items():
        rest = glued[len(key) + 1:]
        if candidates[name] and typed.startswith(key + "_") and rest and "_" not in rest and "-" not in rest:
            first.append(f"{name} {rest}")
    if first:
        return first[:MAX_SUGGESTIONS]
    words = typed.split("_")
    by_words = [name for key, name in keys.items() if _words_begin(words, key.split("_")) or key.startswith(typed)]
    if by_words:
        return sorted(by_words, key=len)[:MAX_SUGGESTIONS]
    initials = [name for key, name in keys.items() if len(typed) >= 2 and "".join(w[:1] for w in key.split("_")) == typed]
    if initials:
        return initials[:MAX_SUGGESTIONS]
    return [keys[key] for key in difflib.get_close_matches(typed, list(keys), n=MAX_SUGGESTIONS, cutoff=0.6)]


def _words_begin(typed: list[str], real: list[str]) -> bool:
    return len(typed) == len(real) and typed != real and all(r.startswith(t) for t, r in zip(typed, real) if t)
