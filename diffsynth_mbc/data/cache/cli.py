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

An entry key is the sha256 of what determines the latent: the media file (resolved path, size, mtime),
height, width, frames, the VAE's identity and the dtype. A text key is the sha256 of the caption, the
text encoder's identity (with the tokenizer), text_len and the dtype; a caption shared by several rows
is stored once. Every file is written to a temp name and renamed into place, so an entry that exists
is complete: a second run skips it, a killed run resumes, and a changed setting gives new keys.

Exit codes: 0 done (rows that could not be decoded are listed in failures.csv, not fatal), 1 failed,
2 bad options or model files.
"""

from __future__ import annotations

import argparse
import csv
import functools
import io
import json
import os
import sys
import time
from pathlib import Path

from diffsynth_mbc.atomic import atomic_save_safetensors, atomic_write_json, atomic_write_text
from diffsynth_mbc.run_files import rank_from_environment

from diffsynth_mbc.data.cache.index import (  # noqa: F401  (the index API, used below)
    FORMAT,
    VERSION,
    INDEX_FILE,
    SUMMARY_FILE,
    FAILURES_FILE,
    ENTRIES_DIR,
    TEXT_DIR,
    SHARDS_DIR,
    DTYPES,
    FULL_SIZE,
    CacheError,
    _sha256,
    files_identity,
    demo_identity,
    encoder_identities,
    model_dir_identities,
    file_fingerprint,
    entry_key,
    text_key,
    entry_relpath,
    text_relpath,
    file_sha256,
    read_index,
    projected_bytes_per_sample)


# ---------------------------------------------------------------------------------------------
# Options


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
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
    parser.add_argument("--dtype", choices=sorted(DTYPES), help="stored precision (default bf16 on GPU, fp32 on CPU)")
    parser.add_argument("--dataset_num_workers", type=int, default=2, help="decoding worker processes per rank")
    return parser


def parse_options(argv=None) -> argparse.Namespace:
    options = build_parser().parse_args(argv)
    for key in ("height", "width"):
        value = getattr(options, key)
        if value < 32 or value % 32:
            raise CacheError(f"--{key} must be a positive multiple of 32, got {value}")
    if options.num_frames < 1 or options.num_frames % 4 != 1:
        raise CacheError(f"--num_frames must be 4k+1 (1, 5, 9, 13, 17, ...), got {options.num_frames}")
    if options.dataset_num_workers < 0:
        raise CacheError("--dataset_num_workers must not be negative")
    return options


# ---------------------------------------------------------------------------------------------
# Processes


class Ranks:
    """Rank and world size from the launcher's environment; a gloo/NCCL group only for the start barrier."""

    def __init__(self):
        self.rank, self.local_rank, self.world_size = rank_from_environment()
        self._group = False

    def start(self, use_cuda: bool) -> None:
        if self.world_size > 1:
            import datetime

            import torch
            import torch.distributed as dist

            if use_cuda:
                torch.cuda.set_device(self.local_rank)
            timeout = datetime.timedelta(seconds=int(os.environ.get("NCCL_TIMEOUT", "1800")))
            dist.init_process_group(backend="nccl" if use_cuda else "gloo", timeout=timeout)
            self._group = True

    def barrier(self) -> None:
        if self._group:
            import torch.distributed as dist

            dist.barrier()

    def close(self) -> None:
        if self._group:
            import torch.distributed as dist

            dist.destroy_process_group()
            self._group = False


def shard_path(cache_dir: Path, rank: int, world_size: int) -> Path:
    return cache_dir / SHARDS_DIR / f"rank-{rank:05d}-of-{world_size:05d}.json"


# ---------------------------------------------------------------------------------------------
# Encoding


def _dit_flags(config: dict):
    """What DiffSynth's units read from ``pipe.dit``: its flags, without building the 5B model."""
    import torch

    flags = torch.nn.Module()  # no parameters; the pipeline only accepts a module (or None) as its dit
    for key in ("in_dim", "has_image_input", "require_vae_embedding", "require_clip_embedding",
                "fuse_vae_embedding_in_latents"):
        setattr(flags, key, config[key])
    flags.has_image_pos_emb = False
    return flags


def resolve_model_id_files(model_id: str):
    """Download (if needed) the encoders of a ModelScope release; returns (text_encoder, vae, tokenizer_dir)."""
    from diffsynth.pipelines.wan_video_new import ModelConfig

    from diffsynth_mbc.models.model_files import TEXT_ENCODER_FILE, VAE_FILE

    paths = []
    for pattern in (TEXT_ENCODER_FILE, VAE_FILE, "google/*"):
        config = ModelConfig(model_id=model_id, origin_file_pattern=pattern)
        config.download_if_necessary()
        paths.append(Path(config.path if isinstance(config.path, str) else config.path[0]))
    return tuple(paths)


@functools.lru_cache(maxsize=2)
def _demo_encoders(seed: int, device: str, torch_dtype):
    """The demo's encoders, built once per process (deterministic from the seed; used without gradients)."""
    import tempfile

    from diffsynth_mbc.models.pipeline import TINY_DIT, build_demo_pipeline

    with tempfile.TemporaryDirectory(prefix="mbc-demo-tokenizer-") as tokenizer_dir:  # read while building
        pipe = build_demo_pipeline(device=device, torch_dtype=torch_dtype, seed=seed, tokenizer_dir=tokenizer_dir)
    pipe.dit = _dit_flags(TINY_DIT)
    return pipe


def load_encoders(options, device: str, torch_dtype, model_files):
    """A WanVideoPipeline with the VAE, text encoder and tokenizer only; ``pipe.dit`` holds the DiT's flags."""
    from diffsynth_mbc.models.pipeline import TI2V_5B_DIT

    if options.demo:
        pipe = _demo_encoders(options.seed, device, torch_dtype)
    else:
        from diffsynth.pipelines.wan_video_new import ModelConfig, WanVideoPipeline

        from diffsynth_mbc.models.model_files import ModelFileError

        text_encoder, vae, tokenizer_dir = model_files
        pipe = WanVideoPipeline.from_pretrained(
            torch_dtype=torch_dtype, device=device,
            model_configs=[ModelConfig(path=str(text_encoder)), ModelConfig(path=str(vae))],
            tokenizer_config=ModelConfig(path=str(tokenizer_dir)))
        missing = [name for name in ("text_encoder", "vae") if getattr(pipe, name) is None]
        if missing:
            raise ModelFileError(f"DiffSynth did not recognise the {', '.join(missing)} weights "
                                 f"({text_encoder}, {vae}); are these the Wan2.2-TI2V-5B files?")
        pipe.dit = _dit_flags(TI2V_5B_DIT)
    # As WanTI2VLoraModule sets them: every model in eval mode (no dropout in the text encoder) and the
    # scheduler in training mode (InputVideoEmbedder returns input_latents only then).
    pipe.freeze_except([])
    pipe.scheduler.set_timesteps(1000, training=True)
    return pipe


class _PendingClips:
    """Decodes the rows still to encode (in DataLoader workers); a failure comes back as its reason."""

    def __init__(self, dataset, rows: list[int]):
        self.dataset = dataset
        self.rows = rows

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int):
        row = self.rows[index]
        try:
            return row, self.dataset[row], None
        except Exception as exc:  # noqa: BLE001 - MediaDecodeError names the row and file
            return row, None, str(exc)


def _first(batch):
    return batch[0]


def _header_shapes(path: Path) -> dict:
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as handle:
        return {name: list(handle.get_slice(name).get_shape()) for name in handle.keys()}


class Encoder:
    """The per-rank work: latents through the media units, captions through the prompt unit."""

    def __init__(self, pipe, cache_dir: Path, torch_dtype):
        import torch

        from diffsynth_mbc.models.wan_units import media_units, prompt_units

        self.torch = torch
        self.pipe = pipe
        self.cache_dir = cache_dir
        self.torch_dtype = torch_dtype
        self.media_units = media_units(pipe)
        self.prompt_units = prompt_units(pipe)

    def encode_media(self, sample: dict) -> tuple[dict, str]:
        from diffsynth_mbc.models.wan_units import run_units, unit_inputs

        torch = self.torch
        out = run_units(self.pipe, *unit_inputs(self.pipe, sample), units=self.media_units)
        latents = out["input_latents"][0].to(device="cpu", dtype=self.torch_dtype)
        first = out["first_frame_latents"][0].to(device="cpu", dtype=self.torch_dtype)
        tensors = {"input_latents": latents}
        # The Wan2.2 VAE is causal: its first latent frame sees the first video frame only, so the
        # TI2V first-frame latent is input_latents[:, :1]. Stored only where that does not hold exactly.
        if torch.equal(first, latents[:, :1]):
            return tensors, "derived"
        tensors["first_frame_latents"] = first
        return tensors, "stored"

    def encode_text(self, caption: str):
        from diffsynth_mbc.models.wan_units import run_units

        pipe = self.pipe
        context = run_units(pipe, {"cfg_scale": 1, "cfg_merge": False}, {"prompt": caption}, {},
                            units=self.prompt_units)["context"]
        _, mask = pipe.prompter.tokenizer(pipe.prompter.process_prompt(caption, positive=None), return_mask=True,
                                          add_special_tokens=True)
        tokens = int(mask.gt(0).sum())
        if context.shape[0] != 1 or bool(context[:, tokens:].ne(0).any()):
            raise RuntimeError(f"the prompt encoder no longer zeroes positions past the {tokens} real tokens; "
                               "the unpadded text cache would not reproduce its output")
        return context[0, :tokens].to(device="cpu", dtype=self.torch_dtype)


class ProgressView:
    """Rank 0's bar (rich, with ETA) in a terminal; otherwise a line every ``interval_s``."""

    def __init__(self, total: int, rank: int, world_size: int, enabled: bool, interval_s: float = 30.0):
        self.total, self.done, self.enabled = total, 0, enabled and total > 0
        self.label = f"encoding (rank {rank} of {world_size})"
        self.interval_s = interval_s
        self.started = self.last_line = time.monotonic()
        self.counted_from = 0
        self.progress = None
        if self.enabled and sys.stderr.isatty():
            from rich.console import Console
            from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn,
                                       TimeRemainingColumn)

            self.progress = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                                     TextColumn("{task.fields[rate]}"), TimeElapsedColumn(), TextColumn("ETA"),
                                     TimeRemainingColumn(), console=Console(stderr=True))
            self.task = self.progress.add_task(self.label, total=total, rate="")
            self.progress.start()

    def restart_clock(self) -> None:
        """Rows/s and ETA from now on: model loading is not encoding."""
        self.started = time.monotonic()
        self.counted_from = self.done
        if self.progress is not None:
            self.progress.reset(self.task, total=self.total, completed=self.done, rate="")

    def advance(self) -> None:
        self.done += 1
        if not self.enabled:
            return
        now = time.monotonic()
        rate = (self.done - self.counted_from) / max(now - self.started, 1e-9)
        if self.progress is not None:
            self.progress.update(self.task, advance=1, rate=f"{rate:.2f} rows/s")
        elif now - self.last_line >= self.interval_s or self.done == self.total:
            self.last_line = now
            eta = (self.total - self.done) / rate if rate > 0 else float("inf")
            print(f"{self.label}: {self.done}/{self.total} rows, {rate:.2f} rows/s, ETA {eta:.0f} s",
                  file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.progress is not None:
            self.progress.stop()
            self.progress = None


def encode_shard(options, ranks: Ranks, settings: dict, dataset, device: str, torch_dtype, model_files) -> dict:
    """Encode this rank's rows; returns its shard record (rows done, failures, counts)."""
    import torch

    cache_dir = Path(options.cache_dir)
    base_path = Path(options.dataset_base_path)
    started = time.monotonic()
    stats = {"rows": 0, "written": 0, "skipped": 0, "failed": 0, "text_written": 0, "text_skipped": 0,
             "bytes_written": 0, "model_load_seconds": 0.0}
    done, failed = {}, []
    pending_media, pending_text = [], []
    plan, planned_entries = {}, set()
    for row in range(ranks.rank, len(dataset.data), ranks.world_size):
        stats["rows"] += 1
        record = dataset.data[row]
        file_name = record.get("video")
        caption = record.get("prompt")
        if not isinstance(caption, str):
            failed.append({"row": row + 1, "file": str(file_name), "reason": f"metadata row {row + 1}: no caption"})
            continue
        try:
            fingerprint = file_fingerprint(base_path / str(file_name))
        except OSError as exc:
            failed.append({"row": row + 1, "file": str(file_name),
                           "reason": f"metadata row {row + 1} ({file_name}): cannot read the file: "
                                     f"{exc.strerror or exc}"})
            continue
        entry = entry_relpath(entry_key(fingerprint, settings))
        text = text_relpath(text_key(caption, settings))
        plan[row] = {"row": row + 1, "file": str(file_name), "prompt": caption,
                     "media_type": str(record.get("media_type", "")), "entry": entry, "text": text}
        if (cache_dir / entry).is_file() or entry in planned_entries:
            # Done by an earlier run (or, for a second row of the same file, by this one): not encoded.
            stats["skipped"] += 1
            if (cache_dir / entry).is_file() and (cache_dir / text).is_file():
                done[row] = plan[row]
            else:
                pending_text.append(row)
        else:
            planned_entries.add(entry)
            pending_media.append(row)

    work = len(pending_media) + len(pending_text)
    if work:
        encoder = None
        known_text: set[str] = set()
        view = ProgressView(work, ranks.rank, ranks.world_size, enabled=ranks.rank == 0)

        def get_encoder() -> Encoder:
            # Loaded on first need: a rank whose remaining rows all fail to decode never loads the models.
            nonlocal encoder
            if encoder is None:
                loading = time.monotonic()
                encoder = Encoder(load_encoders(options, device, torch_dtype, model_files), cache_dir, torch_dtype)
                stats["model_load_seconds"] = round(time.monotonic() - loading, 3)
                view.restart_clock()
            return encoder

        def ensure_text(row: int) -> None:
            text = plan[row]["text"]
            if text in known_text:
                return
            if (cache_dir / text).is_file():
                stats["text_skipped"] += 1
            else:
                context = get_encoder().encode_text(plan[row]["prompt"])
                stats["bytes_written"] += atomic_save_safetensors(cache_dir / text, {"context": context},
                                                            {"format": FORMAT, "tokens": str(context.shape[0])})
                stats["text_written"] += 1
            known_text.add(text)

        try:
            workers = options.dataset_num_workers if len(pending_media) > 1 else 0
            loader = torch.utils.data.DataLoader(
                _PendingClips(dataset, pending_media), batch_size=1, shuffle=False, collate_fn=_first,
                num_workers=workers, prefetch_factor=2 if workers else None)
            for row, sample, error in loader:
                if error is None:
                    get_encoder()  # outside the per-row handler: a model that cannot load stops the job
                    try:
                        ensure_text(row)  # text first: an entry that exists always has its text
                        tensors, first_frame = get_encoder().encode_media(sample)
                        stats["bytes_written"] += atomic_save_safetensors(
                            cache_dir / plan[row]["entry"], tensors,
                            {"format": FORMAT, "first_frame": first_frame, "file": plan[row]["file"]})
                        stats["written"] += 1
                        done[row] = plan[row]
                    except (torch.cuda.OutOfMemoryError, MemoryError):
                        raise
                    except Exception as exc:  # noqa: BLE001 - listed; one bad clip must not stop the job
                        error = f"metadata row {row + 1} ({plan[row]['file']}): cannot encode: " \
                                f"{type(exc).__name__}: {exc}"
                if error is not None:
                    failed.append({"row": row + 1, "file": plan[row]["file"], "reason": error})
                view.advance()
            for row in pending_text:
                if (cache_dir / plan[row]["entry"]).is_file():
                    ensure_text(row)
                    done[row] = plan[row]
                else:  # a second row of a file that failed above
                    stats["skipped"] -= 1
                    failed.append({"row": row + 1, "file": plan[row]["file"],
                                   "reason": f"metadata row {row + 1} ({plan[row]['file']}): same file as a row "
                                             "that failed"})
                view.advance()
        finally:
            view.close()
    stats["failed"] = len(failed)
    stats["seconds"] = round(time.monotonic() - started, 3)
    for row in done.values():
        shapes = _header_shapes(cache_dir / row["entry"])
        row["latent_shape"] = shapes["input_latents"]
        row["first_frame"] = "stored" if "first_frame_latents" in shapes else "derived"
        row["text_tokens"] = _header_shapes(cache_dir / row["text"])["context"][0]
    return {"rank": ranks.rank, "world_size": ranks.world_size, "rows": [done[row] for row in sorted(done)],
            "failed": sorted(failed, key=lambda item: item["row"]), "stats": stats}


# ---------------------------------------------------------------------------------------------
# Merging (rank 0)


def wait_for_shards(cache_dir: Path, world_size: int, poll_s: float = 0.5, report_s: float = 60.0) -> list[dict]:
    paths = [shard_path(cache_dir, rank, world_size) for rank in range(world_size)]
    started = last = time.monotonic()
    while True:
        missing = [rank for rank, path in enumerate(paths) if not path.is_file()]
        if not missing:
            return [json.loads(path.read_text(encoding="utf-8")) for path in paths]
        now = time.monotonic()
        if now - last >= report_s:
            last = now
            print(f"rank 0: waiting {now - started:.0f} s for rank(s) {', '.join(map(str, missing))} to finish "
                  "their shard", file=sys.stderr, flush=True)
        time.sleep(poll_s)


def _failures_csv(failed: list[dict]) -> str:
    buffer = io.StringIO()
    writer = csv.writer(buffer, lineterminator="\r\n")
    writer.writerow(["row", "file", "reason"])
    for item in failed:
        writer.writerow([item["row"], item["file"], item["reason"]])
    return buffer.getvalue()


def _folder_bytes(folder: Path) -> int:
    return sum(path.stat().st_size for path in folder.rglob("*.safetensors")) if folder.is_dir() else 0


def _remove_stale_temps(cache_dir: Path) -> int:
    removed = 0
    for folder in (cache_dir / ENTRIES_DIR, cache_dir / TEXT_DIR):
        if folder.is_dir():
            for path in folder.rglob(".*.tmp"):
                path.unlink(missing_ok=True)
                removed += 1
    return removed


def merge(options, settings: dict, metadata: dict, shards: list[dict], seconds: float) -> dict:
    """Write failures.csv, cache.json and summary.json (each atomically); return the summary."""
    cache_dir = Path(options.cache_dir)
    rows = sorted((row for shard in shards for row in shard["rows"]), key=lambda row: row["row"])
    failed = sorted((item for shard in shards for item in shard["failed"]), key=lambda item: item["row"])
    atomic_write_text(cache_dir / FAILURES_FILE, _failures_csv(failed))
    index = {"format": FORMAT, "version": VERSION, "settings": settings, "metadata": metadata,
             "rows": rows, "failed": [{"row": item["row"], "file": item["file"]} for item in failed]}
    atomic_write_json(cache_dir / INDEX_FILE, index, indent=None, separators=(",", ":"))

    entries = {row["entry"] for row in rows}
    texts = {row["text"] for row in rows}
    entry_bytes = sum((cache_dir / path).stat().st_size for path in entries)
    text_bytes = sum((cache_dir / path).stat().st_size for path in texts)
    used = entry_bytes + text_bytes
    totals = {key: sum(shard["stats"][key] for shard in shards)
              for key in ("rows", "written", "skipped", "failed", "text_written", "text_skipped", "bytes_written")}
    mean_tokens = sum(row["text_tokens"] for row in rows) / len(rows) if rows else 0.0
    text_share = len(texts) / len(rows) if rows else 1.0
    stored_first = sum(row["first_frame"] == "stored" for row in rows) / len(rows) if rows else 0.0
    summary = {
        **totals, "rows_in_metadata": metadata["rows"], "rows_cached": len(rows), "entries": len(entries),
        "captions": len(texts), "bytes": used, "entry_bytes": entry_bytes, "text_bytes": text_bytes,
        "bytes_per_sample": round(used / len(rows)) if rows else 0,
        "mean_text_tokens": round(mean_tokens, 2), "first_frame_stored_share": stored_first,
        "bytes_in_cache_dir": _folder_bytes(cache_dir / ENTRIES_DIR) + _folder_bytes(cache_dir / TEXT_DIR),
        "projected_1280x704x17_bf16": projected_bytes_per_sample(
            FULL_SIZE["height"], FULL_SIZE["width"], FULL_SIZE["num_frames"], mean_tokens, text_share,
            stored_first, dtype_bytes=2, z_dim=FULL_SIZE["z_dim"], text_dim=FULL_SIZE["text_dim"]),
        "settings": {key: settings[key] for key in ("height", "width", "num_frames", "dtype")},
        "world_size": len(shards), "seconds": round(seconds, 3),
        "per_rank": [{"rank": shard["rank"], **shard["stats"]} for shard in shards],
        "index": str(cache_dir / INDEX_FILE), "failures": str(cache_dir / FAILURES_FILE),
    }
    atomic_write_json(cache_dir / SUMMARY_FILE, summary)
    _remove_stale_temps(cache_dir)
    return summary


def describe(summary: dict) -> str:
    mib = summary["bytes"] / 2**20
    projected = summary["projected_1280x704x17_bf16"]
    return (f"latent cache: {summary['rows_cached']}/{summary['rows_in_metadata']} rows cached "
            f"({summary['written']} entries written, {summary['skipped']} skipped as already done, "
            f"{summary['failed']} failed; captions: {summary['text_written']} written, "
            f"{summary['text_skipped']} reused), {mib:.2f} MiB used, "
            f"{summary['bytes_per_sample'] / 2**20:.3f} MiB/sample at {summary['settings']['height']}x"
            f"{summary['settings']['width']}x{summary['settings']['num_frames']} {summary['settings']['dtype']}; "
            f"projected at 1280x704x17 bf16: {projected['mib']:.2f} MiB/sample; {summary['seconds']:.1f} s"
            + (f"; failures listed in {summary['failures']}" if summary["failed"] else ""))


# ---------------------------------------------------------------------------------------------
# Command


def main(argv: list[str] | None = None) -> int:
    try:
        options = parse_options(argv)
    except CacheError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    from diffsynth_mbc.models.model_files import ModelFileError

    ranks = Ranks()
    try:
        return run(options, ranks)
    except (CacheError, ModelFileError) as exc:
        print(f"[rank {ranks.rank}] error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"[rank {ranks.rank}] stopped; finished entries are kept, a rerun resumes", file=sys.stderr)
        return 130
    except Exception as exc:  # noqa: BLE001 - reported with its traceback
        import traceback

        traceback.print_exc()
        print(f"[rank {ranks.rank}] failed: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    finally:
        ranks.close()


def run(options, ranks: Ranks) -> int:
    import torch

    from diffsynth_mbc.data.dataset import MBCVideoDataset
    from diffsynth_mbc.models.pipeline import TINY_TEXT_LEN

    started = time.monotonic()
    use_cuda = torch.cuda.is_available()
    device = f"cuda:{ranks.local_rank}" if use_cuda else "cpu"
    dtype_name = options.dtype or ("bf16" if use_cuda else "fp32")
    torch_dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[dtype_name]
    cache_dir = Path(options.cache_dir)
    ranks.start(use_cuda)

    # Which encoders: their identity is part of every key, known before anything is loaded.
    model_files = None
    if options.demo:
        identities = {"vae": demo_identity(options.seed), "text_encoder": demo_identity(options.seed)}
        text_len = TINY_TEXT_LEN
    else:
        from diffsynth.prompters import WanPrompter

        if options.model_dir:
            from diffsynth_mbc.models.model_files import locate_model_files

            files = locate_model_files(options.model_dir)
            model_files = (files.text_encoder, files.vae, files.tokenizer_dir)
        else:
            if ranks.rank != 0:
                ranks.barrier()  # rank 0 downloads first
            model_files = resolve_model_id_files(options.model_id)
            if ranks.rank == 0:
                ranks.barrier()
        identities = encoder_identities(*model_files)
        text_len = WanPrompter().text_len
    settings = {"height": options.height, "width": options.width, "num_frames": options.num_frames,
                "dtype": DTYPES[dtype_name], **identities, "text_len": text_len, "z_dim": 48}

    dataset = MBCVideoDataset(options.dataset_base_path, options.dataset_metadata_path,
                              num_frames=options.num_frames, height=options.height, width=options.width)
    metadata = {"path": str(Path(options.dataset_metadata_path).resolve()),
                "sha256": file_sha256(options.dataset_metadata_path),
                "base_path": str(Path(options.dataset_base_path).resolve()), "rows": len(dataset.data)}

    # A shard file from an earlier run must not be taken for this run's: each rank removes its own
    # before the barrier; rank 0 only looks for them after it.
    own_shard = shard_path(cache_dir, ranks.rank, ranks.world_size)
    own_shard.unlink(missing_ok=True)
    ranks.barrier()

    shard = encode_shard(options, ranks, settings, dataset, device, torch_dtype, model_files)
    atomic_write_json(own_shard, shard)
    if ranks.rank != 0:
        stats = shard["stats"]
        print(f"[rank {ranks.rank}] shard done: {stats['written']} written, {stats['skipped']} skipped, "
              f"{stats['failed']} failed", file=sys.stderr)
        return 0
    shards = wait_for_shards(cache_dir, ranks.world_size)
    summary = merge(options, settings, metadata, shards, time.monotonic() - started)
    print(describe(summary), file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
