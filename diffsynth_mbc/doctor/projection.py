"""How long a run takes: optimizer steps per GPU for clips and images, times seconds per step (pure Python).

Clips and images are batched apart (``--batch_size`` clips or ``--image_batch_size`` images per forward),
so each GPU takes, per epoch,

    ceil(ceil(videos x repeat / GPUs) / batch_size / accumulation)
  + ceil(ceil(images x repeat / GPUs) / image_batch / accumulation)     optimizer steps,

GPUs being every GPU of every node. Building the latent cache first (``--cached``) encodes every row
once on every GPU in parallel. Used by ``python -m diffsynth_mbc.doctor`` and ``python -m diffsynth_mbc.plan``.
"""

from __future__ import annotations

import csv
import dataclasses
import math
from pathlib import Path

from diffsynth_mbc.data.catalog import IMAGE_EXTENSIONS


def count_media(metadata_path: str | Path) -> tuple[int, int]:
    """(videos, images) of a metadata CSV: its media_type column, else each file's extension."""
    videos = images = 0
    with open(metadata_path, newline="", encoding="utf-8-sig") as handle:
        reader = csv.DictReader(handle)
        fields = reader.fieldnames or []
        for row in reader:
            kind = (row.get("media_type") or "").strip().lower() if "media_type" in fields else ""
            if not kind:
                kind = "image" if Path(row.get("video") or "").suffix.lower().lstrip(".") in IMAGE_EXTENSIONS else "video"
            if kind == "image":
                images += 1
            else:
                videos += 1
    return videos, images


@dataclasses.dataclass(frozen=True)
class RunShape:
    videos: int
    images: int
    num_epochs: int = 1
    repeat: int = 1
    batch_size: int = 1
    image_batch: int = 1
    accumulation: int = 1
    gpus_per_node: int = 1
    nodes: int = 1
    unit: str = "GPU"   # what runs one rank: a GPU, or on a machine without one a CPU process

    @property
    def gpus(self) -> int:
        return max(1, self.gpus_per_node) * max(1, self.nodes)

    def steps_per_epoch(self, rows: int, batch: int) -> int:
        if rows == 0:
            return 0
        return math.ceil(math.ceil(math.ceil(rows * self.repeat / self.gpus) / batch) / self.accumulation)

    @property
    def video_steps(self) -> int:
        """Optimizer steps on clips, per GPU, over the whole run."""
        return self.steps_per_epoch(self.videos, self.batch_size) * self.num_epochs

    @property
    def image_steps(self) -> int:
        return self.steps_per_epoch(self.images, self.image_batch) * self.num_epochs


@dataclasses.dataclass(frozen=True)
class Projection:
    shape: RunShape
    video_seconds: float | None          # per optimizer step
    image_seconds: float | None
    cache_build_seconds: float | None    # None: no cache to build
    kind: str                            # "estimate" or "measured"
    encode_video_seconds: float | None = None   # one clip / one image through the VAE and the text encoder
    encode_image_seconds: float | None = None

    @property
    def training_seconds(self) -> float:
        return self.shape.video_steps * (self.video_seconds or 0.0) + self.shape.image_steps * (self.image_seconds or 0.0)

    @property
    def total_seconds(self) -> float:
        return self.training_seconds + (self.cache_build_seconds or 0.0)

    def as_dict(self) -> dict:
        return {**dataclasses.asdict(self.shape), "gpus": self.shape.gpus, "video_steps_per_gpu": self.shape.video_steps,
                "image_steps_per_gpu": self.shape.image_steps, "video_seconds_per_step": _round(self.video_seconds),
                "image_seconds_per_step": _round(self.image_seconds), "training_seconds": round(self.training_seconds),
                "cache_build_seconds": None if self.cache_build_seconds is None else round(self.cache_build_seconds),
                "total_seconds": round(self.total_seconds), "total": duration(self.total_seconds), "kind": self.kind,
                "line": self.line(), "cache_line": self.cache_line()}

    def line(self) -> str:
        shape = self.shape
        media = []
        if shape.videos:
            media.append(f"{shape.videos:,} videos (batch {shape.batch_size})")
        if shape.images:
            media.append(f"{shape.images:,} images (batch {shape.image_batch})")
        steps = " + ".join(f"{n:,} {what}" for n, what in ((shape.video_steps, "video"), (shape.image_steps, "image")) if n)
        rates = " / ".join(f"{s:.2f}" for s in (self.video_seconds if shape.videos else None,
                                                self.image_seconds if shape.images else None) if s is not None)
        text = (f"projected run length: {duration(self.total_seconds)} ({self.kind}): {' + '.join(media) or 'no rows'}"
                f"{f' x repeat {shape.repeat}' if shape.repeat > 1 else ''} x {shape.num_epochs} epoch(s)"
                f"{f' x accumulation {shape.accumulation}' if shape.accumulation > 1 else ''} on {shape.gpus} "
                f"{'CPU process(es)' if shape.unit == 'CPU process' else shape.unit + '(s)'} ({shape.nodes} node(s) x {shape.gpus_per_node}): {steps or 0} optimizer steps per "
                f"{shape.unit} at {rates} s/step")
        if self.cache_build_seconds is not None:
            text += f", after building the latent cache ({duration(self.cache_build_seconds)})"
        return text

    def cache_line(self) -> str | None:
        """The latent cache build on its own line (None when there is none to build): its length, whether that is
        an estimate or measured, and what it is made of. Each GPU encodes its share of the rows once."""
        if self.cache_build_seconds is None:
            return None
        shape = self.shape
        parts = [f"{math.ceil(rows / shape.gpus):,} {what} x {seconds:.2f} s" for rows, what, seconds in
                 ((shape.videos, "clips", self.encode_video_seconds), (shape.images, "images", self.encode_image_seconds))
                 if rows and seconds is not None]
        units = "CPU process(es)" if shape.unit == "CPU process" else f"{shape.unit}(s)"
        return (f"latent cache build: {duration(self.cache_build_seconds)} ({self.kind}), before the first step: "
                f"{' + '.join(parts) or 'no rows'} per {shape.unit}, {shape.gpus} {units} in parallel; each row is encoded "
                f"once (the build shows in the monitor as the caching phase)")


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 3)


def project(shape: RunShape, video_seconds: float | None, image_seconds: float | None,
            encode_video_seconds: float | None = None, encode_image_seconds: float | None = None,
            kind: str = "estimate") -> Projection:
    """The run's length; with the encode seconds of one clip and one image, the cache build first."""
    cache = None
    if encode_video_seconds is not None or encode_image_seconds is not None:
        rows_per_gpu = lambda rows: math.ceil(rows / shape.gpus)  # noqa: E731
        cache = (rows_per_gpu(shape.videos) * (encode_video_seconds or 0.0)
                 + rows_per_gpu(shape.images) * (encode_image_seconds or 0.0))
    return Projection(shape, video_seconds, image_seconds, cache, kind, encode_video_seconds, encode_image_seconds)


def duration(seconds: float) -> str:
    """Days when a day or more, else hours, minutes or seconds: never '0.0 days'."""
    if seconds >= 86400:
        return f"{seconds / 86400:.1f} days"
    if seconds >= 3600:
        return f"{seconds / 3600:.1f} hours"
    if seconds >= 60:
        return f"{seconds / 60:.0f} minutes"
    return f"{seconds:.0f} seconds"
