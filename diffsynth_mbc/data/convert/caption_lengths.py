"""Captions longer than the text encoder reads: DiffSynth's Wan prompter pads and truncates every prompt to
512 tokens (``WanPrompter(text_len=512)``), so the rest of a longer caption is silently never seen.

With the release's tokenizer folder (``google/umt5-xxl``, ``convert --tokenizer``) tokens are counted as the
prompter counts them: its cleaning (``basic_clean`` then ``whitespace_clean``) and the tokenizer with its
special tokens. Without it the count is an estimate that errs towards flagging: one token per character of
the whitespace-cleaned caption, plus 2 (a word-start piece and the end token). UMT5's SentencePiece pieces
are one character or longer, so only characters outside its vocabulary could make the real count higher.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Sequence

TEXT_TOKENS = 512   # DiffSynth 1.1.8's WanPrompter text_len: what the text encoder reads of a prompt
ESTIMATE_METHOD = ("estimate (one token per character after whitespace cleaning, plus 2; an over-count "
                   "except for characters outside the tokenizer's vocabulary); --tokenizer counts exactly")


class TokenizerError(Exception):
    """The tokenizer folder given cannot be loaded; the message names it."""


@dataclass
class LongCaptions:
    limit: int
    method: str   # how tokens were counted
    rows: dict[str, list[int]] = field(default_factory=dict)   # catalogue -> rows over the limit
    longest: int = 0   # the most tokens of any caption counted

    @property
    def count(self) -> int:
        return sum(len(rows) for rows in self.rows.values())

    def summary(self) -> dict:
        return {"token_limit": self.limit, "counted_by": self.method, "over_limit": self.count,
                "longest": self.longest, "over_limit_rows": self.rows}

    def message(self) -> str | None:
        """The warning to print, or None when no caption is too long."""
        if not self.count:
            return None
        where = "; ".join(f"{name} rows {', '.join(map(str, rows[:10]))}{', ...' if len(rows) > 10 else ''}"
                          for name, rows in self.rows.items() if rows)
        exact = self.method.startswith("tokenizer")
        return (f"{self.count} captions {'are' if exact else 'may be'} longer than the text encoder's {self.limit} "
                f"tokens and will be cut there ({where}; all in summary.json). Tokens counted by {self.method}.")


def estimated_tokens(caption: str) -> int:
    """The conservative estimate: characters of the whitespace-cleaned caption, plus 2."""
    return len(" ".join(caption.split())) + 2


def exact_counter(tokenizer_dir: str):
    """captions -> token counts, as DiffSynth's Wan prompter tokenizes them; TokenizerError when it cannot load."""
    if not os.path.isdir(tokenizer_dir):
        raise TokenizerError(f"--tokenizer {tokenizer_dir}: not a folder (the release's google/umt5-xxl)")
    try:
        from diffsynth.prompters.wan_prompter import basic_clean, whitespace_clean
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir, local_files_only=True)
    except Exception as error:   # any loader failure: name the folder and what went wrong
        raise TokenizerError(f"--tokenizer {tokenizer_dir}: cannot load a tokenizer there "
                             f"({type(error).__name__}: {error})") from None

    def count(captions: Sequence[str]) -> list[int]:
        cleaned = [whitespace_clean(basic_clean(caption)) for caption in captions]
        return [len(ids) for ids in tokenizer(cleaned, add_special_tokens=True)["input_ids"]]
    return count


def long_captions(rows: Sequence[tuple[str, int, str]], tokenizer_dir: str | None = None,
                  limit: int = TEXT_TOKENS) -> LongCaptions:
    """The (catalogue, row, caption) rows whose captions are over ``limit`` tokens."""
    if tokenizer_dir is None:
        method, counts = ESTIMATE_METHOD, [estimated_tokens(caption) for _, _, caption in rows]
    else:
        method = f"tokenizer in {tokenizer_dir} (DiffSynth's prompter cleaning)"
        counts = exact_counter(tokenizer_dir)([caption for _, _, caption in rows]) if rows else []
    result = LongCaptions(limit, method, longest=max(counts, default=0))
    for (name, row, _), tokens in zip(rows, counts):
        if tokens > limit:
            result.rows.setdefault(name, []).append(row)
    return result
