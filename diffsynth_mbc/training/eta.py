"""Rate and ETA from a window of recent steps on a monotonic clock. Pure: no torch.

Warm-up steps (compilation, first data-loader fill, cache allocation) and the steps a run resumed
past never enter the rate: the window starts ``warmup_steps`` steps after the first step observed.
"""

from __future__ import annotations

from collections import deque


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
