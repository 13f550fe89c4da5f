"""Guards against training on garbage: too many undecodable files; steps with an inf/NaN loss or gradient norm.

Pure logic (no torch), each a component (``protocol.py``). Bad media: each undecodable file is replaced by the next
row and counted over all ranks (the step's agreement sums every rank's); past ``--max_bad_media_fraction`` the run
stops, and a run whose missing files alone would go past it is refused before its first step
(``missing_media_refusal``). Non-finite steps: at the end of each optimizer step every rank learns whether any rank's
losses were finite (one small all-reduce in the step, so all ranks skip together) and looks at the gradient norm, the
same on every rank once gradients are averaged; a skipped step discards its gradients. Under fp16 a step whose
gradients overflow is skipped by the loss scaler, which then lowers the scale; a few in a row at the start are normal
while it settles. A forward that overflows is another matter: fp16 ends at 65,504, a DiT's residual stream carries a
few channels of very large activations, and with the stream in fp16 (``--fp32_residual off``) every forward gives
inf/NaN; the guard keeps the largest residual magnitude the blocks wrote (``note_residual``) and its advice names the
fp32 residual stream.
"""

from __future__ import annotations

import math

from diffsynth_mbc.training.components.protocol import Component, StepContext, StepResult
from diffsynth_mbc.values import finite_number

BAD_MEDIA_ALLOWANCE = 10  # bad files tolerated before --max_bad_media_fraction applies
RECENT_SKIPS_SHOWN = 5    # the bad files a rank's status file names (its newest)
MISSING_ROWS_NAMED = 5    # rows named when missing files refuse a run


class TooMuchBadMedia(RuntimeError):
    pass


class BadMediaGuard(Component):
    """Counts undecodable files over all ranks; past the limit the run stops instead of training on what is left.
    Each rank keeps its own count and newest bad files (its status file says them; a checkpoint keeps them)."""

    name = "bad_media"
    per_rank = True

    def __init__(self, max_fraction: float, status=None, accelerator=None):
        self.max_fraction = max_fraction
        self.status, self.accelerator = status, accelerator
        self.bad_total = 0          # every rank's, since this process started
        self.seen_total = 0
        self.skipped_samples = 0    # this rank's, over the whole run
        self.recent_skips: list[dict] = []
        self.replaced: dict = {}    # this rank's bad files: metadata row -> [file, times replaced] (the summary's)

    def votes(self, result: StepResult) -> dict[str, int]:
        return {"bad_media": len(result.bad_media), "samples": result.samples}

    def at_start(self, context: StepContext) -> None:
        self.status.update(skipped_samples=self.skipped_samples, skip_reasons=self.recent_skips)

    def after_step(self, context: StepContext) -> None:
        bad = context.result.bad_media
        if bad:
            for skip in bad:
                count_replaced(self.replaced, skip)
            self.skipped_samples += len(bad)
            self.recent_skips = (self.recent_skips + bad)[-RECENT_SKIPS_SHOWN:]
            self.status.update(skipped_samples=self.skipped_samples, skip_reasons=self.recent_skips)
        self.account(context.agreed["bad_media"], context.agreed["samples"])

    def after_training(self, context: StepContext) -> None:
        """Rank 0's status gets ``replaced_media``: what every rank replaced (a collective), for the summary."""
        from diffsynth_mbc.training.distributed.collectives import gather_from_all
        from diffsynth_mbc.training.reporting.run_summary import replaced_media

        said = gather_from_all(self.accelerator, (context.samples_seen, self.skipped_samples, self.replaced),
                               self.status, "ranks counting the media they replaced")
        if self.accelerator.is_main_process:
            self.status.update(replaced_media=replaced_media(said))

    def account(self, bad: int, seen: int) -> None:
        self.bad_total += bad
        self.seen_total += seen
        if self.bad_total > max(BAD_MEDIA_ALLOWANCE, self.max_fraction * self.seen_total):
            last = self.recent_skips[-1]["reason"] if self.recent_skips else "(on another rank)"
            raise TooMuchBadMedia(
                f"{self.bad_total} of {self.seen_total} samples so far could not be decoded "
                f"({100 * self.bad_total / max(1, self.seen_total):.1f}% > {100 * self.max_fraction:g}%); "
                f"stopping instead of training on what is left. Last: {last}. Check the files, re-run the "
                "converter with --probe, or raise --max_bad_media_fraction.")

    def state_dict(self) -> dict:
        return {"skipped_samples": self.skipped_samples, "recent_skips": self.recent_skips, "replaced": self.replaced}

    def load_state_dict(self, state: dict) -> None:
        self.skipped_samples = int(state.get("skipped_samples") or 0)
        self.recent_skips = list(state.get("recent_skips") or [])
        self.replaced = dict(state.get("replaced") or {})

    def take_over(self, state: dict) -> None:
        """A rank that is gone after a resume on fewer processes: its bad files count as this rank's."""
        self.skipped_samples += int(state.get("skipped_samples") or 0)
        self.recent_skips = (self.recent_skips + list(state.get("recent_skips") or []))[-RECENT_SKIPS_SHOWN:]
        for row, (file, times) in (state.get("replaced") or {}).items():
            self.replaced.setdefault(row, [file, 0])[1] += times


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


class NonFiniteGuard(Component):
    """Counts the steps skipped as non-finite; ``--max_nonfinite_steps`` of them in a row stop the run.
    ``largest_residual()``: the largest residual magnitude the DiT's blocks wrote since it was last asked
    (``BlockRunner.take_largest_residual``)."""

    name = "nonfinite"

    def __init__(self, max_in_a_row: int, precision: str, status=None, fp32_residual: bool = False,
                 largest_residual=None):
        self.max_in_a_row = max_in_a_row
        self.precision = precision
        self.status = status
        self.total = 0
        self.in_a_row = 0
        self.first_of_run: int | None = None
        self.fp32_residual = fp32_residual   # the DiT's residual stream in fp32 (training/step/fp32_residual.py)
        self.largest_residual: float | None = None   # the largest residual magnitude seen; inf/NaN once one overflowed
        self.take_largest_residual = largest_residual

    def after_step(self, context: StepContext) -> None:
        result = context.result
        if self.take_largest_residual is not None:
            self.note_residual(self.take_largest_residual())
        if self.check(context.step, result.loss, result.grad_norm, result.skipped) or self.total:
            self.status.update(nonfinite_steps=self.total, nonfinite_in_a_row=self.in_a_row)
        self.status.update(**self.residual_fields())

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

    def residual_fields(self) -> dict:
        """``largest_residual`` for the status file: a number, or "inf"/"nan" once the stream overflowed (JSON has
        neither); nothing before a block ran."""
        largest = self.largest_residual
        if largest is None:
            return {}
        return {"largest_residual": round(largest, 1) if math.isfinite(largest) else repr(largest)}
