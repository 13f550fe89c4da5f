"""Guards against training on garbage: too many undecodable files; steps with an inf/NaN loss or gradient norm.

Pure logic (no torch). Bad media: each undecodable file is replaced by the next row and counted over
all ranks; past ``--max_bad_media_fraction`` the run stops, and a run whose missing files alone would go past it
is refused before its first step (``missing_media_refusal``). Non-finite steps: at the end of each
optimizer step the loop asks every rank whether its losses were finite (one small all-reduce, so all
ranks skip together) and looks at the gradient norm, the same on every rank once gradients are
averaged; a skipped step discards its gradients. Under fp16 a step whose gradients overflow is skipped by
the loss scaler, which then lowers the scale; a few in a row at the start are normal while it settles.
"""

from __future__ import annotations

import math

from diffsynth_mbc import environment
from diffsynth_mbc.values import finite_number

BAD_MEDIA_ALLOWANCE = 10  # bad files tolerated before --max_bad_media_fraction applies
MISSING_ROWS_NAMED = 5    # rows named when missing files refuse a run


class TooMuchBadMedia(RuntimeError):
    pass


class BadMediaGuard:
    """Counts undecodable files over all ranks; past the limit the run stops instead of training on what is left."""

    def __init__(self, max_fraction: float):
        self.max_fraction = max_fraction
        self.bad_total = 0
        self.seen_total = 0

    def account(self, bad: int, seen: int, recent_skips: list) -> None:
        self.bad_total += bad
        self.seen_total += seen
        if self.bad_total > max(BAD_MEDIA_ALLOWANCE, self.max_fraction * self.seen_total):
            last = recent_skips[-1]["reason"] if recent_skips else "(on another rank)"
            raise TooMuchBadMedia(
                f"{self.bad_total} of {self.seen_total} samples so far could not be decoded "
                f"({100 * self.bad_total / max(1, self.seen_total):.1f}% > {100 * self.max_fraction:g}%); "
                f"stopping instead of training on what is left. Last: {last}. Check the files, re-run the "
                "converter with --probe, or raise --max_bad_media_fraction.")


def missing_media_refusal(missing: list[tuple[int, str]], draws: list[int], draws_to_come: int,
                          max_fraction: float) -> str | None:
    """Why a run whose missing files alone would stop it part-way (``TooMuchBadMedia``) is refused before its first
    step; None when they would not. ``missing``: (1-based metadata row, file) of each row whose file is not there;
    ``draws``: each row's samples per epoch (its repeats); ``draws_to_come``: the samples the run has still to draw.
    Each draw of a missing row is one bad file more, and its replacement one sample more, as ``account`` counts."""
    per_epoch = sum(draws)
    missing_draws = sum(draws[number - 1] for number, _ in missing)
    if not missing_draws or not per_epoch:
        return None
    share = missing_draws / per_epoch
    bad = share * draws_to_come
    if bad <= max(BAD_MEDIA_ALLOWANCE, max_fraction * (draws_to_come + bad)):
        return None
    named = "; ".join(f"row {number}: {file}" for number, file in missing[:MISSING_ROWS_NAMED])
    more = f"; and {len(missing) - MISSING_ROWS_NAMED:,} more" if len(missing) > MISSING_ROWS_NAMED else ""
    return (f"{len(missing):,} of {len(draws):,} metadata rows' files are not found ({named}{more}): "
            f"{missing_draws:,} of each epoch's {per_epoch:,} samples ({100 * share:.1f}%), past "
            f"--max_bad_media_fraction {max_fraction:g}, so the run would replace about {bad:,.0f} of the "
            f"{draws_to_come:,} samples it has still to draw and stop part-way. Put the files back, leave their rows "
            f"out of the metadata (python -m diffsynth_mbc.convert leaves out rows whose file is missing), or raise "
            f"--max_bad_media_fraction to {_rounded_up(share)}")


def _rounded_up(share: float) -> str:
    """``share`` rounded up to 3 significant digits: a limit the share is not past."""
    digits = 3 - int(math.floor(math.log10(share))) - 1
    return f"{math.ceil(share * 10 ** digits) / 10 ** digits:g}"


def count_replaced(replaced: dict, skip: dict) -> None:
    """One more replacement of the bad file ``skip`` (the dataset's record: its metadata row, file and reason) in
    ``replaced``: metadata row (as text, as JSON keeps it) -> [file, times]."""
    entry = replaced.setdefault(str(skip["row"]), [skip["file"], 0])
    entry[1] += 1


class NonFiniteError(RuntimeError):
    """Too many optimizer steps in a row had a non-finite loss or gradient norm."""


def is_finite(value) -> bool:
    return value is None or finite_number(value) is not None


class NonFiniteGuard:
    def __init__(self, max_in_a_row: int, precision: str):
        self.max_in_a_row = max_in_a_row
        self.precision = precision
        self.total = 0
        self.in_a_row = 0
        self.first_of_run: int | None = None

    def check(self, step: int, loss, grad_norm, skipped: bool | None = None) -> bool:
        """True when step ``step`` was non-finite (and so skipped); raises after too many in a row.

        ``skipped`` is the loop's decision, the same on every rank (another rank's loss may have been the
        non-finite one); without it the step's own loss and gradient norm decide.
        """
        if skipped is None:
            skipped = not (is_finite(loss) and is_finite(grad_norm))
        if not skipped:
            self.in_a_row = 0
            return False
        self.total += 1
        self.in_a_row += 1
        if self.in_a_row == 1:
            self.first_of_run = step
        if self.in_a_row >= self.max_in_a_row:
            raise NonFiniteError(self.message(step, loss, grad_norm))
        return True

    def message(self, step: int, loss, grad_norm) -> str:
        what = "loss" if not is_finite(loss) else "gradient norm"
        precision = {"no": "fp32"}.get(self.precision, self.precision)
        remedy = ["lower --learning_rate", "keep --max_grad_norm above 0"]
        if precision == "fp16":
            remedy.append("use --mixed_precision bf16 on a GPU with native bf16, or fp32 (fp16 overflows where "
                          "activations exceed 65,504)")
        elif precision == "bf16":
            remedy.append("try --mixed_precision fp32 to rule out precision")
        remedy.append("then continue from the last good checkpoint with --resume latest")
        return (f"steps {self.first_of_run}-{step}: {self.in_a_row} optimizer steps in a row had a non-finite "
                f"{what} ({loss!r} loss, {grad_norm!r} gradient norm) under {precision}; each was skipped, and the "
                f"run stops here instead of training on garbage ({self.total} non-finite steps in all; "
                f"--max_nonfinite_steps {self.max_in_a_row}). Remedies: " + "; ".join(remedy))

    def status_fields(self) -> dict:
        return {"nonfinite_steps": self.total, "nonfinite_in_a_row": self.in_a_row}




def injected_steps(environ, rank: int) -> frozenset[int]:
    """Fault injection for tests: ``MBC_FAULT_NONFINITE_LOSS=RANK:STEP,STEP,...`` makes that rank's loss NaN
    at those optimizer steps (1-based), to show the guard on a real run. Unset in normal use."""
    value = environ.get(environment.FAULT_NONFINITE_LOSS, "")
    if not value:
        return frozenset()
    who, _, steps = value.partition(":")
    if int(who) != rank:
        return frozenset()
    return frozenset(int(step) for step in steps.split(",") if step.strip())
