"""Aspect-ratio buckets: train each sample at a shape near its own aspect, at about one pixel area. No torch.

``--buckets off`` trains everything at ``--height x --width``: each frame is resized to cover it and centre-cropped,
so a 720x1280 phone clip keeps 31% of its height at 1280x704. ``--buckets aspect`` builds a set of shapes at about
the area of ``--height x --width`` (``bucket_set``): every height that is a multiple of 32 (the VAE's 16 x the DiT's
patch 2) paired with the multiple of 32 that brings the area closest, from aspect 1:2.5 to 2.5:1, plus the
configured shape, its transpose and a square, its side the area's square root rounded to 32 (at small sizes its
area may differ by a quarter or more: at 128x96 it is 96x96, where a square picture would otherwise lose a quarter
to 128x96's crop). Each sample goes to the bucket nearest its own aspect (``nearest_bucket``, its displayed size: a
clip's rotation metadata applied), is resized to cover it and centre-cropped; neighbouring buckets differ by one
32-pixel step, so the crop takes no more than that rounding from a sample inside the range.

A bucket is named as people name sizes, width x height (``1280x704``); records carry ``[frames, height, width]``.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Iterable, Sequence

BUCKET_MODES = ("off", "aspect")
STEP = 32   # sides divisible by 32: the VAE downsamples by 16, the DiT's patch is 2
MAX_ASPECT = 2.5   # widest bucket 2.5:1 (a 2.39:1 film fits), tallest 1:2.5


@dataclasses.dataclass(frozen=True, order=True)
class Bucket:
    height: int
    width: int

    @property
    def name(self) -> str:
        return f"{self.width}x{self.height}"

    @property
    def aspect(self) -> float:
        return self.width / self.height

    @property
    def area(self) -> int:
        return self.width * self.height

    @property
    def orientation(self) -> str:
        return "landscape" if self.width > self.height else "portrait" if self.width < self.height else "square"


def parse_bucket(name: str) -> Bucket:
    """``"1280x704"`` (width x height) -> Bucket(704, 1280)."""
    width, _, height = str(name).partition("x")
    return Bucket(int(height), int(width))


def bucket_set(height: int, width: int, step: int = STEP, max_aspect: float = MAX_ASPECT) -> tuple[Bucket, ...]:
    """The buckets at about ``height x width`` pixels, ordered by aspect (tallest first)."""
    if height % step or width % step:
        raise ValueError(f"--height {height} and --width {width} must be multiples of {step} for buckets")
    area = height * width
    buckets = {Bucket(height, width), Bucket(width, height)}
    square = max(step, round(math.sqrt(area) / step) * step)   # at every size, however far (128x96: 96x96)
    buckets.add(Bucket(square, square))
    for side in range(step, int(math.sqrt(area * max_aspect)) + step, step):
        other = max(step, round(area / side / step) * step)
        for bucket in (Bucket(side, other), Bucket(other, side)):
            if 1 / max_aspect <= bucket.aspect <= max_aspect:
                buckets.add(bucket)
    # At one aspect keep the shape whose area is nearest the target (rounding can give two).
    by_aspect: dict[float, Bucket] = {}
    for bucket in sorted(buckets):
        key = round(bucket.aspect, 6)
        best = by_aspect.get(key)
        if best is None or abs(bucket.area - area) < abs(best.area - area):
            by_aspect[key] = bucket
    return tuple(sorted(by_aspect.values(), key=lambda b: (b.aspect, b.height)))


def nearest_bucket(buckets: Sequence[Bucket], width: int, height: int) -> Bucket:
    """The bucket nearest the aspect of a ``width x height`` picture (in log aspect; ties go to the larger area)."""
    if width <= 0 or height <= 0:
        raise ValueError(f"a picture of {width}x{height} has no aspect")
    aspect = math.log(width / height)
    return min(buckets, key=lambda b: (abs(math.log(b.aspect) - aspect), -b.area, b.height))


def kept_fraction(width: int, height: int, target: Bucket) -> float:
    """The share of a ``width x height`` picture that survives being resized to cover ``target`` and
    centre-cropped to it (1.0: nothing cut off)."""
    scale = max(target.width / width, target.height / height)
    return (target.width * target.height) / (width * scale * height * scale)


def sample_key(media_kind: str, bucket: Bucket | None) -> str:
    """What a batch shares: the media kind (videos and images have different frame counts) and, with buckets,
    the bucket: ``video@1280x704``."""
    return media_kind if bucket is None else f"{media_kind}@{bucket.name}"


def media_kind(key: str) -> str:
    """``image`` or ``video``: the media kind of a batch key (``image@960x960``, ``video``)."""
    return "image" if key.partition("@")[0] == "image" else "video"


def bucket_of_key(key: str) -> Bucket | None:
    kind, _, name = key.partition("@")
    return parse_bucket(name) if name else None


def bucket_counts(assigned: Iterable[Bucket]) -> dict[str, int]:
    """Rows per bucket, by bucket name, in bucket order (tallest first)."""
    counts: dict[Bucket, int] = {}
    for bucket in assigned:
        counts[bucket] = counts.get(bucket, 0) + 1
    return {bucket.name: counts[bucket] for bucket in sorted(counts, key=lambda b: (b.aspect, b.height))}
