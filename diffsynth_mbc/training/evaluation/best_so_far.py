"""The best validation so far and ``--early_stop N``: which validation is a new best (its LoRA is kept as
``lora-best.safetensors``) and when the run has had N validations in a row without improving. Pure: no torch.

The headline ``val_loss`` decides (the EMA's under ``--validate_with ema``). A new best is any validation lower than
every earlier one. An improvement, for the early stop, is a validation at least ``min_delta`` (relative) below the
loss the count was last reset at: a run creeping down by less than that is not learning anything a clip would show
(docs/training.md, Best LoRA and early stop). The first validation sets that loss and counts for nothing, and so do
validations in the warm-up (``--warmup_steps``), whose loss falls with the learning rate rising. The state goes into
every checkpoint, so a resumed run knows its best and its count."""

from __future__ import annotations

import dataclasses

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
    last_new_best: bool = False       # the last validation observed was a new best

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
        self.last_new_best = self.best_loss is None or val_loss < self.best_loss
        if self.last_new_best:
            self.best_step, self.best_loss, self.best_base = step, val_loss, base
        if self.reference is None or step <= self.warmup_steps:
            if self.reference is None or val_loss < self.reference:
                self.reference, self.reference_step = val_loss, step
        elif val_loss < self.reference * (1 - self.min_delta):
            self.reference, self.reference_step, self.without = val_loss, step, 0
        else:
            self.without += 1
        return self.last_new_best

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
