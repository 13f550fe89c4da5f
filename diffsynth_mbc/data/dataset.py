"""The MBC dataset adapter: DiffSynth's own VideoDataset over the converter's metadata.

One file column (``video``) holds videos and images (images load as 1-frame clips). A file that
cannot be decoded raises MediaDecodeError naming the metadata row and the file, instead of an
anonymous decoder error (or DiffSynth's silent ``None`` for an unknown extension).

Images load as DiffSynth loads them, except 16-bit greyscale (a 16-bit PNG opens in PIL's mode ``I;16``),
which PIL's ``convert("RGB")`` clips at 255 (a gradient trains as a white frame): it is scaled to 8 bits.

With ``substitute_bad_media`` a bad file is replaced by the next decodable row (deterministically,
so a resumed run sees the same data) and the sample carries ``skipped``: one record per bad file,
which the training loop counts and reports.

``frames`` (a ``FrameSelection``: --frame_sampling, --source_fps, --short_clips) picks which frames of a clip
train; its default is DiffSynth's (the first ``num_frames``), read exactly as before. A sample index carries its
epoch (the batch sampler adds ``epoch x len(dataset)``), so a random window is drawn per (seed, epoch, sample)
in whichever worker process loads it. A clip too short under ``--short_clips skip`` is bad media like an
undecodable file.
``buckets="aspect"`` (``data/media/buckets.py``) resizes each row to cover the bucket nearest its aspect instead of
``height x width`` (``row_buckets``: sizes from the run's size table, ``size_table``, or ``read_sizes``: the
training's rank 0 reads them and every rank takes rank 0's); a row's batch key then names its bucket
(``video@1280x704``), so a batch holds one shape.
``caption_prefix`` / ``caption_suffix`` (a trigger word) are joined to every caption when the metadata is read
(``caption_rules.with_affixes``), so training, validation and the latent cache all see the same prompt.
``stages`` (``--resolution_stages``, ``data/media/stages.py``): an index ``(index, stage)`` loads at that stage's
size (and frames).

DiffSynth's loaders read what they load by from the dataset's attributes (``num_frames``, ``get_height_width``), so
each item is loaded by a view of the dataset that carries that item's settings (its stage, bucket and random-window
draw: ``for_item``); the dataset itself never changes while it loads.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import io
import itertools
import os

import numpy as np
from diffsynth.trainers.utils import VideoDataset
from PIL import Image

from diffsynth_mbc.data.caption_rules import with_affixes
from diffsynth_mbc.data.media.clip_reader import (DECODERS, ReferenceReaderNeeded, read_leading_frames,
                                                  read_selected_frames)
from diffsynth_mbc.data.media.frame_selection import FrameSelection, ShortClip, select_frames
from diffsynth_mbc.data.media.buckets import sample_key
from diffsynth_mbc.data.media.orientation import upright
from diffsynth_mbc.data.media.row_buckets import buckets_of_sizes, row_sizes
from diffsynth_mbc.data.media.shapes import shape_key
from diffsynth_mbc.data.sample_draws import sample_place

MAX_CONSECUTIVE_BAD_ROWS = 20


class MediaDecodeError(RuntimeError):
    pass


# PIL's modes of 16-bit greyscale (PNG, TIFF); "I" is what older Pillow releases open a 16-bit PNG as.
_SIXTEEN_BIT_MODES = frozenset({"I;16", "I;16B", "I;16L", "I;16N", "I"})


def rgb_image(image: Image.Image) -> Image.Image:
    """``image`` as 8-bit RGB: PIL's ``convert("RGB")``, but 16-bit greyscale is scaled from 0..65535 to 0..255
    (rounded) instead of clipped at 255."""
    if image.mode not in _SIXTEEN_BIT_MODES:
        return image.convert("RGB")
    values = np.asarray(image).astype(np.int64)
    grey = np.clip((values * 255 + 32767) // 65535, 0, 255).astype(np.uint8)
    return Image.fromarray(grey, mode="L").convert("RGB")


_NOTICES_SHOWN: set[str] = set()


def _print_once(text: str) -> None:
    """DiffSynth's notices, once per process and only on the first rank."""
    for line in text.splitlines():
        if line and line not in _NOTICES_SHOWN and os.environ.get("RANK", "0") == "0":
            print(line)
        _NOTICES_SHOWN.add(line)


class MBCVideoDataset(VideoDataset):
    def __init__(self, base_path: str, metadata_path: str, num_frames: int, height: int, width: int,
                 repeat: int = 1, substitute_bad_media: bool = False, decoder: str = "fast",
                 frames: FrameSelection | None = None,
                 caption_prefix: str = "", caption_suffix: str = "", buckets: str = "off",
                 size_table: str | None = None, read_sizes=None, stages: tuple = ()):
        notices = io.StringIO()
        with contextlib.redirect_stdout(notices):   # DiffSynth prints a notice per dataset and rank
            super().__init__(base_path=base_path, metadata_path=metadata_path, num_frames=num_frames,
                             height=height, width=width, data_file_keys=("video",), repeat=repeat)
        _print_once(notices.getvalue())
        if decoder not in DECODERS:
            raise ValueError(f"unknown decoder {decoder!r}; choose one of {', '.join(DECODERS)}")
        self.substitute_bad_media = substitute_bad_media
        self.decoder = decoder
        self.frames = frames or FrameSelection()
        self.draw = (0, 0)   # an item's view: (epoch, sample in epoch) of the row it loads, random_window's draw
        self.epoch_span: int | None = None   # the loader's indices per epoch (the batch sampler's; default len)
        kinds = [shape_key(row.get("media_type"), row.get("video")) for row in self.data]
        self.buckets = buckets
        # Under aspect buckets each row's size as displayed (None: unreadable), kept for the checkpoint to compare
        self.row_sizes = ((read_sizes or functools.partial(row_sizes, base_path=base_path, table_path=size_table))(
            self.data) if buckets == "aspect" else None)
        self.row_buckets = (buckets_of_sizes(self.row_sizes, height, width) if buckets == "aspect"
                            else [None] * len(self.data))
        self._keys = [sample_key(kind, bucket) for kind, bucket in zip(kinds, self.row_buckets)]
        self.bucket = None   # an item's view: the bucket of the row it loads (get_height_width)
        self.stages, self.final_num_frames = tuple(stages), num_frames
        self.stage = len(self.stages)   # an item's view: its stage (len(stages): the final size)
        if caption_prefix or caption_suffix:   # the trigger word: what trains (and what the cache encodes)
            for row in self.data:
                if isinstance(row.get("prompt"), str):
                    row["prompt"] = with_affixes(row["prompt"], caption_prefix, caption_suffix)

    def sized_rows(self) -> list:
        """(video, size) of every row (a checkpoint keeps them); each size None under ``--buckets off``."""
        sizes = self.row_sizes if self.row_sizes is not None else [None] * len(self.data)
        return [(str(row.get("video")), size) for row, size in zip(self.data, sizes)]

    def load_video(self, file_path):
        """``fast``: only the frames that train, decoded in-process (clip_reader); the same frames, resized
        and cropped by DiffSynth's own ``crop_and_resize``. ``diffsynth``: DiffSynth's reader. GIFs: DiffSynth's
        (their leading frames, whatever ``frames`` says)."""
        if not self.frames.is_default and not file_path.lower().endswith(".gif"):
            return self._load_selected(file_path)
        if self.decoder == "diffsynth" or file_path.lower().endswith(".gif"):
            return super().load_video(file_path)
        try:
            frames = read_leading_frames(file_path, self.num_frames, self.time_division_factor,
                                         self.time_division_remainder)
        except ReferenceReaderNeeded:   # variable frame rate, > 8 bits, a mirrored picture: DiffSynth's reader
            return super().load_video(file_path)
        return [self.crop_and_resize(frame, *self.get_height_width(frame)) for frame in frames]

    def _load_selected(self, file_path):
        """The frames ``self.frames`` picks, through the fast reader, or DiffSynth's reader (imageio) where the fast
        one cannot match it or ``decoder`` is ``diffsynth``: the same frame indices either way."""
        epoch, sample = self.draw
        frames = None
        if self.decoder == "fast":
            try:
                frames = read_selected_frames(file_path, self.num_frames, self.frames, epoch=epoch, sample=sample,
                                              division=self.time_division_factor,
                                              remainder=self.time_division_remainder)
            except ReferenceReaderNeeded:
                frames = None
        if frames is None:
            frames = self._reference_selected(file_path, epoch, sample)
        return [self.crop_and_resize(frame, *self.get_height_width(frame)) for frame in frames]

    def _reference_selected(self, file_path, epoch: int, sample: int) -> list:
        """DiffSynth's reader (imageio-ffmpeg: count the frames, then read them by index) at the selected indices."""
        import imageio

        reader = imageio.get_reader(file_path)
        try:
            count = int(reader.count_frames())
            fps = reader.get_meta_data().get("fps")
            indices = select_frames(count, fps, self.num_frames, self.frames, epoch=epoch, sample=sample,
                                    division=self.time_division_factor, remainder=self.time_division_remainder)
            images = {index: Image.fromarray(reader.get_data(index)) for index in sorted(set(indices))}
        finally:
            reader.close()
        return [images[index] for index in indices]

    def load_image(self, file_path):
        """DiffSynth's ``load_image`` (a 1-frame clip, resized and cropped), with 16-bit greyscale scaled, not
        clipped (``rgb_image``)."""
        with Image.open(file_path) as opened:
            image = rgb_image(upright(opened))   # its EXIF orientation applied: what the contact sheet shows
        return [self.crop_and_resize(image, *self.get_height_width(image))]

    def get_height_width(self, image):
        """The size a frame is resized to cover and centre-cropped to: the row's bucket (at a lower stage, scaled
        to its area), else DiffSynth's."""
        if self.stage < len(self.stages):
            from diffsynth_mbc.data.media.stages import stage_shape

            final = (self.bucket.height, self.bucket.width) if self.bucket is not None else (self.height, self.width)
            return stage_shape(self.stages[self.stage], *final, self.buckets, (self.height, self.width))
        if self.bucket is not None:
            return self.bucket.height, self.bucket.width
        return super().get_height_width(image)

    @property
    def rows(self) -> int:
        return len(self.data)

    def batch_keys(self) -> list[str]:
        """Each row's shape key (``video`` or ``image``, ``@bucket`` with buckets): samples are batched only with
        samples of their key."""
        return list(self._keys)

    def _replacement_rows(self, row: int):
        """``row``, then the following rows of its shape key (a replacement joins that row's batch), then, when
        every row of that shape fails, the following rows of any shape (the module runs a batch of mixed shapes
        one forward per shape); at most MAX_CONSECUTIVE_BAD_ROWS in all."""
        rows, key = len(self.data), self._keys[row]
        order = ((row + offset) % rows for offset in range(rows))
        same = (r for r in order if self._keys[r] == key)
        other = (r for r in ((row + offset) % rows for offset in range(rows)) if self._keys[r] != key)
        return itertools.islice(itertools.chain(same, other), MAX_CONSECUTIVE_BAD_ROWS)

    def for_item(self, row: int, stage: int | None, draw: tuple[int, int]) -> "MBCVideoDataset":
        """A view of this dataset that loads ``row`` at ``stage`` (None: the final size) with the random window's
        ``draw``: a shallow copy (the metadata and everything else shared) with the item's settings."""
        view = copy.copy(self)
        view.bucket, view.draw = self.row_buckets[row], draw
        view.stage = len(self.stages) if stage is None else stage
        chosen = self.stages[view.stage] if view.stage < len(self.stages) else None
        view.num_frames = chosen.num_frames if chosen is not None and chosen.num_frames else self.final_num_frames
        return view

    def load_row(self, row: int) -> dict:
        """Row ``row`` as a sample (on an item's view, ``for_item``: at its settings)."""
        file_name = self.data[row].get("video")
        try:
            sample = super().__getitem__(row)
        except ShortClip as exc:
            raise MediaDecodeError(f"metadata row {row + 1} ({file_name}): too short: {exc}") from exc
        except Exception as exc:
            raise MediaDecodeError(f"metadata row {row + 1} ({file_name}): cannot decode: "
                                   f"{type(exc).__name__}: {exc}") from exc
        if sample is None:
            raise MediaDecodeError(f"metadata row {row + 1} ({file_name}): not a video or image extension "
                                   "DiffSynth can load")
        sample["row"] = row + 1
        return sample

    def __getitem__(self, index) -> dict:
        index, stage = index if isinstance(index, tuple) else (index, None)
        row = index % len(self.data)
        # which epoch and which copy of the row (--dataset_repeat x its catalogue's repeat): each its own draw
        epoch, sample, copy_of_row = sample_place(index, self.epoch_span or len(self), len(self.data))
        if not self.substitute_bad_media:
            return self.for_item(row, stage, (epoch, sample)).load_row(row)
        skipped = []
        for candidate in self._replacement_rows(row):
            draw = (epoch, copy_of_row * len(self.data) + candidate)
            try:
                sample = self.for_item(candidate, stage, draw).load_row(candidate)
            except MediaDecodeError as exc:
                skipped.append({"row": candidate + 1, "file": self.data[candidate].get("video"), "reason": str(exc)})
                continue
            sample["skipped"] = skipped
            return sample
        raise MediaDecodeError(f"{len(skipped)} rows from metadata row {row + 1} on cannot be "
                               f"decoded; last: {skipped[-1]['reason']}")
