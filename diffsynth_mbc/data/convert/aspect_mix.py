"""--probe's aspect report: which shape each probed row would train at, what centre-cropping to it discards, and
which rows are small (upscaled by more than 1.1x) or lose much of their frame to the crop. No torch.

The shapes are the training's: ``--buckets off`` trains every row at ``--height x --width``, ``--buckets aspect``
at the bucket nearest its aspect (``diffsynth_mbc.data.media.buckets``). A row is small when it would be upscaled
at its own shape by more than UPSCALE_FLAGGED_ABOVE; under ``off`` that shape is turned to the row's orientation, since a portrait clip's problem
there is the crop, not its size. A row whose crop keeps less than 90% of its frame is flagged as cropped.
"""

from __future__ import annotations

from dataclasses import dataclass

from diffsynth_mbc.data.media.buckets import Bucket, bucket_counts, bucket_set, kept_fraction, nearest_bucket
from diffsynth_mbc.data.media.media_probe import MediaInfo

CROPPED_MEDIA = "cropped media"
KEEP_AT_LEAST = 0.9   # a crop that keeps less of the frame is flagged (under --buckets off, every such row)
# A picture upscaled by more than this is flagged as small. Any resize between two sizes blurs; on real photos a file
# 10% short of its shape trains with twice the error (3 dB) of one 2% larger than its shape, where a 2% upscale is
# within 1 dB of it (benchmarks/bench_upscale.py; docs/convert.md).
UPSCALE_FLAGGED_ABOVE = 1.1
ORIENTATIONS = ("landscape", "portrait", "square")
PRESETS_SIZE = Bucket(704, 1280)   # --height x --width unless given: the presets' (Wan2.2-TI2V-5B's) size


def orientation(width: int, height: int) -> str:
    return Bucket(height, width).orientation


@dataclass(frozen=True)
class TrainingShapes:
    mode: str                      # --buckets: "off" or "aspect"
    training: Bucket               # --height x --width
    buckets: tuple[Bucket, ...]    # bucket_set(--height, --width)

    @classmethod
    def from_args(cls, args) -> "TrainingShapes":
        return cls(args.buckets, Bucket(args.height, args.width), bucket_set(args.height, args.width))

    @property
    def other_mode(self) -> str:
        return "off" if self.mode == "aspect" else "aspect"

    def target(self, width: int, height: int, mode: str | None = None) -> Bucket:
        """The shape a ``width x height`` picture trains at under ``mode`` (default: --buckets)."""
        if (mode or self.mode) == "aspect":
            return nearest_bucket(self.buckets, width, height)
        return self.training

    def small(self, info: MediaInfo) -> str | None:
        """``"64x48, smaller than 1280x704 (upscaled 20x)"`` when the picture would be upscaled at its shape by more
        than UPSCALE_FLAGGED_ABOVE, else None."""
        width, height = info.width, info.height
        target = self.target(width, height)
        if self.mode == "off" and (width >= height) != (target.width >= target.height):
            target = Bucket(target.width, target.height)   # the training shape turned to the picture's orientation
        upscale = max(target.width / width, target.height / height)   # DiffSynth's resize covers the shape
        if upscale <= UPSCALE_FLAGGED_ABOVE:
            return None
        its = "its bucket " if self.mode == "aspect" else ""
        return f"{width}x{height}, smaller than {its}{target.name} (upscaled {upscale:.2g}x)"

    def cropped(self, info: MediaInfo, media_type: str) -> str | None:
        """``"portrait clip, cropping to 1280x704 keeps 31%"`` when the crop keeps less than 90%, else None."""
        target = self.target(info.width, info.height)
        kept = kept_fraction(info.width, info.height, target)
        if kept >= KEEP_AT_LEAST:
            return None
        kind = "clip" if media_type == "video" else "image"
        return f"{orientation(info.width, info.height)} {kind}, cropping to {target.name} keeps {round(100 * kept)}%"

    def sized_for(self) -> str:
        """The training size the flags are measured against, and how to measure against another."""
        size = f"--width {self.training.width} --height {self.training.height}"
        if self.training != PRESETS_SIZE:
            return f"sized for {size}"
        return (f"sized for {size}, assumed (the default: the presets' size); for a run at another size give its "
                "--width and --height")

    def describe(self) -> str:
        """What "the size it trains at" means, for a warning line."""
        if self.mode == "aspect":
            return f"their bucket (--buckets aspect around {self.training.name})"
        return f"{self.training.name} in their orientation (--buckets off)"


def _discarded(infos: list[MediaInfo], shapes: TrainingShapes, mode: str) -> dict:
    kept = [kept_fraction(i.width, i.height, shapes.target(i.width, i.height, mode)) for i in infos]
    return {
        "mean_share": round(sum(1 - k for k in kept) / len(kept), 4) if kept else 0.0,
        "rows_over_10_percent": sum(1 for k in kept if k < KEEP_AT_LEAST),
    }


def summarise_aspect(infos: list[MediaInfo], shapes: TrainingShapes) -> dict:
    """summary.json's probe.aspect: rows per orientation and per shape, and the share of pixels cropping discards
    under --buckets and, for comparison, under the other mode."""
    orientations = [orientation(i.width, i.height) for i in infos]
    return {
        "buckets": shapes.mode,
        "training_size": shapes.training.name,
        "orientations": {name: orientations.count(name) for name in ORIENTATIONS},
        "rows_per_bucket": bucket_counts(shapes.target(i.width, i.height) for i in infos),
        "discarded": {mode: _discarded(infos, shapes, mode) for mode in (shapes.mode, shapes.other_mode)},
    }


def aspect_lines(aspect: dict) -> list[str]:
    """The aspect section as lines for the terminal."""
    mode = aspect["buckets"]
    other = "off" if mode == "aspect" else "aspect"
    shares = aspect["discarded"]
    orientations = ", ".join(f"{count} {name}" for name, count in aspect["orientations"].items())
    where = ", buckets around" if mode == "aspect" else ": all at"
    per_bucket = ", ".join(f"{name}: {count}" for name, count in aspect["rows_per_bucket"].items()) or "-"
    return [
        f"orientation: {orientations}",
        f"rows per shape (--buckets {mode}{where} {aspect['training_size']}): {per_bucket}",
        f"cropping discards {_share(shares[mode])}; with --buckets {other} it would discard {_share(shares[other])}",
    ]


def _share(discarded: dict) -> str:
    rows = discarded["rows_over_10_percent"]
    loses = "1 row loses" if rows == 1 else f"{rows} rows lose"
    return f"{100 * discarded['mean_share']:.1f}% of the pixels on average ({loses} more than 10%)"
