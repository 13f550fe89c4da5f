"""The best LoRA and ``--early_stop N``, one component: which validation is a new best (its LoRA is kept as
``lora-best.safetensors``, written as every LoRA file is, with its EMA twin when there is an EMA, and said in the
status file's ``best``) and when the run has had N validations in a row without improving (every rank then ends
the run at the same step: the validation's loss is every rank's, so they decide alike). Pure: no torch.

The headline ``val_loss`` decides (the EMA's under ``--validate_with ema``). A new best is any validation lower than
every earlier one. An improvement, for the early stop, is a validation at least ``min_delta`` (relative) below the
loss the count was last reset at: a run creeping down by less than that is not learning anything a clip would show
(docs/training.md, Best LoRA and early stop). The first validation sets that loss and counts for nothing, and so do
validations in the warm-up (``--warmup_steps``), whose loss falls with the learning rate rising. The state goes into
every checkpoint (the component's state), so a resumed run knows its best and its count."""

from __future__ import annotations

import dataclasses
import os
import sys

from diffsynth_mbc.training.components.protocol import Component, Decision, Stop, StepContext

BEST_FILE = "lora-best.safetensors"
DEFAULT_MIN_DELTA = 0.001


@dataclasses.dataclass
class BestSoFar:
    patience: int | None = None       # --early_stop N; None: off
    min_delta: float = DEFAULT_MIN_DELTA
    warmup_steps: int = 0
    best_step: int | None = None
    best_loss: float | None = None
    best_base: float | None = None    # the base model's loss beside it
    reference: float | None = None    # the loss the count was last reset at
    reference_step: int | None = None
    without: int = 0                  # validations in a row since then without an improvement

    @classmethod
    def from_options(cls, options, saved: dict | None = None) -> "BestSoFar":
        """This run's settings with a checkpoint's state (``as_dict``), when resuming."""
        tracker = cls(patience=options.early_stop, min_delta=options.early_stop_min_delta,
                      warmup_steps=options.warmup_steps)
        for key in ("best_step", "best_loss", "best_base", "reference", "reference_step", "without"):
            if saved and saved.get(key) is not None:
                setattr(tracker, key, saved[key])
        return tracker

    def as_dict(self) -> dict:
        return {key: getattr(self, key) for key in ("best_step", "best_loss", "best_base", "reference",
                                                    "reference_step", "without")}

    def observe(self, step: int, val_loss: float, base: float | None = None) -> bool:
        """Take the validation of ``step``; whether it is a new best."""
        new_best = self.best_loss is None or val_loss < self.best_loss
        if new_best:
            self.best_step, self.best_loss, self.best_base = step, val_loss, base
        if self.reference is None or step <= self.warmup_steps:
            if self.reference is None or val_loss < self.reference:
                self.reference, self.reference_step = val_loss, step
        elif val_loss < self.reference * (1 - self.min_delta):
            self.reference, self.reference_step, self.without = val_loss, step, 0
        else:
            self.without += 1
        return new_best

    @property
    def stop_due(self) -> bool:
        """N validations in a row without an improvement (never with ``--early_stop`` off)."""
        return self.patience is not None and self.without >= self.patience

    def best_record(self, file: str) -> dict | None:
        """The status file's ``best``: step, val_loss, the base's, the gain ((base - best) / base) and the file."""
        if self.best_step is None:
            return None
        gain = (self.best_base - self.best_loss) / self.best_base if self.best_base else None
        return {"step": self.best_step, "val_loss": self.best_loss, "val_loss_base": self.best_base, "gain": gain,
                "file": file}

    def early_stop_record(self, step: int) -> dict:
        return {"step": step, "best_step": self.best_step, "validations_without_improvement": self.without,
                "since_step": self.reference_step, "patience": self.patience, "min_delta": self.min_delta}


def early_stop_line(record: dict, total_steps: int, best_file: str) -> str:
    """The launcher's last line of an early-stopped run."""
    return (f"stopped early at step {record['step']} of {total_steps}: no better validation in "
            f"{record['validations_without_improvement']} evaluations since step {record['since_step']}; best: "
            f"{best_file} (step {record['best_step']})")


class BestLora(Component):
    """Keeps ``lora-best.safetensors`` at each new lowest validation and ends the run under ``--early_stop``.
    ``save_lora(file_name, step)``: the run's LoRA file writer (every rank calls it; a collective)."""

    name = "best_lora"

    def __init__(self, options, status, save_lora, printer, is_main: bool):
        self.options, self.status, self.save_lora = options, status, save_lora
        self.printer, self.is_main = printer, is_main
        self.best = BestSoFar.from_options(options)
        self.file = os.path.join(options.output_path, BEST_FILE)

    def at_start(self, context: StepContext) -> Decision | None:
        """A resumed run says its best; one that had already stopped early (its count at N or more) trains no
        further, and rank 0 says how to go on."""
        record = self.best.best_record(self.file)
        if record:
            self.status.update(best=record)
        if not self.best.stop_due:
            return None
        if self.is_main:
            print(f"this run stopped early at step {context.step}: no better validation in {self.best.without} "
                  f"evaluations since step {self.best.reference_step} (--early_stop {self.best.patience}); nothing "
                  "more to train. To go on: a larger --early_stop N, or --early_stop off", file=sys.stderr)
        return Decision(stop=Stop.EARLY)

    def after_validation(self, context: StepContext) -> Decision | None:
        validation = context.validation
        if self.best.observe(context.step, validation.val_loss, validation.fields.get("val_loss_base")):
            validation.mark(new_best=True)
            self.save_lora(BEST_FILE, context.step)
            self.status.update(best=self.best.best_record(self.file))
        return Decision(stop=Stop.EARLY) if self.best.stop_due else None

    def at_end(self, context: StepContext) -> None:
        if context.stop is Stop.EARLY:   # the run's summary ends with it (``early_stop_line``)
            self.status.update(early_stop=self.best.early_stop_record(context.step))

    def state_dict(self) -> dict:
        return self.best.as_dict()

    def load_state_dict(self, state: dict) -> None:
        self.best = BestSoFar.from_options(self.options, state)
