"""Training from the latent cache built by ``python -m diffsynth_mbc.cache``.

``CachedLatentDataset`` reads the cache's index and yields, per metadata row that was cached::

    {"cached": True, "input_latents": [C, F, H, W], "first_frame_latents": [C, 1, H, W],
     "context": [text_len, dim] (zeros after the real tokens, as the prompt encoder returns it),
     "prompt": str, "row": int (metadata row, 1-based as in MBCVideoDataset's samples and error messages),
     "file": str, "media_type": str,
     "height": int, "width": int, "num_frames": int}

``WanTI2VLoraModule`` turns such a sample into the DiT's inputs without the VAE or text encoder.
``open_training_dataset(options)`` picks the cache (``options.cache``) or the media files, and refuses a
cache built for another size, ``--buckets`` mode, metadata file or set of encoder weights, naming what differs.
With ``--buckets aspect`` each entry's latent has its row's bucket's shape, and ``batch_keys`` name that bucket.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from safetensors.torch import load_file

from diffsynth_mbc.data.cache.index import (
    CacheError,
    bucket_mode,
    demo_identity,
    file_sha256,
    model_dir_identities,
    read_index,
    stale_rows,
)
from diffsynth_mbc.data.caption_rules import caption_affixes
from diffsynth_mbc.data.media.frame_selection import frame_selection_from
from diffsynth_mbc.data.media.size_table import table_path_in
from diffsynth_mbc.data.media.stages import stage_names
from diffsynth_mbc.data.metadata_csv import read_metadata
from diffsynth_mbc.models.wan_units import pad_context
from diffsynth_mbc.run_layout import CACHE_FAILURES


class CacheMismatchError(CacheError):
    """The cache does not match the training options; the message lists every difference."""


class CachedLatentDataset(torch.utils.data.Dataset):
    def __init__(self, cache_dir: str | Path, repeat: int = 1, index: dict | None = None, stages: list | None = None):
        self.cache_dir = Path(cache_dir)
        self.index = read_index(cache_dir) if index is None else index
        self.settings = self.index["settings"]
        self.entries = self.index["rows"]
        self.text_len = int(self.settings["text_len"])
        self.repeat = repeat
        self._empty_context = None
        # --resolution_stages: the run's stage k is the cache's stage stages[k] (its entries follow its own order)
        self.stage_order = list(stages or [])

    @property
    def rows(self) -> int:
        return len(self.entries)

    def sized_rows(self) -> None:
        """The cache fixed every row's shape when it was built: a checkpoint keeps no media sizes."""
        return None

    def __len__(self) -> int:
        return len(self.entries) * self.repeat

    def empty_context(self):
        """The empty prompt's embedding [text_len, dim], as the prompt encoder returns it (for --caption_dropout);
        stored once per cache (``index["empty_prompt"]``), read on first use."""
        if self._empty_context is None:
            stored = self.index.get("empty_prompt")
            if stored is None:
                raise CacheError(f"the latent cache {self.cache_dir} holds no embedding of the empty prompt, which "
                                 "--caption_dropout trains on: rerun `python -m diffsynth_mbc.cache` with the same "
                                 "settings (it adds it; nothing else is encoded again)")
            row = {"row": "-", "file": "the empty prompt", **stored}
            self._empty_context = pad_context(self._load(stored["text"], row, "text_bytes")["context"],
                                              self.text_len)[0]
        return self._empty_context

    def batch_keys(self) -> list[str]:
        """Each row's shape key (``video`` or ``image``; with ``--buckets aspect`` ``@`` the bucket its latent was
        encoded at, ``video@1280x704``), as MBCVideoDataset keys the row: samples are batched only with samples of
        their key."""
        from diffsynth_mbc.data.media.buckets import Bucket, sample_key
        from diffsynth_mbc.data.media.shapes import shape_key

        aspect = bucket_mode(self.settings) == "aspect"
        return [sample_key(shape_key(row.get("media_type"), row.get("file")),
                           Bucket(row["latent_shape"][2] * 16, row["latent_shape"][3] * 16) if aspect else None)
                for row in self.entries]

    def _load(self, relative: str, row: dict, size_key: str) -> dict:
        path = self.cache_dir / relative
        rerun = "rerun `python -m diffsynth_mbc.cache` with the same settings: it encodes damaged entries again"
        try:
            size = path.stat().st_size
        except FileNotFoundError:
            raise CacheError(f"metadata row {row['row']} ({row['file']}): cache file {path} is missing; {rerun}") from None
        if size_key in row and size != row[size_key]:
            raise CacheError(f"metadata row {row['row']} ({row['file']}): cache file {path} has {size} bytes, the "
                             f"index says {row[size_key]} (truncated or replaced); {rerun}")
        try:
            return load_file(str(path))
        except Exception as exc:  # noqa: BLE001 - safetensors raises its own error types, naming no file
            raise CacheError(f"metadata row {row['row']} ({row['file']}): cache file {path} cannot be read "
                             f"({type(exc).__name__}: {exc}); {rerun}") from None

    def _entry(self, row: dict, stage: int | None) -> tuple[dict, str, list]:
        """(the tensors, their file, the shape the index says) of ``row`` at --resolution_stages' ``stage`` (None:
        the final size)."""
        stages = row.get("stage_entries") or []
        if stage is None or stage >= len(stages):
            return self._load(row["entry"], row, "entry_bytes"), row["entry"], row["latent_shape"]
        sized = {**row, "stage_bytes": row["stage_entry_bytes"][stage]}
        return self._load(stages[stage], sized, "stage_bytes"), stages[stage], row["stage_latent_shapes"][stage]

    def __getitem__(self, index) -> dict:
        index, stage = index if isinstance(index, tuple) else (index, None)   # (index, stage): a batch's stage
        stage = self.stage_order[stage] if stage is not None and stage < len(self.stage_order) else None
        row = self.entries[index % len(self.entries)]
        tensors, entry, shape = self._entry(row, stage)
        latents = tensors["input_latents"]
        if list(latents.shape) != list(shape):
            raise CacheError(f"metadata row {row['row']} ({row['file']}): {entry} holds a latent of "
                             f"shape {list(latents.shape)}, the index says {shape} (C, F, H, W)")
        first_frame = tensors.get("first_frame_latents")
        if first_frame is None:
            first_frame = latents[:, :1]
        context = pad_context(self._load(row["text"], row, "text_bytes")["context"], self.text_len)[0]
        factor = 16  # Wan2.2 VAE: 16x16 pixels per latent cell, 4 frames per latent frame after the first
        return {"cached": True, "input_latents": latents, "first_frame_latents": first_frame, "context": context,
                "prompt": row["prompt"], "row": row["row"], "file": row["file"], "media_type": row["media_type"],
                "height": latents.shape[2] * factor, "width": latents.shape[3] * factor,
                "num_frames": (latents.shape[1] - 1) * 4 + 1}


def stage_problems(settings: dict, options) -> list[str]:
    """--resolution_stages: the stage sizes the run trains at that the cache holds no latents for, named."""
    from diffsynth_mbc.data.media.stages import stage_names

    built = settings.get("stages") or []
    missing = [name for name in stage_names(options.resolution_stages) if name not in built]
    if not missing:
        return []
    return [f"it holds no latents for the stage(s) {', '.join(missing)} of --resolution_stages "
            f"{options.resolution_stages.text} (built for: {', '.join(built) or 'no stages'}); build it with the same "
            "--resolution_stages (python -m diffsynth_mbc.cache ...; the launchers' --cached does)"]


def check_cache_matches(index: dict, options, cache_dir, metadata_path=None, base_path=None) -> None:
    """Raise CacheMismatchError listing every way the cache differs from what the options ask for.

    ``metadata_path``/``base_path`` default to the training set's (``--dataset_metadata_path/_base_path``).
    """
    settings, metadata = index["settings"], index["metadata"]
    problems = []
    asked_sizes = {"height": options.height, "width": options.width, "num_frames": options.num_frames}
    sizes = [(key, settings[key], asked) for key, asked in asked_sizes.items()]
    if any(built != asked for _, built, asked in sizes):
        problems.append("it was built for " + ", ".join(f"{key} {built}" for key, built, _ in sizes)
                        + "; this run asks for " + ", ".join(f"{key} {asked}" for key, _, asked in sizes))
    problems += frame_problems(settings, options)
    if metadata_path is None:   # the training set's cache; validation stays at the final size
        problems += stage_problems(settings, options)
    built_buckets, asked_buckets = bucket_mode(settings), options.buckets
    if built_buckets != asked_buckets:
        problems.append(f"--buckets: the cache was built with {built_buckets}, this run asks for {asked_buckets} "
                        f"(rebuild the cache with --buckets {asked_buckets})")
    metadata_path = Path(metadata_path or options.dataset_metadata_path)
    if not metadata_path.is_file():
        problems.append(f"--dataset_metadata_path {metadata_path} does not exist")
    else:
        sha = file_sha256(metadata_path)
        if sha != metadata["sha256"]:
            problems.append(f"it was built from {metadata['path']} (sha256 {metadata['sha256'][:12]}, "
                            f"{metadata['rows']} rows); --dataset_metadata_path {metadata_path} differs "
                            f"(sha256 {sha[:12]})")
    base_path = str(Path(base_path or options.dataset_base_path).resolve())
    if base_path != metadata["base_path"]:
        problems.append(f"it was built with --dataset_base_path {metadata['base_path']}; this run has {base_path}")
    if options.demo:
        expected = demo_identity(options.seed)
        if settings["vae"] != expected or settings["text_encoder"] != expected:
            problems.append(f"it was encoded with {settings['vae']}; this run trains the demo model of "
                            f"--seed {options.seed} ({expected})")
    elif options.model_dir:
        identities = model_dir_identities(options.model_dir)
        differing = [name for name in ("vae", "text_encoder") if identities[name] != settings[name]]
        if differing:
            problems.append(f"its {' and '.join(differing)} weights are not the files in --model_dir "
                            f"{options.model_dir} (names, sizes or modification times differ: "
                            + ", ".join(f"{name} {settings[name][:19]} vs {identities[name][:19]}"
                                        for name in differing) + ")")
    elif str(settings["vae"]).startswith("demo-seed-"):
        problems.append(f"it was encoded by the demo model ({settings['vae']}); this run trains real weights")
    for key, asked in caption_affixes(options).items():   # caches built before these options had none
        built = settings.get(key, "")
        if built != asked:
            problems.append(f"its captions were encoded with --{key} {built!r}; this run has --{key} {asked!r}")
    if problems:
        raise CacheMismatchError(f"the latent cache {cache_dir} does not match this run: " + "; ".join(problems)
                                 + ". Rebuild it with `python -m diffsynth_mbc.cache` using these settings.")
    if not options.allow_stale_cache:
        described, count = stale_rows(index["rows"], base_path)
        if count:
            raise CacheMismatchError(f"{count} media file(s) changed since the latent cache {cache_dir} was built, so "
                                     f"their latents are stale: {'; '.join(described)}. Rerun `python -m "
                                     "diffsynth_mbc.cache` (it encodes changed files again) or pass "
                                     "--allow_stale_cache true to train on the old latents")
    if options.caption_dropout and "empty_prompt" not in index:
        raise CacheMismatchError(f"--caption_dropout {options.caption_dropout:g} trains on the empty prompt, whose "
                                 f"embedding the latent cache {cache_dir} does not hold (built by an older version): "
                                 "rerun `python -m diffsynth_mbc.cache` with the same settings (it adds it; nothing "
                                 "else is encoded again)")
    if not index["rows"]:
        raise CacheMismatchError(f"the latent cache {cache_dir} has no usable rows "
                                 f"({len(index['failed'])} failed; see its {CACHE_FAILURES})")


def frame_problems(settings: dict, options) -> list[str]:
    """How the cache's frames (--frame_sampling, --source_fps, --short_clips) differ from the run's."""
    selection = frame_selection_from(options)
    if selection.per_epoch:
        return ["--frame_sampling random_window draws its frames anew every epoch, and a latent cache holds one set "
                "of frames per clip (train from the media files, or use head or uniform)"]
    built, asked = settings.get("frames"), selection.settings()
    if built == asked:
        return []

    def described(frames):
        return "the first frames of each clip (head)" if frames is None else ", ".join(
            f"{key} {value}" for key, value in frames.items())
    return [f"its frames are {described(built)}; this run asks for {described(asked)}"]


def open_training_dataset(options, **media_options):
    """``CachedLatentDataset`` when ``options.cache`` is set (after checking it matches), else MBCVideoDataset.

    ``media_options`` go to MBCVideoDataset only (the cache holds no undecodable rows).
    """
    cache_dir = options.cache
    if not cache_dir:
        from diffsynth_mbc.data.dataset import MBCVideoDataset

        read_metadata(options.dataset_metadata_path, "--dataset_metadata_path")   # what pandas stops on, named
        return MBCVideoDataset(options.dataset_base_path, options.dataset_metadata_path,
                               decoder=options.decoder, frames=frame_selection_from(options),
                               **caption_affixes(options),
                               num_frames=options.num_frames, height=options.height, width=options.width,
                               repeat=options.dataset_repeat, buckets=options.buckets,
                               size_table=table_path_in(options.output_path),
                               stages=options.resolution_stages, **media_options)
    index = read_index(cache_dir)
    check_cache_matches(index, options, cache_dir)
    if options.model_id and not options.model_dir:
        print(f"note: the latent cache {cache_dir} cannot be checked against the weights of --model_id "
              f"{options.model_id}; it was encoded with VAE {index['settings']['vae'][:19]}", file=sys.stderr)
    if index["failed"]:
        print(f"note: {len(index['failed'])} of {index['metadata']['rows']} metadata rows are not in the latent "
              f"cache (they could not be decoded; see {Path(cache_dir) / CACHE_FAILURES}); training on "
              f"{len(index['rows'])} rows", file=sys.stderr)
    built = index["settings"].get("stages") or []
    stages = [built.index(name) for name in stage_names(options.resolution_stages)]
    return CachedLatentDataset(cache_dir, repeat=options.dataset_repeat, index=index, stages=stages)


def open_validation_dataset(options, **media_options):
    """The validation set: ``CachedLatentDataset(options.val_cache)`` (checked against --val_metadata_path),
    else MBCVideoDataset over --val_metadata_path, which needs the encoders: refused when training from
    ``options.cache``, since the VAE and text encoder are then not loaded."""
    base_path = options.val_base_path or options.dataset_base_path
    val_cache = options.val_cache
    if val_cache:
        index = read_index(val_cache)
        check_cache_matches(index, options, val_cache, metadata_path=options.val_metadata_path, base_path=base_path)
        return CachedLatentDataset(val_cache, index=index)
    if options.cache:
        raise CacheMismatchError(f"--val_metadata_path {options.val_metadata_path} needs the VAE and text encoder, "
                                 "which are not loaded when training from --cache: build a cache of the validation "
                                 "metadata with `python -m diffsynth_mbc.cache` and pass it as --val_cache")
    from diffsynth_mbc.data.dataset import MBCVideoDataset

    read_metadata(options.val_metadata_path, "--val_metadata_path")   # what pandas stops on, named
    return MBCVideoDataset(base_path, options.val_metadata_path, num_frames=options.num_frames,
                           decoder=options.decoder, frames=frame_selection_from(options),
                           **caption_affixes(options),
                           height=options.height, width=options.width, buckets=options.buckets,
                           size_table=table_path_in(options.output_path), **media_options)
