"""How long a run takes: the training's own step plan, times seconds per step (pure Python).

The steps are the training's (``training/plan/step_plan.StepPlan``, built by ``plan_from_options`` as the training,
``python -m diffsynth_mbc.plan`` and the status files build it): clips in batches of ``--batch_size``, images in
batches of ``--image_batch_size``, all batches dealt to the GPUs in turn, one optimizer step per
``accumulation`` batches. The batches are shuffled together, so the steps split between clips and images as
their batches do; the projection times each part at its own seconds per step, and the total it prints is the
plan's. With ``--buckets aspect`` (the plan counting each bucket's batches) the steps split between the buckets
instead, each timed at its own bucket's seconds per step. GPUs are every GPU of every node. Building the latent cache first (``--cached``) encodes every row
once on every GPU in parallel. Used by ``python -m diffsynth_mbc.doctor`` and ``python -m diffsynth_mbc.plan``.
"""

from __future__ import annotations

import dataclasses
import math
import os
from pathlib import Path

from diffsynth_mbc.data.convert.catalogue_rows import IMAGE_EXTENSIONS
from diffsynth_mbc.data.media.buckets import media_kind
from diffsynth_mbc.data.metadata_csv import read_metadata
from diffsynth_mbc.training.plan.step_plan import StepPlan
from diffsynth_mbc.values import finite_number


def count_media(metadata_path: str | Path) -> tuple[int, int]:
    """(videos, images) of a metadata CSV: its media_type column, else each file's extension."""
    media = metadata_media(metadata_path)
    return media.videos, media.images


@dataclasses.dataclass(frozen=True)
class MetadataMedia:
    """What a metadata CSV holds: its videos and images, and the clips' frame rates from the ``fps`` column that
    ``python -m diffsynth_mbc.convert --probe`` writes (``{fps: clips}``; ``unknown_rate``: clips without one)."""
    videos: int
    images: int
    frame_rates: dict
    unknown_rate: int


_MEDIA: dict = {}   # (path, size, mtime): MetadataMedia, so that a command reads its metadata once


def metadata_media(metadata_path: str | Path) -> MetadataMedia:
    """The media of a metadata CSV (``MetadataMedia``), read once per command for one file's contents."""
    info = os.stat(metadata_path)
    key = (os.fspath(metadata_path), info.st_ino, info.st_size, info.st_mtime_ns)
    if key not in _MEDIA:
        videos = images = unknown = 0
        rates: dict = {}
        for row in read_metadata(metadata_path):   # MetadataError names the file and line DiffSynth's pandas stops at
            kind = (row.get("media_type") or "").strip().lower()
            if not kind:
                kind = "image" if Path(row.get("video") or "").suffix.lower().lstrip(".") in IMAGE_EXTENSIONS \
                    else "video"
            if kind == "image":
                images += 1
                continue
            videos += 1
            fps = finite_number(row.get("fps"), text=True)
            if fps is None or fps <= 0:
                unknown += 1
            else:
                rates[round(fps, 3)] = rates.get(round(fps, 3), 0) + 1
        _MEDIA[key] = MetadataMedia(videos, images, rates, unknown)
    return _MEDIA[key]


def _ceil_div(numerator: int, denominator: int) -> int:
    return -(-numerator // denominator)


def _is_image(key: str) -> bool:
    return media_kind(key) == "image"


@dataclasses.dataclass(frozen=True)
class RunShape:
    """The run's steps (``plan``: the training's StepPlan, its ``world_size`` every GPU of every node) and what
    runs one rank: a GPU, or on a machine without one a CPU process."""
    plan: StepPlan
    nodes: int = 1
    unit: str = "GPU"

    @property
    def gpus(self) -> int:
        return self.plan.world_size

    @property
    def gpus_per_node(self) -> int:
        return max(1, self.plan.world_size // max(1, self.nodes))

    @property
    def videos(self) -> int:
        return self.plan.videos

    @property
    def images(self) -> int:
        return self.plan.images

    @property
    def total_steps(self) -> int:
        """Optimizer steps per GPU over the whole run: the plan's."""
        return self.plan.total_steps

    def _batches(self) -> tuple[int, int]:
        """Clip batches and image batches of one epoch, all GPUs together."""
        plan = self.plan
        return (_ceil_div(plan._samples("videos"), plan.batch_size),
                _ceil_div(plan._samples("images"), plan.image_batch_size))

    def bucket_steps(self) -> list[tuple[str, int]]:
        """``--buckets aspect``: each bucket key's share of the plan's steps per GPU, as its batches per GPU share them
        (the keys' groups of batches are shuffled together); the shares add up to the plan's total. [] with off."""
        rows = self.plan.bucket_dicts() if self.plan.bucket_samples else []
        batches = sum(row["batches_per_gpu"] for row in rows)
        shares, counted, before = [], 0, 0
        for row in rows:
            counted += row["batches_per_gpu"]
            upto = round(self.total_steps * counted / batches) if batches else 0
            shares.append((row["key"], upto - before))
            before = upto
        return shares

    @property
    def video_steps(self) -> int:
        """Of the plan's steps per GPU, those on clips: the clips' share of the batches (they are shuffled together)."""
        if self.plan.bucket_samples:
            return sum(steps for key, steps in self.bucket_steps() if not _is_image(key))
        video_batches, image_batches = self._batches()
        if not video_batches + image_batches:
            return 0
        return round(self.total_steps * video_batches / (video_batches + image_batches))

    @property
    def image_steps(self) -> int:
        return self.total_steps - self.video_steps

    def as_dict(self) -> dict:
        plan = self.plan
        return {"videos": plan.videos, "images": plan.images, "num_epochs": plan.num_epochs, "repeat": plan.repeat,
                "batch_size": plan.batch_size, "image_batch": plan.image_batch_size,
                "accumulation": plan.gradient_accumulation, "gpus_per_node": self.gpus_per_node, "nodes": self.nodes,
                "unit": self.unit, "gpus": self.gpus, "total_steps_per_gpu": self.total_steps,
                "video_steps_per_gpu": self.video_steps, "image_steps_per_gpu": self.image_steps}


@dataclasses.dataclass(frozen=True)
class Projection:
    shape: RunShape
    video_seconds: float | None          # per optimizer step
    image_seconds: float | None
    cache_build_seconds: float | None    # None: no cache to build
    kind: str                            # "estimate" or "measured"
    encode_video_seconds: float | None = None   # one clip / one image through the VAE and the text encoder
    encode_image_seconds: float | None = None
    bucket_seconds: tuple = ()           # --buckets aspect: ((key, seconds per optimizer step at its bucket), ...)
    evaluation: object = None            # evaluation_cost.EvaluationCost: validations, health records, sample clips
    # --resolution_stages: ((size, share, the whole run's training seconds at that size, its cache build), ...)
    stages: tuple = ()
    staged_alternative: tuple = ()       # a plain plan's: (the stages flag, total seconds with it)

    @property
    def final_size_seconds(self) -> float:
        """The training's seconds were every step at the final size."""
        if self.bucket_seconds:
            seconds = dict(self.bucket_seconds)
            return sum(steps * seconds.get(key, 0.0) for key, steps in self.shape.bucket_steps())
        return self.shape.video_steps * (self.video_seconds or 0.0) + self.shape.image_steps * (self.image_seconds or 0.0)

    @property
    def training_seconds(self) -> float:
        """Each stage's share of the steps at its size, the rest at the final size."""
        rest = 1.0 - sum(share for _, share, _, _ in self.stages)
        return self.final_size_seconds * rest + sum(share * seconds for _, share, seconds, _ in self.stages)

    @property
    def all_cache_seconds(self) -> float | None:
        """The latent cache build: the final size's and every stage's latents (None: no cache to build)."""
        if self.cache_build_seconds is None:
            return None
        return self.cache_build_seconds + sum(cache for _, _, _, cache in self.stages)

    @property
    def total_seconds(self) -> float:
        return self.training_seconds + (self.all_cache_seconds or 0.0) + self.evaluation_seconds

    def stage_line(self) -> str | None:
        """``in stages: 832x480 70% of the steps (2.1 days) + 1280x704 30% (2.4 days)``; a plain plan's staged
        alternative: ``with --resolution_stages 832x480:0.7: 6.1 days (0.63 of this)``."""
        if self.stages:
            rest = 1.0 - sum(share for _, share, _, _ in self.stages)
            parts = [f"{name} {share:.0%} of the steps ({duration(share * seconds)})"
                     for name, share, seconds, _ in self.stages]
            final = f"{self.shape.plan.final_size[1]}x{self.shape.plan.final_size[0]}" if self.shape.plan.final_size \
                else "the final size"
            return "in stages: " + " + ".join(parts + [f"{final} {rest:.0%} ({duration(rest * self.final_size_seconds)})"])
        if self.staged_alternative:
            flag, seconds = self.staged_alternative
            return (f"with --resolution_stages {flag}: {duration(seconds)} ({seconds / self.total_seconds:.2f} of "
                    "this; validation and samples stay at the final size)")
        return None

    @property
    def evaluation_seconds(self) -> float:
        return self.evaluation.seconds if self.evaluation is not None else 0.0

    def evaluation_line(self) -> str | None:
        return self.evaluation.line() if self.evaluation is not None else None

    def as_dict(self) -> dict:
        return {**self.shape.as_dict(), "video_seconds_per_step": _round(self.video_seconds),
                "image_seconds_per_step": _round(self.image_seconds), "training_seconds": round(self.training_seconds),
                "cache_build_seconds": None if self.cache_build_seconds is None else round(self.cache_build_seconds),
                "total_seconds": round(self.total_seconds), "total": duration(self.total_seconds), "kind": self.kind,
                "line": self.line(), "cache_line": self.cache_line(), **self._bucket_dict(),
                "best_line": self.evaluation.best_line() if self.evaluation is not None else None,
                "stage_line": self.stage_line(),
                **({"evaluation": self.evaluation.as_dict(), "evaluation_line": self.evaluation_line()}
                   if self.evaluation is not None and self.evaluation_line() else {})}

    def _bucket_dict(self) -> dict:
        if not self.bucket_seconds:
            return {}   # --buckets off: the projection reads as it always did
        seconds = dict(self.bucket_seconds)
        return {"buckets": [{"key": key, "steps_per_gpu": steps, "seconds_per_step": _round(seconds.get(key))}
                            for key, steps in self.shape.bucket_steps()], "bucket_line": self.bucket_line()}

    def bucket_line(self) -> str | None:
        """``by bucket: 1280x704 videos 1,200 steps x 0.80 s + ...``: what the training seconds add up from."""
        if not self.bucket_seconds:
            return None
        seconds = dict(self.bucket_seconds)
        parts = [f"{key.partition('@')[2] or key} {key.partition('@')[0]}s {steps:,} steps x {seconds.get(key, 0.0):.2f} s"
                 for key, steps in self.shape.bucket_steps()]
        return f"by bucket ({self.kind}): " + " + ".join(parts) + f" = {duration(self.training_seconds)}"

    @property
    def up_to(self) -> str:
        """``up to `` when an early stop may end the run before its planned total."""
        return "up to " if self.evaluation is not None and self.evaluation.ends_early else ""

    def line(self) -> str:
        shape, plan = self.shape, self.shape.plan
        media = []
        if shape.videos:
            media.append(f"{shape.videos:,} videos (batch {plan.batch_size})")
        if shape.images:
            media.append(f"{shape.images:,} images (batch {plan.image_batch_size})")
        repeat = (" x each catalogue's repeat" if plan.datasets else "") + (
            f" x repeat {plan.repeat}" if plan.repeat > 1 else "")
        split = " + ".join(f"{n:,} {what}" for n, what in ((shape.video_steps, "video"), (shape.image_steps, "image"))
                           if n)
        steps = f"{shape.total_steps:,}" + (f" ({split})" if shape.videos and shape.images else "")
        rates = " / ".join(f"{s:.2f}" for s in (self.video_seconds if shape.videos else None,
                                                self.image_seconds if shape.images else None) if s is not None)
        units = "CPU process(es)" if shape.unit == "CPU process" else shape.unit + "(s)"
        text = (f"projected run length: {self.up_to}{duration(self.total_seconds)} ({self.kind}): "
                f"{' + '.join(media) or 'no rows'}"
                f"{repeat} x {plan.num_epochs} epoch(s)"
                f"{f' x accumulation {plan.gradient_accumulation}' if plan.gradient_accumulation > 1 else ''} on "
                f"{shape.gpus} {units} ({shape.nodes} node(s) x {shape.gpus_per_node}): {steps} optimizer steps per "
                f"{shape.unit} at {rates} s/step")
        if self.cache_build_seconds is not None:
            text += f", after building the latent cache ({duration(self.all_cache_seconds)})"
        if self.evaluation_seconds:
            text += f", with evaluation ({duration(self.evaluation_seconds)})"
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
            kind: str = "estimate", bucket_seconds: dict | None = None, evaluation=None) -> Projection:
    """The run's length; with the encode seconds of one clip and one image, the cache build first. With
    ``bucket_seconds`` ({key: seconds per step}, --buckets aspect, the shape's plan counting its buckets) each bucket's
    steps at its own seconds; the clips' and the images' seconds are then their buckets' means, weighted by steps."""
    cache = None
    if encode_video_seconds is not None or encode_image_seconds is not None:
        rows_per_gpu = lambda rows: math.ceil(rows / shape.gpus)  # noqa: E731
        cache = (rows_per_gpu(shape.videos) * (encode_video_seconds or 0.0)
                 + rows_per_gpu(shape.images) * (encode_image_seconds or 0.0))
    buckets = ()
    if bucket_seconds and shape.plan.bucket_samples:
        buckets = tuple((key, bucket_seconds[key]) for key, _ in shape.plan.bucket_samples if key in bucket_seconds)
        video_seconds = _mean(shape, bucket_seconds, image=False, otherwise=video_seconds)
        image_seconds = _mean(shape, bucket_seconds, image=True, otherwise=image_seconds)
    return Projection(shape, video_seconds, image_seconds, cache, kind, encode_video_seconds, encode_image_seconds,
                      buckets, evaluation)


def _mean(shape: RunShape, bucket_seconds: dict, image: bool, otherwise: float | None) -> float | None:
    """The step-weighted mean seconds of the clips' (or the images') buckets."""
    steps = [(n, bucket_seconds[key]) for key, n in shape.bucket_steps() if _is_image(key) == image and key in bucket_seconds]
    total = sum(n for n, _ in steps)
    return sum(n * s for n, s in steps) / total if total else otherwise


def duration(seconds: float) -> str:
    """Days when a day or more, else hours, minutes or seconds: never '0.0 days'."""
    if seconds >= 86400:
        return f"{seconds / 86400:.1f} days"
    if seconds >= 3600:
        return f"{seconds / 3600:.1f} hours"
    if seconds >= 60:
        return f"{seconds / 60:.0f} minutes"
    return f"{seconds:.0f} seconds"
