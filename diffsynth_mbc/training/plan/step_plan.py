"""How many steps a run takes, per rank, under DDP. Pure arithmetic: no torch, no diffsynth.

Samples are batched by shape (``training/plan/batches.py``): the videos' ``rows * repeat`` samples in batches
of ``batch_size``, the images' in batches of ``image_batch_size``; the batches are dealt to the ranks in
turn (padded so every rank runs the same number), and each rank takes one optimizer step per
``gradient_accumulation`` batches (a partial group at the end of an epoch still steps). So

    batches_per_epoch = ceil((ceil(videos * repeat / batch_size) + ceil(images * repeat / image_batch_size))
                             / world_size)
    steps_per_epoch   = ceil(batches_per_epoch / gradient_accumulation)
    total_steps       = steps_per_epoch * num_epochs

The users' dashboard showed 5,000 steps for 5,000 samples on 2 GPUs; each rank really runs 2,500.

With ``--buckets aspect`` (``bucket_samples``: each batch key's samples per epoch, ``video@1280x704``) every rank
trains the same bucket at each position (``batches.py``, equal load), so each key is counted on its own:

    batches_per_epoch = sum over keys of ceil(ceil(samples / its batch size) / world_size)

and the samples repeated to fill each key's last batch and last group of ``world_size`` batches are said.
"""

from __future__ import annotations

import math
import os
from dataclasses import asdict, dataclass

from diffsynth_mbc.data.media.buckets import media_kind
from diffsynth_mbc.training.step.objective import describe_modes, modes_per_epoch


def _ceil_div(numerator: int, denominator: int) -> int:
    return -(-numerator // denominator)


@dataclass(frozen=True)
class StepPlan:
    rows: int
    repeat: int
    world_size: int
    batch_size: int
    gradient_accumulation: int
    num_epochs: int
    images: int = 0                     # of the rows, how many are images (batched apart from the videos)
    image_batch_size: int | None = None   # None: batch_size
    # Several catalogues (data/dataset_list.py DatasetCount: name, videos, images, repeat): each catalogue's rows
    # count its own repeat times (then x ``repeat``); () is one catalogue, as before.
    datasets: tuple = ()
    # What the samples train (training/step/objective.py): images t2i, videos i2v with this probability, else t2v.
    objective: str = "modes"
    i2v_probability: float = 1.0
    # --buckets aspect: ((key, samples per epoch), ...) per batch key (media kind @ bucket); () with --buckets off.
    bucket_samples: tuple = ()
    # --resolution_stages (data/media/stages.py): the stages before the final size; the final (height, width, frames)
    stages: tuple = ()
    final_size: tuple = ()

    def __post_init__(self):
        if self.image_batch_size is None:
            object.__setattr__(self, "image_batch_size", self.batch_size)
        for name in ("repeat", "world_size", "batch_size", "gradient_accumulation", "num_epochs", "image_batch_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.rows < 0 or not 0 <= self.images <= self.rows:
            raise ValueError(f"rows must not be negative and images at most rows, got {self.rows}, {self.images}")

    @property
    def videos(self) -> int:
        return self.rows - self.images

    def _samples(self, kind: str) -> int:
        if not self.datasets:
            return (self.images if kind == "images" else self.videos) * self.repeat
        return sum(getattr(d, kind) * d.repeat for d in self.datasets) * self.repeat

    @property
    def samples_per_epoch(self) -> int:
        return self._samples("videos") + self._samples("images")

    @property
    def modes_per_epoch(self) -> dict:
        """Samples of each training mode per epoch, all ranks together (i2v/t2v expected when drawn)."""
        return modes_per_epoch(self.objective, self.i2v_probability, self._samples("videos"),
                               self._samples("images"))

    @property
    def samples_per_rank_per_epoch(self) -> int:
        if self.bucket_samples:   # with the samples repeated to fill each bucket's batches and GPU groups
            return sum(row["batches_per_gpu"] * row["batch_size"] for row in self.bucket_dicts())
        return _ceil_div(self.samples_per_epoch, self.world_size)

    @property
    def batches_per_epoch(self) -> int:
        """Batches each rank loads per epoch (what len() of the prepared data loader says)."""
        if self.bucket_samples:
            return sum(_ceil_div(_ceil_div(samples, self.key_batch_size(key)), self.world_size)
                       for key, samples in self.bucket_samples)
        video_batches = _ceil_div(self._samples("videos"), self.batch_size)
        image_batches = _ceil_div(self._samples("images"), self.image_batch_size)
        return _ceil_div(video_batches + image_batches, self.world_size)

    def key_batch_size(self, key: str) -> int:
        return self.image_batch_size if media_kind(key) == "image" else self.batch_size

    def bucket_dicts(self) -> list[dict]:
        """Each bucket key's samples per epoch, batches per GPU and samples repeated to keep every GPU on one
        bucket at a time."""
        rows = []
        for key, samples in self.bucket_samples:
            size = self.key_batch_size(key)
            groups = _ceil_div(_ceil_div(samples, size), self.world_size)
            rows.append({"key": key, "samples_per_epoch": samples, "batch_size": size, "batches_per_gpu": groups,
                         "repeated_samples": groups * self.world_size * size - samples})
        return rows

    @property
    def steps_per_epoch(self) -> int:
        """Optimizer steps each rank takes per epoch."""
        return _ceil_div(self.batches_per_epoch, self.gradient_accumulation)

    @property
    def total_steps(self) -> int:
        return self.steps_per_epoch * self.num_epochs

    @property
    def effective_batch(self) -> int:
        """Samples per optimizer step across all ranks."""
        return self.world_size * self.batch_size * self.gradient_accumulation

    def dataset_dicts(self) -> list[dict]:
        """Each catalogue's rows and samples per epoch (with ``repeat`` applied), for the plan and status files."""
        return [{"name": d.name, "rows": d.videos + d.images, "videos": d.videos, "images": d.images,
                 "repeat": d.repeat, "samples_per_epoch": (d.videos + d.images) * d.repeat * self.repeat}
                for d in self.datasets]

    def as_dict(self) -> dict:
        plan = asdict(self)
        if self.datasets:
            plan["datasets"] = self.dataset_dicts()
        else:
            plan.pop("datasets")   # one catalogue: the plan reads as it always did
        if self.bucket_samples:
            plan["bucket_samples"] = self.bucket_dicts()
        else:
            plan.pop("bucket_samples")   # --buckets off: the plan reads as it always did
        plan.pop("final_size")
        if self.stages:
            plan["stages"] = self.stage_dicts()
        else:
            plan.pop("stages")   # no stages: the plan reads as it always did
        return {**plan, "samples_per_epoch": self.samples_per_epoch,
                "samples_per_rank_per_epoch": self.samples_per_rank_per_epoch,
                "batches_per_epoch": self.batches_per_epoch, "steps_per_epoch": self.steps_per_epoch,
                "total_steps": self.total_steps, "effective_batch": self.effective_batch,
                "modes_per_epoch": self.modes_per_epoch}

    def describe(self) -> str:
        kinds = f" ({self.videos:,} videos + {self.images:,} images)" if self.images else ""
        batch = (f"batches of {self.batch_size} videos / {self.image_batch_size} images" if self.images
                 else f"batch {self.batch_size}")
        repeat = f"repeat {self.repeat}" if not self.datasets else "repeats (" + ", ".join(
            f"{d['name']}: {d['rows']:,} x {d['repeat'] * self.repeat}" for d in self.dataset_dicts()) + ")"
        return (f"{self.rows:,} rows{kinds} x {repeat} = {self.samples_per_epoch:,} samples/epoch; "
                f"{self.world_size} GPU(s) -> {self.samples_per_rank_per_epoch:,} samples per GPU per epoch; "
                f"{batch} x accumulation {self.gradient_accumulation} -> "
                f"{self.steps_per_epoch:,} optimizer steps per GPU per epoch; "
                f"{self.num_epochs} epoch(s) -> {self.total_steps:,} steps in total (per GPU); "
                f"{self.describe_modes()}")

    def describe_buckets(self) -> list[str]:
        """The bucket lines of the printed plan (none with --buckets off)."""
        if not self.bucket_samples:
            return []
        rows = self.bucket_dicts()
        repeated = sum(row["repeated_samples"] for row in rows)
        lines = [f"buckets (aspect): {len(rows)} in use; every GPU trains one bucket at a time; "
                 f"{repeated:,} sample(s) repeated per epoch to fill the last batch and GPU group of each bucket"]
        for row in rows:
            kind, _, bucket = row["key"].partition("@")
            lines.append(f"  {bucket:>11} {kind + 's':<6} {row['samples_per_epoch']:>8,} samples/epoch "
                         f"{row['batches_per_gpu']:>7,} batches/GPU of {row['batch_size']}"
                         + (f" (+{row['repeated_samples']} repeated)" if row["repeated_samples"] else ""))
        return lines + self._single_shape_note(rows)

    @staticmethod
    def _single_shape_note(rows: list[dict]) -> list[str]:
        """At a small area every aspect rounds to one shape: say that every sample, portrait too, is cropped to it."""
        from diffsynth_mbc.data.media.buckets import bucket_of_key, bucket_set

        shapes = {bucket_of_key(row["key"]) for row in rows} - {None}
        if len(shapes) != 1:
            return []
        shape, = shapes
        if len(bucket_set(shape.height, shape.width)) != 1:
            return []
        return [f"  note: at {shape.width}x{shape.height} the aspect buckets hold this one shape: every sample, "
                "portrait and landscape alike, is cropped to it (a larger --height x --width has a bucket per aspect)"]

    def describe_modes(self) -> str:
        return describe_modes(self.objective, self.i2v_probability, self.modes_per_epoch)

    def stage_dicts(self, total_steps: int | None = None, ends: list[int] | None = None) -> list[dict]:
        """Each stage: its size, its optimizer steps (1-based, inclusive) and a clip's tokens there; the boundaries
        ``ends`` where given (the training's, ``training/components/stages.py``), else from ``total_steps``, else
        from the plan's total."""
        from diffsynth_mbc.data.media.stages import boundaries
        from diffsynth_mbc.training.plan.memory import tokens

        height, width, frames = self.final_size
        sizes = [(s.height, s.width, s.num_frames or frames) for s in self.stages] + [(height, width, frames)]
        out, start = [], 0
        if ends is None:
            ends = boundaries(self.stages, self.total_steps if total_steps is None else total_steps)
        for index, (end, (h, w, f)) in enumerate(zip(ends, sizes)):
            out.append({"stage": index + 1, "size": f"{w}x{h}x{f}", "height": h, "width": w, "num_frames": f,
                        "from_step": start + 1, "to_step": end, "steps": end - start, "tokens": tokens(h, w, f)})
            start = end
        return out

    def describe_stages(self) -> list[str]:
        """The stage lines of the printed plan (none without --resolution_stages)."""
        return [f"stage {row['stage']}/{len(self.stages) + 1}: {row['size']}"
                + (" (the final size)" if row["stage"] == len(self.stages) + 1 else "")
                + f", {step_span(row['from_step'], row['to_step'])} ({step_count(row['steps'])}), "
                  f"{row['tokens']:,} tokens a clip"
                for row in self.stage_dicts()] if self.stages else []


def step_span(first: int, last: int) -> str:
    """``steps 1-40``; one step: ``step 7``."""
    return f"step {first:,}" if first == last else f"steps {first:,}-{last:,}"


def step_count(steps: int) -> str:
    """``40 steps``; ``1 step``."""
    return f"{steps:,} step{'' if steps == 1 else 's'}"


def plan_from_options(options, *, rows: int, images: int, world_size: int, datasets: tuple = (),
                      gradient_accumulation: int | None = None, bucket_samples: tuple = ()) -> StepPlan:
    """The run's step plan from its options and its catalogue's counts: what the training, the launcher's plan and
    the status files all print (images batched by ``--image_batch_size``, by default one video's tokens). An epoch
    above ``MAX_SAMPLES_PER_EPOCH`` samples is refused (OptionsError naming the catalogue and the limit), and so is
    a ``--resolution_stages`` stage that gets no optimizer step of the plan's total (naming it)."""
    from diffsynth_mbc.data.dataset_list import check_epoch_size
    from diffsynth_mbc.training.plan.batches import default_image_batch_size
    from diffsynth_mbc.data.media.stages import check_steps

    image_batch = options.image_batch_size or default_image_batch_size(options.batch_size, options.num_frames)
    check_epoch_size([(f"datasets[{position}] ({count.name})", count.videos + count.images, count.repeat)
                      for position, count in enumerate(datasets)] if datasets else
                     [(f"--dataset_metadata_path {options.dataset_metadata_path}", rows, 1)],
                     options.dataset_repeat)
    plan = StepPlan(rows=rows, repeat=options.dataset_repeat, world_size=world_size, batch_size=options.batch_size,
                    gradient_accumulation=gradient_accumulation or options.gradient_accumulation_steps,
                    num_epochs=options.num_epochs, images=images, image_batch_size=image_batch, datasets=datasets,
                    objective=options.objective, i2v_probability=options.i2v_probability,
                    bucket_samples=tuple(bucket_samples), stages=tuple(options.resolution_stages),
                    final_size=(options.height, options.width, options.num_frames))
    check_steps(plan.stages, plan.total_steps, f"{options.width}x{options.height}x{options.num_frames}")
    return plan


def bucket_samples_of_metadata(options) -> tuple:
    """``--buckets aspect``: each batch key's samples per epoch, read from the metadata before any dataset opens
    (the launcher's plan, the doctor), keyed as the training's dataset keys them; () with ``off``."""
    if options.buckets != "aspect":
        return ()
    from diffsynth_mbc.data.dataset_list import row_repeats
    from diffsynth_mbc.data.media.row_buckets import keys_of_sizes
    from diffsynth_mbc.training.plan.batches import key_samples

    rows, sizes = sized_rows_of_metadata(options)
    keys = keys_of_sizes(rows, sizes, options.height, options.width)
    repeats = row_repeats(options.datasets, [int(row["dataset"]) for row in rows]) if options.datasets else None
    return tuple(key_samples(keys, options.dataset_repeat, repeats).items())


_SIZED_ROWS: dict = {}   # (metadata, its size and mtime, base path, output path): (rows, their sizes)


def sized_rows_of_metadata(options) -> tuple[list[dict], list]:
    """The metadata's rows and each row's size (the run's size table, ``row_buckets.row_sizes``), read once per
    command for this metadata file: the plan, the doctor's checks and its projections at each stage's size all use
    them (a pass over 170,000 files is seconds). MetadataError for a size column that is wrong."""
    from diffsynth_mbc.data.media.row_buckets import row_sizes
    from diffsynth_mbc.data.media.size_table import table_path_in
    from diffsynth_mbc.data.metadata_csv import read_metadata

    path = options.dataset_metadata_path
    info = os.stat(path)
    key = (path, info.st_size, info.st_mtime_ns, options.dataset_base_path, options.output_path)
    if key not in _SIZED_ROWS:
        rows = list(read_metadata(path))
        _SIZED_ROWS[key] = (rows, row_sizes(rows, options.dataset_base_path,
                                            table_path=table_path_in(options.output_path)))
    return _SIZED_ROWS[key]


def steps_from_loader(batches_per_epoch: int, gradient_accumulation: int, num_epochs: int) -> tuple[int, int]:
    """(steps_per_epoch, total_steps) from the length of the already-sharded data loader."""
    steps_per_epoch = _ceil_div(batches_per_epoch, gradient_accumulation)
    return steps_per_epoch, steps_per_epoch * num_epochs


def lr_factor(step: int, total_steps: int, warmup_steps: int = 0, schedule: str = "constant",
              min_factor: float = 0.0) -> float:
    """Multiplier of the base learning rate before optimizer step ``step`` (0-based).

    Linear warm-up from 1/(warmup+1) to 1 over ``warmup_steps`` steps, then constant, or cosine
    down to ``min_factor`` at ``total_steps``.
    """
    if schedule not in ("constant", "cosine"):
        raise ValueError(f"unknown lr schedule {schedule!r}; use 'constant' or 'cosine'")
    if warmup_steps > 0 and step < warmup_steps:
        return (step + 1) / (warmup_steps + 1)
    if schedule == "constant":
        return 1.0
    decay_steps = max(1, total_steps - warmup_steps)
    progress = min(1.0, max(0.0, (step - warmup_steps) / decay_steps))
    return min_factor + (1.0 - min_factor) * 0.5 * (1.0 + math.cos(math.pi * progress))
