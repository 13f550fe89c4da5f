"""Guards against training on garbage: too many undecodable files; steps with an inf/NaN loss or gradient norm.

Pure logic (no torch). Bad media: each undecodable file is replaced by the next row and counted over
all ranks; past ``--max_bad_media_fraction`` the run stops. Non-finite steps: at the end of each
optimizer step the loop asks every rank whether its losses were finite (one small all-reduce, so all
ranks skip together) and looks at the gradient norm, the same on every rank once gradients are
averaged; a skipped step discards its gradients. Under fp16 a step whose gradients overflow is skipped by
the loss scaler, which then lowers the scale; a few in a row at the start are normal while it settles. A forward
that overflows is another matter: fp16 ends at 65,504, a DiT's residual stream carries a few channels of very large
activations, and with the stream in fp16 (``--fp32_residual off``) every forward gives inf/NaN; the guard keeps the
largest residual magnitude the blocks wrote (``note_residual``) and its advice names the fp32 residual stream.
"""

from __future__ import annotations

import math

from diffsynth_mbc import environment
from diffsynth_mbc.values import finite_number

BAD_MEDIA_ALLOWANCE = 10  # bad files tolerated before --max_bad_media_fraction applies


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


class NonFiniteError(RuntimeError):
    """Too many optimizer steps in a row had a non-finite loss or gradient norm."""


def is_finite(value) -> bool:
    return value is None or finite_number(value) is not None


class NonFiniteGuard:
    def __init__(self, max_in_a_row: int, precision: str, fp32_residual: bool = False):
        self.max_in_a_row = max_in_a_row
        self.precision = precision
        self.fp32_residual = fp32_residual   # the DiT's residual stream in fp32 (training/step/fp32_residual.py)
        self.total = 0
        self.in_a_row = 0
        self.first_of_run: int | None = None
        self.largest_residual: float | None = None   # the largest residual magnitude seen; inf/NaN once one overflowed

    def note_residual(self, value: float | None) -> None:
        """A step's largest residual magnitude (``BlockRunner.take_largest_residual``), kept when it is the run's
        largest; a non-finite one is kept for good (the stream overflowed)."""
        if value is None or (self.largest_residual is not None and not math.isfinite(self.largest_residual)):
            return
        if self.largest_residual is None or not math.isfinite(value) or value > self.largest_residual:
            self.largest_residual = value

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
            remedy.insert(0, self.fp16_advice())
            remedy.append("use --mixed_precision bf16 on a GPU with native bf16, or fp32 (fp16 overflows where "
                          "activations exceed 65,504)")
        elif precision == "bf16":
            remedy.append("try --mixed_precision fp32 to rule out precision")
        remedy.append("then continue from the last good checkpoint with --resume latest")
        return (f"steps {self.first_of_run}-{step}: {self.in_a_row} optimizer steps in a row had a non-finite "
                f"{what} ({loss!r} loss, {grad_norm!r} gradient norm) under {precision}; each was skipped, and the "
                f"run stops here instead of training on garbage ({self.total} non-finite steps in all; "
                f"--max_nonfinite_steps {self.max_in_a_row}). Remedies: " + "; ".join(remedy))

    def fp16_advice(self) -> str:
        """What to try first under fp16: the fp32 residual stream, or, with it on, what overflowed instead."""
        seen = self.describe_residual()
        if not self.fp32_residual:
            return (f"the DiT's residual stream is fp16 here (--fp32_residual off; {seen}): a residual channel past "
                    "65,504 turns every forward into inf/NaN, which the loss scaler cannot help (it scales gradients, "
                    "not the forward); --fp32_residual on keeps the time embedding, modulation and residual stream in "
                    "fp32 as Wan2.2's reference does (the default under fp16)")
        return (f"the residual stream is fp32 already (--fp32_residual on; {seen}), so a block's own attention or FFN "
                "output passed 65,504: python -m diffsynth_mbc.doctor --probe 20 shows the largest residual magnitude "
                "on this GPU")

    def describe_residual(self) -> str:
        largest = self.largest_residual
        if largest is None:
            return "no residual magnitude seen yet"
        if not math.isfinite(largest):
            return f"the largest residual magnitude seen: {largest!r}, fp16's limit is 65,504"
        return f"the largest residual magnitude seen: {largest:,.0f}, fp16's limit is 65,504"

    def status_fields(self) -> dict:
        return {"nonfinite_steps": self.total, "nonfinite_in_a_row": self.in_a_row}

    def residual_fields(self) -> dict:
        """``largest_residual`` for the status file: a number, or "inf"/"nan" once the stream overflowed (JSON has
        neither); nothing before a block ran."""
        largest = self.largest_residual
        if largest is None:
            return {}
        return {"largest_residual": round(largest, 1) if math.isfinite(largest) else repr(largest)}




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
