"""Rate and ETA from a window of recent steps on a monotonic clock, plus the overheads still ahead. Pure: no torch.

Warm-up steps (compilation, first data-loader fill, cache allocation) and the steps a run resumed
past never enter the rate: the window starts ``warmup_steps`` steps after the first step observed.
The step clock it is fed leaves out checkpoints, LoRA files, validation and samples
(``training.step_timing``); the ETA adds them back from their schedule (``OverheadSchedule``) at their
measured mean duration.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass


class StepRateWindow:
    def __init__(self, window: int = 50, warmup_steps: int = 2):
        if window < 1:
            raise ValueError("window must be at least 1")
        self.window = window
        self.warmup_steps = max(0, warmup_steps)
        self._observed = 0
        self._marks: deque[tuple[int, float]] = deque(maxlen=window + 1)

    def record(self, step: int, now: float) -> None:
        """Note that optimizer step ``step`` finished at monotonic time ``now``."""
        self._observed += 1
        if self._observed <= self.warmup_steps:
            # The end of the last warm-up step is where timing starts.
            self._marks.clear()
        self._marks.append((step, now))

    @property
    def seconds_per_step(self) -> float | None:
        if self._observed <= self.warmup_steps or len(self._marks) < 2:
            return None
        (first_step, first_time), (last_step, last_time) = self._marks[0], self._marks[-1]
        if last_step <= first_step:
            return None
        return max(0.0, last_time - first_time) / (last_step - first_step)

    def eta_seconds(self, remaining_steps: int) -> float | None:
        rate = self.seconds_per_step
        if rate is None:
            return None
        return max(0, remaining_steps) * rate


def _multiples(every: int | None, first: int, last: int) -> int:
    """How many multiples of ``every`` lie in [first, last] (0 without ``every``)."""
    if not every or last < first:
        return 0
    return last // every - (first - 1) // every


def _extra_at_end(every: int | None, total_steps: int) -> int:
    """1 when the end of the run brings one more (a last checkpoint, validation, samples): unless its
    cadence already put one on the last step."""
    return 0 if every and total_steps % every == 0 else 1


@dataclass(frozen=True)
class OverheadSchedule:
    """When the work between steps comes (checkpoints, LoRA files, validation, samples), from the training flags.

    It mirrors the loop: a checkpoint every ``checkpoint_steps`` steps and/or ``checkpoint_minutes`` (whichever
    first; a last one at the end unless the last step had one); an ``epoch-N`` LoRA file at every epoch end, a
    ``step-N`` one every ``save_steps``, ``lora.safetensors`` at the end; validation every ``val_steps`` and at
    the end; sample clips every ``sample_steps`` and at the end.
    """
    checkpoint_steps: int | None = None
    checkpoint_minutes: float | None = None
    save_steps: int | None = None
    validation: bool = False
    val_steps: int | None = None
    samples: bool = False
    sample_steps: int | None = None

    @classmethod
    def from_options(cls, options, *, validation: bool, samples: bool) -> "OverheadSchedule":
        return cls(checkpoint_steps=options.checkpoint_steps or None,
                   checkpoint_minutes=options.checkpoint_minutes or None, save_steps=options.save_steps or None,
                   validation=validation, val_steps=options.val_steps or None, samples=samples,
                   sample_steps=options.sample_steps or None)

    def upcoming(self, step: int, total_steps: int, steps_per_epoch: int,
                 seconds_per_step: float | None = None) -> dict[str, int]:
        """How many of each kind are still ahead once optimizer step ``step`` is done and reported: those that
        follow step ``step`` itself included (the loop runs them after its progress report)."""
        first, last = max(1, step), total_steps
        if last < first:
            return {}
        checkpoints = _multiples(self.checkpoint_steps, first, last)
        if self.checkpoint_minutes and seconds_per_step:
            # The timer restarts at every save; roughly one save per interval of training time.
            by_time = int(max(0, total_steps - step) * seconds_per_step // (self.checkpoint_minutes * 60))
            checkpoints = max(checkpoints, by_time)
        if self.checkpoint_steps or self.checkpoint_minutes:
            checkpoints += _extra_at_end(self.checkpoint_steps, last)
        counts = {"checkpoint": checkpoints,
                  "lora": _multiples(steps_per_epoch, first, last) + _multiples(self.save_steps, first, last) + 1,
                  "validation": (_multiples(self.val_steps, first, last) + _extra_at_end(self.val_steps, last)
                                 if self.validation else 0),
                  "samples": (_multiples(self.sample_steps, first, last) + _extra_at_end(self.sample_steps, last)
                              if self.samples else 0)}
        return {kind: count for kind, count in counts.items() if count}


def eta_seconds(seconds_per_step: float | None, remaining_steps: int, upcoming: dict[str, int],
                mean_seconds: dict[str, float]) -> tuple[float | None, float]:
    """(ETA, the overheads' part of it): the remaining steps at the steady step time plus each kind of overhead
    still ahead at its measured mean. A kind not yet measured adds nothing until it has been; no ETA before
    the step rate is known."""
    overheads = sum(count * mean_seconds[kind] for kind, count in upcoming.items()
                    if mean_seconds.get(kind) is not None)
    if seconds_per_step is None:
        return None, overheads
    return max(0, remaining_steps) * seconds_per_step + overheads, overheads
