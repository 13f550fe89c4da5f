"""The best LoRA and ``--early_stop N``, one component (``BestLora``): which validation is a new best (its LoRA is kept
as ``lora-best.safetensors``, written as every LoRA file is, with its EMA twin when there is an EMA, and said in the
status file's ``best``), where the early stop's count stands after each validation, and when the run has had N
validations in a row without improving (every rank then ends the run at the same step: the validation's loss is
every rank's, so they decide alike). Pure: no torch.

The headline ``val_loss`` decides (the EMA's under ``--validate_with ema``). A new best is any finite validation lower
than every earlier one: a NaN or infinite one (a LoRA blown up, fp16 overflowing) is never the best, never the loss the
count is reset at, and, once the count runs, a validation without an improvement. An improvement, for the early stop,
is a validation at least ``min_delta`` (relative) below the loss the count was last reset at: a run creeping down by
less than that is not learning anything a clip would show (docs/training.md, Best LoRA and early stop), so a new best
by less still counts, and each validation line says so (``standing_text``). The first validation sets that loss and
counts for nothing, and so do validations in the warm-up (``--warmup_steps``), whose loss falls with the learning rate
rising. Under ``--resolution_stages`` the count runs in the final stage only: the validations of earlier stages count
for nothing and set nothing, the final stage's first sets the loss the count starts from, so the early stop never ends
a run before its final size has trained; the best is any stage's, and its record says which stage trained it. The
state goes into every checkpoint (the component's), so a resumed run knows its best and its count."""

from __future__ import annotations

import dataclasses
import os
import sys

from diffsynth_mbc.data.media.stages import final_stage_start
from diffsynth_mbc.run_layout import BEST_LORA
from diffsynth_mbc.training.components.protocol import Component, Decision, Stop, StepContext
from diffsynth_mbc.values import finite_number



@dataclasses.dataclass
class BestSoFar:
    patience: int | None = None       # --early_stop N; None: off
    min_delta: float = 0.0            # --early_stop_min_delta (from_options: the run's)
    warmup_steps: int = 0
    best_step: int | None = None
    best_loss: float | None = None
    best_base: float | None = None    # the base model's loss beside it
    reference: float | None = None    # the loss the count was last reset at
    reference_step: int | None = None
    without: int = 0                  # validations in a row since then without an improvement
    standing: dict | None = None      # where the count stands after the last validation (with --early_stop)
    stage_ends: tuple[int, ...] = ()  # --resolution_stages: the step each stage ends after (stages.boundaries)
    stage_sizes: tuple[str, ...] = ()  # and each stage's size ("64x64x9")

    @classmethod
    def from_options(cls, options, saved: dict | None = None, stage_ends: tuple[int, ...] = (),
                     stage_sizes: tuple[str, ...] = ()) -> "BestSoFar":
        """This run's settings (and stages, when it trains in stages) with a checkpoint's state (``as_dict``), when
        resuming."""
        tracker = cls(patience=options.early_stop, min_delta=options.early_stop_min_delta,
                      warmup_steps=options.warmup_steps, stage_ends=tuple(stage_ends), stage_sizes=tuple(stage_sizes))
        for key in ("best_step", "best_loss", "best_base", "reference", "reference_step", "without"):
            if saved and saved.get(key) is not None:
                setattr(tracker, key, saved[key])
        if tracker.best_loss is not None and finite_number(tracker.best_loss) is None:   # saved by an earlier version
            tracker.best_step = tracker.best_loss = tracker.best_base = None
        if tracker.reference is not None and finite_number(tracker.reference) is None:
            tracker.reference = tracker.reference_step = None
        return tracker

    def as_dict(self) -> dict:
        return {key: getattr(self, key) for key in ("best_step", "best_loss", "best_base", "reference",
                                                    "reference_step", "without")}

    def observe(self, step: int, val_loss: float, base: float | None = None) -> bool:
        """Take the validation of ``step``; whether it is a new best (never when ``val_loss`` is not finite)."""
        finite = finite_number(val_loss) is not None
        new_best = finite and (self.best_loss is None or val_loss < self.best_loss)
        if new_best:
            self.best_step, self.best_loss, self.best_base = step, val_loss, base
        compared_step, compared = self.reference_step, self.reference
        not_counted = self.not_counted(step, finite)
        if not_counted == "earlier stage":
            pass   # neither counted nor the loss the count starts from
        elif not_counted:
            if finite and (not self.reference_in_final_stage or val_loss < self.reference):
                self.reference, self.reference_step, self.without = val_loss, step, 0
        elif finite and val_loss < self.reference * (1 - self.min_delta):
            self.reference, self.reference_step, self.without = val_loss, step, 0
        else:
            self.without += 1
        counted = not not_counted
        self.standing = None if self.patience is None else {
            "step": step, "count": self.without, "patience": self.patience, "min_delta": self.min_delta,
            "not_counted": not_counted, "counts_from_step": max(self.warmup_steps + 1, self.final_stage_from),
            "finite": finite, "compared_with_step": compared_step if counted else None,
            "change": (val_loss - compared) / compared if counted and finite and compared else None,
            "reset": counted and self.reference_step == step, "since_step": self.reference_step}
        return new_best

    @property
    def final_stage_from(self) -> int:
        """The first step of the final stage (1 without stages): the count runs from there."""
        return final_stage_start(self.stage_ends)

    @property
    def reference_in_final_stage(self) -> bool:
        """The loss the count starts from was measured in the final stage (always so without stages)."""
        return self.reference is not None and self.reference_step >= self.final_stage_from

    def not_counted(self, step: int, finite: bool) -> str | None:
        """Why the validation of ``step`` counts for nothing: ``earlier stage`` (before the final stage), ``warm-up``,
        ``first`` (it sets the loss the count starts from), ``no finite one yet``; None when it counts."""
        if step < self.final_stage_from:
            return "earlier stage"
        if step <= self.warmup_steps:
            return "warm-up"
        if not self.reference_in_final_stage:
            return "first" if finite else "no finite one yet"
        return None

    def stage_of(self, step: int) -> dict | None:
        """The stage that trained optimizer step ``step``: ``{"stage", "of", "size", "final"}``; None without
        stages."""
        if len(self.stage_ends) < 2:
            return None
        index = next((i for i, end in enumerate(self.stage_ends) if step <= end), len(self.stage_ends) - 1)
        return {"stage": index + 1, "of": len(self.stage_ends), "size": self.stage_sizes[index],
                "final": index == len(self.stage_ends) - 1}

    @property
    def stop_due(self) -> bool:
        """N validations in a row without an improvement (never with ``--early_stop`` off)."""
        return self.patience is not None and self.without >= self.patience

    def best_record(self, file: str) -> dict | None:
        """The status file's ``best``: step, val_loss, the base's, the gain ((base - best) / base), the file and,
        under ``--resolution_stages``, the stage that trained it."""
        if self.best_step is None:
            return None
        gain = (self.best_base - self.best_loss) / self.best_base if self.best_base else None
        record = {"step": self.best_step, "val_loss": self.best_loss, "val_loss_base": self.best_base, "gain": gain,
                  "file": file}
        stage = self.stage_of(self.best_step)
        return {**record, "stage": stage} if stage else record

    def early_stop_record(self, step: int) -> dict:
        return {"step": step, "best_step": self.best_step, "validations_without_improvement": self.without,
                "since_step": self.reference_step, "since_val_loss": self.reference, "patience": self.patience,
                "min_delta": self.min_delta}


def best_file_note(best: BestSoFar, file: str) -> str:
    """What became of the best LoRA, for the message of a run that fails with a broken LoRA."""
    if best.best_step is None:
        return f"no {BEST_LORA} was written: no validation of this run had a finite val_loss"
    return (f"{file} holds the LoRA of step {best.best_step} (val_loss {best.best_loss:.4f}, the lowest finite "
            "validation), kept")


def percent(share: float) -> str:
    """``0.04%``, ``12%``: two significant digits."""
    return f"{100 * share:.2g}%"


def standing_text(standing: dict) -> str:
    """Where the early stop's count stands after a validation (its line on the terminal):
    ``early stop: 0.04% below step 203's (under the 0.10% that resets the count): 2 of 3``."""
    count, patience, delta = standing["count"], standing["patience"], f"{standing['min_delta']:.2%}"
    reason = standing["not_counted"]
    if reason == "earlier stage":
        return (f"early stop: before the final stage, not counted (the count runs from step "
                f"{standing['counts_from_step']:,})")
    if reason == "warm-up":
        return f"early stop: in the warm-up, not counted (the count runs from step {standing['counts_from_step']:,})"
    if reason == "first":
        return f"early stop: the count starts from this one: 0 of {patience}"
    if reason:
        return "early stop: not finite, not counted (the count starts from the first finite validation)"
    than = f"step {standing['compared_with_step']:,}'s"
    change = standing["change"]
    if change is None:
        text = "not finite, no improvement"
    elif standing["reset"]:
        text = f"{percent(-change)} below {than}, at least the {delta} that resets the count"
    elif change < 0:
        text = f"{percent(-change)} below {than} (under the {delta} that resets the count)"
    else:
        text = f"{percent(change)} above {than}" if change > 0 else f"the same as {than}"
    return f"early stop: {text}: {count} of {patience}" + (", the run stops here" if count >= patience else "")


def early_stop_reason(record: dict) -> str:
    """Why the run stopped early: ``3 validations in a row since step 203 (val_loss 1.2006) without the 0.10%
    improvement that resets the count (--early_stop 3)``; as each validation line counted them."""
    since = record.get("since_val_loss")
    loss = f" (val_loss {since:.4f})" if finite_number(since) is not None else ""
    count = record["validations_without_improvement"]
    return (f"{count} validation{'s' if count != 1 else ''} in a row since step {record['since_step']}"
            f"{loss} without the {record['min_delta']:.2%} improvement that resets the count (--early_stop "
            f"{record['patience']})")


def stopped_early_note(record: dict) -> str:
    """What a resume of an early-stopped run says: why it stopped, that it trains no further, and how to go on."""
    return (f"this run stopped early at step {record['step']}: {early_stop_reason(record)}; nothing more to train. "
            "To go on: a larger --early_stop N, or --early_stop off")


def stage_text(stage: dict | None) -> str:
    """``, stage 1/2 64x64x9, not the final size`` for a best LoRA of a run in stages; nothing without stages."""
    if not stage:
        return ""
    final = "" if stage["final"] else ", not the final size"
    return f", stage {stage['stage']}/{stage['of']} {stage['size']}{final}"


def early_stop_line(record: dict, total_steps: int, best_file: str, stage: dict | None = None) -> str:
    """The launcher's last line of an early-stopped run (``stage``: the one that trained the best LoRA)."""
    return (f"stopped early at step {record['step']} of {total_steps}: {early_stop_reason(record)}; best: "
            f"{best_file} (step {record['best_step']}{stage_text(stage)})")


def standing_note(state: dict) -> str:
    """``; early stop: ...: 2 of 3`` for the terminal's validation line, from a status file's state (where the count
    stands after that validation), so that the lines and the summary agree; '' without ``--early_stop``."""
    return "; " + standing_text(state["early_stop_count"]) if state.get("early_stop_count") else ""


def summary_lines(state: dict) -> list[str]:
    """The run summary's lines of the best LoRA (with the stage that trained it, under ``--resolution_stages``) and,
    as the launcher's last line, why an early stop ended the run before its total."""
    best = state.get("best")
    if not best or not best.get("file"):
        return []
    lines = [f"  best LoRA: {best['file']} (step {best['step']}, val_loss {best['val_loss']:.4f}"
             f"{stage_text(best.get('stage'))})"]
    if state.get("early_stop"):
        lines.append(early_stop_line(state["early_stop"], state.get("total_steps"), best["file"], best.get("stage")))
    return lines


def stopped_note(options, saved: dict | None, step: int) -> str | None:
    """What a resume says of a checkpoint (its component state ``saved``, at ``step``) whose run had stopped early
    under this run's settings: why, and how to go on; None when it had not."""
    best = BestSoFar.from_options(options, saved)
    return stopped_early_note(best.early_stop_record(step)) if best.stop_due else None


def may_end_early(options) -> bool:
    """Whether ``--early_stop`` may end the run before its planned total."""
    return options.early_stop is not None


def plan_line(options, counts_from: int = 1) -> str:
    """What validating does besides measuring, for the plan: keep the best LoRA, and with ``--early_stop`` end the
    run sooner (``it stops after 3 validation(s) in a row without a 0.10% improvement, validating every 2,000
    steps``); ``counts_from``: the final stage's first step under ``--resolution_stages``."""
    every = f"every {options.val_steps:,} steps" if options.val_steps else "at the end"
    if options.early_stop is None:
        return (f"validation {every} keeps the best LoRA ({BEST_LORA}); --early_stop N would end the run "
                "after N validations without improving")
    staged = (f", counted in the final stage only (from step {counts_from:,}: the validations before it count for "
              "nothing)" if counts_from > 1 else "")
    return (f"the run may end early: it stops after {options.early_stop} validation(s) in a row without a "
            f"{options.early_stop_min_delta:.2%} improvement, validating {every}{staged}; the best LoRA is kept "
            f"({BEST_LORA}" + (", with the stage that trained it)" if counts_from > 1 else ")"))


class BestLora(Component):
    """Keeps ``lora-best.safetensors`` at each new lowest validation and ends the run under ``--early_stop``.
    ``save_lora(file_name, step)``: the run's LoRA file writer (every rank calls it; a collective). ``stages``: the
    step each stage ends after and each stage's size, under ``--resolution_stages`` (the count runs in the final
    stage; the best says its stage)."""

    name = "best_lora"

    def __init__(self, options, status, save_lora, is_main: bool, stage_ends=(), stage_sizes=()):
        self.options, self.status, self.save_lora, self.is_main = options, status, save_lora, is_main
        self.stages = (tuple(stage_ends), tuple(stage_sizes))
        self.best = BestSoFar.from_options(options, None, *self.stages)
        self.file = os.path.join(options.output_path, BEST_LORA)

    def at_start(self, context: StepContext) -> Decision | None:
        """A resumed run says its best; one that had already stopped early (its count at N or more) trains no
        further, and rank 0 says how to go on."""
        record = self.best.best_record(self.file)
        if record:
            self.status.update(best=record)
        if not self.best.stop_due:
            return None
        if self.is_main:
            print(stopped_early_note(self.best.early_stop_record(context.step)), file=sys.stderr)
        return Decision(stop=Stop.EARLY)

    def after_validation(self, context: StepContext) -> Decision | None:
        validation = context.validation
        new_best = self.best.observe(context.step, validation.val_loss, validation.fields.get("val_loss_base"))
        validation.fields["early_stop_count"] = self.best.standing   # where the count stands: the status file's
        if new_best:
            validation.mark(new_best=True)
            self.save_lora(BEST_LORA, context.step)
            self.status.update(best=self.best.best_record(self.file))
        return Decision(stop=Stop.EARLY) if self.best.stop_due else None

    def at_end(self, context: StepContext) -> None:
        if context.stop is Stop.EARLY:   # the run's summary ends with it (``early_stop_line``)
            self.status.update(early_stop=self.best.early_stop_record(context.step))

    def failure_note(self, error: BaseException) -> str | None:
        """A run failing with a broken LoRA says what became of ``lora-best.safetensors``."""
        return f"Best LoRA: {best_file_note(self.best, self.file)}"

    def state_dict(self) -> dict:
        return self.best.as_dict()

    def load_state_dict(self, state: dict) -> None:
        self.best = BestSoFar.from_options(self.options, state, *self.stages)
