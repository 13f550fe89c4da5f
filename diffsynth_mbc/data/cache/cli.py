"""Encode once: VAE latents and text embeddings of every metadata row, for training the DiT from a cache.

    accelerate launch --config_file configs/accelerate/ddp.yaml -m diffsynth_mbc.cache \\
        --dataset_base_path data/mbc --dataset_metadata_path data/mbc/metadata.csv \\
        --height 704 --width 1280 --num_frames 17 --model_dir models/Wan2.2-TI2V-5B --cache_dir cache/mbc-704x1280x17

(``python -m diffsynth_mbc.cache ...`` for one process.) Rank r of W encodes rows r, r+W, ... through
DiffSynth's own pipeline units, the ones training runs on every step: the clip through the units
without the prompt encoder (noise, VAE encode, TI2V first-frame fusion) and the caption through
``WanVideoUnit_PromptEmbedder`` alone. Only the VAE and the text encoder are loaded, never the DiT.

Layout of ``--cache_dir``::

    entries/ab/<entry key>.safetensors   input_latents [C, F, H, W] (+ first_frame_latents [C, 1, H, W]
                                         only where it differs from input_latents[:, :1])
    text/cd/<text key>.safetensors       context [tokens, dim]: the real tokens only, no padding
    shards/rank-0000r-of-0000W.json      what rank r did (rows, failures, counts)
    cache.json                           the index: settings, metadata identity, row -> entry/text/shapes
    failures.csv                         rows whose media could not be read, with the reason
    summary.json                         counts, bytes, bytes/sample and the projection to 1280x704x17

Started as ``python -m diffsynth_mbc.cache``, every rank writes ``training_gpu{rank}.json`` into ``--log_dir`` (default CACHE_DIR/logs; the launchers pass the
training's log folder) with status ``caching``: rows done/total of its share, rows/s, ETA, failures, rewritten at
most every 5 s, so ``python -m diffsynth_mbc.monitor LOG_DIR`` and the dashboard show the build like training
(and call a silent rank stalled); the training that follows replaces these files with its own.

An entry key is the sha256 of what determines the latent: the media file (resolved path, size, mtime),
height, width, frames, the VAE's identity and the dtype, and with ``--buckets aspect`` the row's bucket: each
entry's latent is encoded at its bucket's shape (the training's ``--buckets``, recorded in the index's settings).
A text key is the sha256 of the caption (with --caption_prefix / --caption_suffix joined to it), the text
encoder's identity (with the tokenizer), text_len
and the dtype; a caption shared by several rows is stored once, and so is the empty prompt (what the training's
--caption_dropout trains on; ``empty_prompt`` in the index). Every file is written to a temp name and renamed
into place, so an entry that exists is complete: a second run skips it, a killed run resumes, and a changed
setting gives new keys.

Exit codes: 0 done (rows that could not be decoded are listed in failures.csv, not fatal), 1 failed,
2 bad options or model files.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from diffsynth_mbc import environment
from diffsynth_mbc.atomic import atomic_write_json
from diffsynth_mbc.data.cache.build import (
    Ranks,
    describe,
    encode_shard,
    merge,
    shard_path,
    wait_for_shards,
)
from diffsynth_mbc.data.cache.encoder import resolve_model_id_files
from diffsynth_mbc.data.cache.index import (
    DTYPES,
    CacheError,
    demo_identity,
    encoder_identities,
    file_sha256,
)
from diffsynth_mbc.data.caption_rules import caption_affixes, check_caption_options
from diffsynth_mbc.data.media.buckets import BUCKET_MODES
from diffsynth_mbc.data.media.clip_reader import DECODERS
from diffsynth_mbc.data.media.frame_selection import frame_selection_from
from diffsynth_mbc.data.media.row_buckets import row_sizes
from diffsynth_mbc.data.media.size_table import first_rank_reads, table_path_in
from diffsynth_mbc.data.media.stages import parse_stages, stage_names
from diffsynth_mbc.data.metadata_csv import read_metadata
from diffsynth_mbc.errors import MetadataError
from diffsynth_mbc.flags import FlagParser
from diffsynth_mbc.run_layout import CACHE_FAILURES, CACHE_LOGS, SIZE_TABLE, STATUS_FILE, STATUS_FILE_GLOB

# ---------------------------------------------------------------------------------------------
# Options


def build_parser() -> argparse.ArgumentParser:
    parser = FlagParser(
        allow_abbrev=False,
        prog="python -m diffsynth_mbc.cache",
        description="Encode every metadata row once (VAE latents + text embeddings) for training the DiT "
                    "from the cache. Start it with `accelerate launch` to shard the rows over GPUs and nodes.")
    parser.add_argument("--dataset_base_path", required=True, help="folder the metadata paths are relative to")
    parser.add_argument("--dataset_metadata_path", required=True, help="metadata.csv from diffsynth_mbc.convert")
    parser.add_argument("--height", type=int, default=704, help="training height (multiple of 32; default 704)")
    parser.add_argument("--width", type=int, default=1280, help="training width (multiple of 32; default 1280)")
    parser.add_argument("--num_frames", type=int, default=17, help="frames per clip, 4k+1 (default 17)")
    parser.add_argument("--cache_dir", required=True, help="where entries, text embeddings and the index go")
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--model_dir", help="local Wan2.2-TI2V-5B folder (only T5, VAE and tokenizer are read)")
    source.add_argument("--model_id", help="ModelScope id to download from (e.g. Wan-AI/Wan2.2-TI2V-5B)")
    source.add_argument("--demo", action="store_true", help="the tiny random demo model (fixed --seed)")
    parser.add_argument("--seed", type=int, default=42,
                        help="--demo only: the demo model's seed; must equal the training --seed (default 42)")
    parser.add_argument("--dtype", choices=sorted(DTYPES),
                        help="stored precision (default: bf16 on GPUs with native bf16, fp16 on older ones such as "
                             "the V100, fp32 on the CPU); match the training's --mixed_precision")
    parser.add_argument("--sample_prompts", help="the training's --sample_prompts FILE: also encode its prompts, so a "
                                                 "run from this cache can sample clips without the text encoder")
    parser.add_argument("--caption_prefix", default="", help="the training's --caption_prefix: text put before every "
                                                             "caption, with one space, before encoding (default none)")
    parser.add_argument("--caption_suffix", default="", help="the training's --caption_suffix (default none)")
    parser.add_argument("--dataset_num_workers", type=int, default=2, help="decoding worker processes per rank")
    parser.add_argument("--decoder", choices=DECODERS, default="fast",
                        help="fast: only the frames that train, in-process (PyAV; default); diffsynth: DiffSynth's reader")
    parser.add_argument("--frame_sampling", choices=("head", "uniform", "random_window"), default="head",
                        help="the training's --frame_sampling: head (default) or uniform (random_window is drawn per "
                             "epoch and is refused here)")
    parser.add_argument("--source_fps", type=float, help="the training's --source_fps (resample clips to this rate)")
    parser.add_argument("--short_clips", choices=("shorten", "loop", "skip"), default="shorten",
                        help=f"the training's --short_clips; skip lists short clips in {CACHE_FAILURES}")
    parser.add_argument("--buckets", choices=BUCKET_MODES, default="off",
                        help="the training's --buckets: off (every row resized to cover --height x --width and "
                             "centre-cropped; default) or aspect (each row at the bucket nearest its own aspect, at "
                             "about the same pixel area; each entry stored at its bucket's shape)")
    parser.add_argument("--resolution_stages", help="the training's --resolution_stages: each row is also encoded "
                                                    "at every stage's size (the shares do not change the latents)")
    parser.add_argument("--size_table", help="the media sizes table under --buckets aspect (each file's header read "
                                             f"once; default CACHE_DIR/{SIZE_TABLE}; the launchers give the "
                                             "training's)")
    parser.add_argument("--log_dir", help=f"where each rank writes its status file {STATUS_FILE} for "
                                          f"the monitor (default: CACHE_DIR/{CACHE_LOGS}; the launchers give the "
                                          "training's)")
    parser.add_argument("--run_id", help=f"the run id in the status files (default: ${environment.RUN_ID}, else "
                                          "time-based)")
    return parser


def parse_options(argv=None) -> argparse.Namespace:
    options = build_parser().parse_args(argv)
    for key, value in (("height", options.height), ("width", options.width)):
        if value < 32 or value % 32:
            raise CacheError(f"--{key} must be a positive multiple of 32, got {value}")
    if options.num_frames < 1 or options.num_frames % 4 != 1:
        raise CacheError(f"--num_frames must be 4k+1 (1, 5, 9, 13, 17, ...), got {options.num_frames}")
    if options.dataset_num_workers < 0:
        raise CacheError("--dataset_num_workers must not be negative")
    if options.frame_sampling == "random_window":
        raise CacheError("--frame_sampling random_window draws a clip's frames anew every epoch, and a latent cache "
                         "holds one set of frames per clip: cache with head or uniform, or train random_window from "
                         "the media files")
    try:
        options.frames = frame_selection_from(options)
    except ValueError as exc:
        raise CacheError(str(exc)) from None
    caption_problem = check_caption_options(vars(options))
    if caption_problem:
        raise CacheError(caption_problem)
    try:   # before any model loads: a quote never closed would stop DiffSynth's pandas with a bare traceback
        read_metadata(options.dataset_metadata_path, "--dataset_metadata_path")
    except OSError as exc:
        raise CacheError(f"--dataset_metadata_path {options.dataset_metadata_path}: cannot be read "
                         f"({exc.strerror or exc})") from None
    except MetadataError as exc:
        raise CacheError(str(exc)) from None
    return options


# ---------------------------------------------------------------------------------------------
# Command


def main(argv: list[str] | None = None, status_writer=None) -> int:
    """``status_writer``: the class that writes each rank's status file (``diffsynth_mbc.cache`` gives the training's
    ``RankStatusWriter``); None writes none."""
    from diffsynth_mbc.data.media.media_probe import quiet_pil_pixel_warnings

    quiet_pil_pixel_warnings()   # a large image would warn at every encode; the converter's --probe says it once
    try:
        options = parse_options(argv)
    except CacheError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    from diffsynth_mbc.errors import OptionsError
    from diffsynth_mbc.gpu import UnsupportedGpuError
    from diffsynth_mbc.models.model_files import ModelFileError

    from diffsynth_mbc.data.cache.status import CacheStatus, default_log_dir, default_run_id

    ranks = Ranks()
    status = None
    if status_writer is not None:
        log_dir = options.log_dir or default_log_dir(options.cache_dir)
        status = CacheStatus(status_writer, log_dir, options.run_id or default_run_id(), ranks.rank, ranks.local_rank,
                             ranks.world_size, options.cache_dir)
        if ranks.rank == 0:
            print(f"status: {log_dir}/{STATUS_FILE_GLOB}   watch: python -m diffsynth_mbc.monitor {log_dir}",
                  file=sys.stderr, flush=True)
    try:
        return run(options, ranks, status)
    except (CacheError, ModelFileError, UnsupportedGpuError, OptionsError) as exc:
        if status is not None:
            status.fail(exc)
        print(f"[rank {ranks.rank}] error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        if status is not None:
            status.stopped()
        print(f"[rank {ranks.rank}] stopped; finished entries are kept, a rerun resumes", file=sys.stderr)
        return 130
    except Exception as exc:  # noqa: BLE001 - reported with its traceback
        if status is not None:
            status.fail(exc)
        import traceback

        traceback.print_exc()
        print(f"[rank {ranks.rank}] failed: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    finally:
        if status is not None:
            status.close()
        ranks.close()


def default_dtype(capability: tuple[int, int] | None) -> str:
    """The cache's precision when --dtype is not given: what the training's --mixed_precision auto picks."""
    if capability is None:
        return "fp32"
    return "bf16" if tuple(capability) >= (8, 0) else "fp16"


def run(options, ranks: Ranks, status=None) -> int:
    import torch

    from diffsynth_mbc.data.dataset import MBCVideoDataset

    started = time.monotonic()
    from diffsynth_mbc.gpu import require_supported_gpu, torch_dtype as dtype_of

    require_supported_gpu()   # a torch build without this GPU's kernels: stop now, naming the fix
    sample_prompts = None
    if options.sample_prompts:   # a bad prompt file stops before hours of encoding, not after
        from diffsynth_mbc.sample_prompts import load_sample_prompts
        sample_prompts = load_sample_prompts(options.sample_prompts, height=options.height, width=options.width,
                                             num_frames=options.num_frames, seed=options.seed)
    use_cuda = torch.cuda.is_available()
    device = f"cuda:{ranks.local_rank}" if use_cuda else "cpu"
    dtype_name = options.dtype or default_dtype(torch.cuda.get_device_capability(ranks.local_rank) if use_cuda else None)
    torch_dtype = dtype_of(dtype_name)
    cache_dir = Path(options.cache_dir)
    ranks.start(use_cuda)

    model_files, identities, text_len = identify_encoders(options, ranks, status)
    settings = {"height": options.height, "width": options.width, "num_frames": options.num_frames,
                "dtype": DTYPES[dtype_name], **identities, "text_len": text_len, "z_dim": 48,
                **caption_affixes(options)}
    if options.frames.settings():   # absent for the default: caches built before frame selection still match
        settings["frames"] = options.frames.settings()
    if options.buckets != "off":   # absent for off: caches built before buckets still match
        settings["buckets"] = options.buckets
    stages = parse_stages(options.resolution_stages)
    if stages:   # absent without stages: caches built before stages still match
        settings["stages"] = stage_names(stages)

    table = options.size_table or table_path_in(cache_dir)
    dataset = MBCVideoDataset(options.dataset_base_path, options.dataset_metadata_path, decoder=options.decoder,
                              frames=options.frames,
                              num_frames=options.num_frames, height=options.height, width=options.width,
                              buckets=options.buckets, **caption_affixes(options), stages=stages,
                              read_sizes=lambda rows: first_rank_reads(   # one read, every rank the same buckets
                                  lambda: row_sizes(rows, options.dataset_base_path, table_path=table),
                                  ranks.rank == 0, ranks.broadcast))
    metadata = {"path": str(Path(options.dataset_metadata_path).resolve()),
                "sha256": file_sha256(options.dataset_metadata_path),
                "base_path": str(Path(options.dataset_base_path).resolve()), "rows": len(dataset.data)}

    # A shard file from an earlier run must not be taken for this run's: each rank removes its own
    # before the barrier; rank 0 only looks for them after it.
    own_shard = shard_path(cache_dir, ranks.rank, ranks.world_size)
    own_shard.unlink(missing_ok=True)
    with waiting(status, "every rank at the start"):
        ranks.barrier()

    shard = encode_shard(options, ranks, settings, dataset, device, torch_dtype, model_files, status)
    atomic_write_json(own_shard, shard)
    stats = shard["stats"]
    done = f"{stats['written']} written, {stats['skipped']} skipped, {stats['failed']} failed"
    if ranks.rank != 0:
        print(f"[rank {ranks.rank}] shard done: {done}", file=sys.stderr)
        if status is not None:
            status.finished(f"this rank's share: {done}")
        return 0
    shards = wait_for_shards(cache_dir, ranks.world_size, status=status)
    summary = merge(options, settings, metadata, shards, time.monotonic() - started)
    print(describe(summary), file=sys.stderr)
    if sample_prompts:
        encode_sample_prompts(options, settings, device, torch_dtype, model_files, sample_prompts)
    if status is not None:
        status.finished(f"{summary['rows_cached']}/{summary['rows_in_metadata']} rows cached, "
                        f"{summary['failed']} failed; this rank's share: {done}")
    return 0


def identify_encoders(options, ranks: Ranks, status=None) -> tuple[tuple | None, dict, int]:
    """Which encoders: ``(model_files, identities, text_len)``. Their identity is part of every key, known before
    anything is loaded; ``model_files`` is None for the demo model. With --model_id rank 0 downloads the files
    while the other ranks wait at a barrier."""
    from diffsynth_mbc.models.pipeline import TINY_TEXT_LEN

    if options.demo:
        return None, {"vae": demo_identity(options.seed), "text_encoder": demo_identity(options.seed)}, TINY_TEXT_LEN
    from diffsynth.prompters import WanPrompter

    if options.model_dir:
        from diffsynth_mbc.models.model_files import locate_model_files

        files = locate_model_files(options.model_dir)
        model_files = (files.text_encoder, files.vae, files.tokenizer_dir)
    else:
        if ranks.rank != 0:
            with waiting(status, "rank 0 to download the model files"):
                ranks.barrier()  # rank 0 downloads first
        model_files = resolve_model_id_files(options.model_id)
        if ranks.rank == 0:
            with waiting(status, "every rank at the start"):
                ranks.barrier()
    return model_files, encoder_identities(*model_files), WanPrompter().text_len


def waiting(status, what: str):
    """``status.waiting(what)``, or nothing without a status file."""
    import contextlib

    return contextlib.nullcontext() if status is None else status.waiting(what)


def encode_sample_prompts(options, settings: dict, device: str, torch_dtype, model_files, prompts: list) -> None:
    from diffsynth_mbc.data.cache.encoder import load_encoders
    from diffsynth_mbc.data.cache.sample_texts import texts_of, write_sample_texts

    texts = texts_of(prompts)
    path = write_sample_texts(Path(options.cache_dir), load_encoders(options, device, torch_dtype, model_files),
                              texts, torch_dtype, str(settings["text_encoder"]))
    print(f"sample prompts: {len(texts)} text(s) encoded into {path}", file=sys.stderr)


if __name__ == "__main__":
    raise SystemExit(main())
