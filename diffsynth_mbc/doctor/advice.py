"""The doctor's speed check: a setting that fits and makes the run faster than it is configured. No torch.

The memory check says what makes a run fit; this one looks the other way. Each candidate (today the
``--gradient_checkpointing auto`` the training resolves from the same memory model: the fewest recomputed DiT
blocks that fit) is estimated as the run itself is, on the same GPU, rows and GPUs; one that fits every batch
and takes less time (the projected run length, else the seconds per step) is the fix of a warning. A run that
already uses the fastest candidate that fits gets an ok.
"""

from __future__ import annotations

from typing import Callable

from diffsynth_mbc.doctor.checks import OK, WARN, Check
from diffsynth_mbc.training.plan import memory
from diffsynth_mbc.training.plan.run_length import duration

# (the flags as the user passes them, the options they change)
CANDIDATES = (("--gradient_checkpointing auto", {"gradient_checkpointing": "auto"}),)
MARGIN = 0.99   # faster by at least 1%: not a rounding difference


def seconds(run) -> float | None:
    """The figure runs are compared by: the projected length, else the clip (or image) batch's s/step."""
    if run.projection is not None:
        return run.projection.total_seconds
    for kind in ("video", "image"):
        if kind in run.speed:
            return run.speed[kind]["seconds_per_step"]
    return None


def describe(run) -> str:
    """``3.42 / 2.15 s/step (video / image), 30 of 30 blocks recomputed, 10.7 days`` for a run's estimate."""
    kinds = [kind for kind in ("video", "image") if kind in run.speed]
    rates = " / ".join(f"{run.speed[kind]['seconds_per_step']:.2f}" for kind in kinds)
    blocks = max(plan.recomputed_blocks for plan in run.plans.values())
    length = f", {duration(run.projection.total_seconds)}" if run.projection is not None else ""
    return (f"{rates} s/step ({' / '.join(kinds)}), {blocks} of {memory.DIT['num_layers']} blocks recomputed"
            f"{length} ({'measured' if run.projection and run.projection.kind == 'measured' else 'estimate'})")


def faster_settings(options, run, estimate: Callable, gpu_bytes: int) -> list[tuple[str, object]]:
    """[(flags, its RunEstimate)] of the candidates that fit and are faster than ``run``, fastest first.
    ``estimate(options)``: the RunEstimate of other options on the same GPU, rows and GPUs."""
    current, values = seconds(run), options.as_dict()
    found = []
    for flags, changes in CANDIDATES:
        if current is None or all(values[key] == value for key, value in changes.items()):
            continue
        other = estimate(options.replace(**changes))
        faster = seconds(other)
        if faster is None or not all(memory.fits(plan, gpu_bytes) for plan in other.plans.values()):
            continue
        if faster < MARGIN * current:
            found.append((flags, other))
    return sorted(found, key=lambda item: seconds(item[1]))


def speed_check(options, run, estimate: Callable, gpu_bytes: int) -> Check | None:
    """ok, or warn with the faster setting as the fix; None without a speed estimate (no GPU, unknown rates)."""
    if not run.speed or "unknown" in run.speed:
        return None
    better = faster_settings(options, run, estimate, gpu_bytes)
    if not better:
        return Check("speed", OK, f"{describe(run)}; no faster setting fits")
    flags, other = better[0]
    return Check("speed", WARN, f"{describe(run)}; {flags} fits and is faster",
                 f"{flags}: {describe(other)}")
