"""Samples and loss per shape bucket (``--buckets aspect``), read from each history record's ``shapes``. No torch.

A step record lists one ``[frames, height, width]`` (pixels) per trained sample, aligned with its ``timesteps``,
``timestep_losses`` and ``modes``. Per rank this keeps, for each bucket, how many samples it trained and the sum
of their losses, fed incrementally as the history is read, so a request costs nothing however long the run. A
bucket is named ``"{width}x{height}"``, with `` image`` when frames == 1 (``"1280x704"``, ``"960x960 image"``).
Histories written before buckets existed have no ``shapes``: nothing is kept. A record whose ``shapes`` is not a
list as long as its ``timestep_losses`` (and its ``timesteps`` and ``modes``, where it has them) is left out
whole; so is a sample whose shape is not three positive whole numbers or whose loss is not a finite number.
"""

from __future__ import annotations

from diffsynth_mbc.monitor.timestep_bins import MAX_PAIRS_PER_RECORD, finite_number

MAX_BUCKETS = 64        # bucket names kept per rank (aspect buckets are a handful): more in a file are left out
MAX_SIDE = 1 << 20      # a frame count, height or width above this is not a shape


def bucket_name(shape) -> str | None:
    """``[frames, height, width]`` -> ``"{width}x{height}"`` (`` image`` when frames == 1); None if not a shape."""
    if type(shape) is not list or len(shape) != 3:
        return None
    if not all(finite_number(v) and v == int(v) and 0 < v <= MAX_SIDE for v in shape):
        return None
    frames, height, width = (int(v) for v in shape)
    return f"{width}x{height}" + (" image" if frames == 1 else "")


def aligned(shapes, losses, *others) -> bool:
    """True when ``shapes`` and ``losses`` are lists of one length and each of ``others`` is absent or as long."""
    if type(shapes) is not list or type(losses) is not list or len(shapes) != len(losses):
        return False
    return all(other is None or (type(other) is list and len(other) == len(shapes)) for other in others)


class BucketLosses:
    """One rank's samples and summed loss per bucket over the run (see the module's docstring)."""

    __slots__ = ("samples", "loss_sums")

    def __init__(self):
        self.samples: dict[str, int] = {}        # bucket -> samples trained in it
        self.loss_sums: dict[str, float] = {}    # bucket -> the sum of those samples' losses

    def add(self, shapes, losses, timesteps=None, modes=None) -> None:
        """One step record's samples: their shapes and losses, index by index."""
        if not aligned(shapes, losses, timesteps, modes):
            return
        samples, sums = self.samples, self.loss_sums
        for shape, loss in zip(shapes[:MAX_PAIRS_PER_RECORD], losses):
            if not finite_number(loss):
                continue
            name = bucket_name(shape)
            if name is None or (name not in samples and len(samples) >= MAX_BUCKETS):
                continue
            samples[name] = samples.get(name, 0) + 1
            sums[name] = sums.get(name, 0.0) + loss

    def as_dict(self) -> dict:
        """``{bucket: {"samples": n, "loss": mean loss of its samples}}`` ordered by name; empty without shapes."""
        return {name: {"samples": self.samples[name], "loss": self.loss_sums[name] / self.samples[name]}
                for name in sorted(self.samples)}
