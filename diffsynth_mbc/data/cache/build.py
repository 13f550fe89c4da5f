"""Building the cache over ranks: each rank encodes its shard of rows, then rank 0 merges the shards
into the index and the summary."""

from __future__ import annotations

import collections
import csv
import io
import json
import sys
import time
from pathlib import Path

from diffsynth_mbc.atomic import (
    atomic_save_safetensors,
    atomic_write_json,
    atomic_write_text,
)
from diffsynth_mbc.data.cache.encoder import (
    Encoder,
    PendingClips,
    first_item,
    header_shapes,
    load_encoders,
)
from diffsynth_mbc.data.cache.index import (
    FORMAT,
    FULL_SIZE,
    VERSION,
    entry_key,
    entry_relpath,
    file_fingerprint,
    projected_bytes_per_sample,
    safetensors_is_whole,
    text_key,
    text_relpath,
)
from diffsynth_mbc.data.cache.progress import ProgressView
from diffsynth_mbc.data.caption_rules import EMPTY_PROMPT
from diffsynth_mbc.data.cache.ranks import Ranks
from diffsynth_mbc.data.media.stages import stage_settings
from diffsynth_mbc.run_layout import (CACHE_ENTRIES, CACHE_FAILURES, CACHE_INDEX, CACHE_SHARDS, CACHE_SUMMARY,
                                      CACHE_TEXT, cache_shard_name)

def shard_path(cache_dir: Path, rank: int, world_size: int) -> Path:
    return cache_dir / CACHE_SHARDS / cache_shard_name(rank, world_size)




class ShardJob:
    """One rank's share of the cache: rows r, r+W, ...; what is already cached is skipped."""

    def __init__(self, options, ranks: Ranks, settings: dict, dataset, device: str, torch_dtype, model_files,
                 status=None):
        self.options, self.ranks, self.settings, self.dataset = options, ranks, settings, dataset
        self.status = status   # data.cache.status.CacheStatus: this rank's status file, or None
        self.device, self.torch_dtype, self.model_files = device, torch_dtype, model_files
        self.cache_dir = Path(options.cache_dir)
        self.stats = {"rows": 0, "written": 0, "skipped": 0, "failed": 0, "text_written": 0, "text_skipped": 0,
                      "bytes_written": 0, "model_load_seconds": 0.0}
        self.done, self.failed, self.plan = {}, [], {}
        self.pending_media, self.pending_text = [], []
        self.known_text: set[str] = set()
        self.empty_prompt = None   # rank 0: {"text": relpath} of the empty prompt's embedding
        self._encoder = None
        self.view = None
        self.started = time.monotonic()

    # -- which rows need work -------------------------------------------------------------------
    def plan_rows(self) -> None:
        base_path = Path(self.options.dataset_base_path)
        planned_entries = set()
        for row in range(self.ranks.rank, len(self.dataset.data), self.ranks.world_size):
            self.stats["rows"] += 1
            record = self.dataset.data[row]
            file_name, caption = record.get("video"), record.get("prompt")
            if not isinstance(caption, str):
                self.fail(row, str(file_name), f"metadata row {row + 1}: no caption")
                continue
            try:
                fingerprint = file_fingerprint(base_path / str(file_name))
            except OSError as exc:
                self.fail(row, str(file_name), f"metadata row {row + 1} ({file_name}): cannot read the file: "
                                               f"{exc.strerror or exc}")
                continue
            bucket = self.dataset.row_buckets[row]
            entry = entry_relpath(entry_key(fingerprint, self.settings, bucket))
            text = text_relpath(text_key(caption, self.settings))
            self.plan[row] = {"row": row + 1, "file": str(file_name), "prompt": caption,
                              "media_type": str(record.get("media_type", "")), "entry": entry, "text": text,
                              "size": fingerprint["size"], "mtime_ns": fingerprint["mtime_ns"]}
            stage_entries = [entry_relpath(entry_key(fingerprint, *stage_settings(self.settings, stage, bucket,
                                                                                  self.dataset.buckets)))
                             for stage in self.dataset.stages]   # --resolution_stages: an entry per stage too
            if stage_entries:
                self.plan[row]["stage_entries"] = stage_entries
            entries = [*stage_entries, entry]
            for relative in [*entries, text]:
                self.remove_if_damaged(relative)
            missing = [stage for stage, relative in enumerate(entries)
                       if not (self.cache_dir / relative).is_file() and relative not in planned_entries]
            if not missing:
                # Done by an earlier run (or, for a second row of the same file, by this one): not encoded.
                self.stats["skipped"] += 1
                if all((self.cache_dir / relative).is_file() for relative in [*entries, text]):
                    self.done[row] = self.plan[row]
                else:
                    self.pending_text.append(row)
            else:
                planned_entries.update(entries[stage] for stage in missing)
                self.pending_media += [(row, stage) for stage in missing]

    def remove_if_damaged(self, relative: str) -> None:
        """A truncated file (a killed copy, a full disk) is removed so that this run encodes it again."""
        path = self.cache_dir / relative
        if path.is_file() and not safetensors_is_whole(path):
            path.unlink()
            self.stats["repaired"] = self.stats.get("repaired", 0) + 1
            print(f"[rank {self.ranks.rank}] {path} was damaged (truncated); encoding it again", file=sys.stderr)

    @property
    def work(self) -> int:
        """Rows still to encode (a row of several stages counts once)."""
        return len({row for row, _ in self.pending_media}) + len(self.pending_text)

    def fail(self, row: int, file_name: str, reason: str) -> None:
        self.failed.append({"row": row + 1, "file": file_name, "reason": reason})

    # -- encoding -------------------------------------------------------------------------------
    def encoder(self) -> Encoder:
        """Loaded on first need: a rank whose remaining rows all fail to decode never loads the models."""
        if self._encoder is None:
            loading = time.monotonic()
            if self.status is not None:
                self.status.loading()
            pipe = load_encoders(self.options, self.device, self.torch_dtype, self.model_files)
            self._encoder = Encoder(pipe, self.cache_dir, self.torch_dtype)
            self.stats["model_load_seconds"] = round(time.monotonic() - loading, 3)
            if self.view is not None:
                self.view.restart_clock()
            if self.status is not None:
                self.status.encoding()
        return self._encoder

    def ensure_text(self, row: int) -> None:
        text = self.plan[row]["text"]
        if text in self.known_text:
            return
        if (self.cache_dir / text).is_file():
            self.stats["text_skipped"] += 1
        else:
            context = self.encoder().encode_text(self.plan[row]["prompt"])
            self.stats["bytes_written"] += atomic_save_safetensors(self.cache_dir / text, {"context": context},
                                                                   {"format": FORMAT, "tokens": str(context.shape[0])})
            self.stats["text_written"] += 1
        self.known_text.add(text)

    def ensure_empty_prompt(self) -> None:
        """The empty prompt's embedding, stored once (rank 0): what --caption_dropout trains on from the cache."""
        text = text_relpath(text_key(EMPTY_PROMPT, self.settings))
        self.remove_if_damaged(text)
        if not (self.cache_dir / text).is_file():
            context = self.encoder().encode_text(EMPTY_PROMPT)
            self.stats["bytes_written"] += atomic_save_safetensors(self.cache_dir / text, {"context": context},
                                                                   {"format": FORMAT, "tokens": str(context.shape[0])})
        self.empty_prompt = {"text": text}

    def entries(self, row: int) -> list[str]:
        """The row's entries: each stage's (--resolution_stages), then the final size's."""
        return [*self.plan[row].get("stage_entries", []), self.plan[row]["entry"]]

    def encode_one(self, row: int, sample, stage: int | None = None) -> str | None:
        """Text first (an entry that exists always has its text), then the clip (at ``stage``: the final size when
        None); the error, if any."""
        import torch

        try:
            self.ensure_text(row)
            tensors, first_frame = self.encoder().encode_media(sample)
            target = self.plan[row]["entry"] if stage is None else self.entries(row)[stage]
            self.stats["bytes_written"] += atomic_save_safetensors(
                self.cache_dir / target, tensors,
                {"format": FORMAT, "first_frame": first_frame, "file": self.plan[row]["file"]})
        except (torch.cuda.OutOfMemoryError, MemoryError):
            raise
        except Exception as exc:  # noqa: BLE001 - listed; one bad clip must not stop the job
            return f"metadata row {row + 1} ({self.plan[row]['file']}): cannot encode: {type(exc).__name__}: {exc}"
        self.stats["written"] += 1
        if not all((self.cache_dir / relative).is_file() for relative in self.entries(row)):
            return None   # the row's other stages come in their own turn
        # When the first and the last encoded row were done (s from the start): their span is the encode rate
        # without the models' load, the data workers' start and the first encode's warm-up.
        done_at = round(time.monotonic() - self.started, 3)
        self.stats.setdefault("first_row_done_s", done_at)
        self.stats["last_row_done_s"] = done_at
        self.done[row] = self.plan[row]
        return None

    def encode_clips(self) -> None:
        import torch

        workers = self.options.dataset_num_workers if len(self.pending_media) > 1 else 0
        loader = torch.utils.data.DataLoader(
            PendingClips(self.dataset, self.pending_media), batch_size=1, shuffle=False, collate_fn=first_item,
            num_workers=workers, prefetch_factor=2 if workers else None)
        failed = set()
        left = collections.Counter(row for row, _ in self.pending_media)   # each row's stages still to come
        for (row, stage), sample, error in loader:
            left[row] -= 1
            if row in failed:   # a stage of a row that failed at another: its one failure is listed
                if not left[row]:
                    self.row_done()
                continue
            if error is None:
                self.encoder()  # outside the per-row handler: a model that cannot load stops the job
                error = self.encode_one(row, sample, stage)
            if error is not None:
                failed.add(row)
                self.done.pop(row, None)
                self.fail(row, self.plan[row]["file"], error)
            if not left[row]:
                self.row_done()

    def encode_texts_of_cached_clips(self) -> None:
        for row in self.pending_text:
            if all((self.cache_dir / relative).is_file() for relative in self.entries(row)):
                self.ensure_text(row)
                self.done[row] = self.plan[row]
            else:  # a second row of a file that failed above
                self.stats["skipped"] -= 1
                self.fail(row, self.plan[row]["file"],
                          f"metadata row {row + 1} ({self.plan[row]['file']}): same file as a row that failed")
            self.row_done()

    def row_done(self) -> None:
        self.view.advance()
        if self.status is not None:
            self.status.row_done(self.failed)

    # -- the shard record -----------------------------------------------------------------------
    def record(self, seconds: float) -> dict:
        self.stats["failed"] = len(self.failed)
        self.stats["seconds"] = round(seconds, 3)
        for row in self.done.values():
            shapes = header_shapes(self.cache_dir / row["entry"])
            row["latent_shape"] = shapes["input_latents"]
            row["first_frame"] = "stored" if "first_frame_latents" in shapes else "derived"
            row["text_tokens"] = header_shapes(self.cache_dir / row["text"])["context"][0]
            row["entry_bytes"] = (self.cache_dir / row["entry"]).stat().st_size
            if row.get("stage_entries"):
                row["stage_latent_shapes"] = [header_shapes(self.cache_dir / relative)["input_latents"]
                                              for relative in row["stage_entries"]]
                row["stage_entry_bytes"] = [(self.cache_dir / relative).stat().st_size
                                            for relative in row["stage_entries"]]
            row["text_bytes"] = (self.cache_dir / row["text"]).stat().st_size
        if self.empty_prompt is not None:
            self.empty_prompt["text_tokens"] = header_shapes(self.cache_dir / self.empty_prompt["text"])["context"][0]
            self.empty_prompt["text_bytes"] = (self.cache_dir / self.empty_prompt["text"]).stat().st_size
        return {"rank": self.ranks.rank, "world_size": self.ranks.world_size, "empty_prompt": self.empty_prompt,
                "rows": [self.done[row] for row in sorted(self.done)],
                "failed": sorted(self.failed, key=lambda item: item["row"]), "stats": self.stats}


def encode_shard(options, ranks: Ranks, settings: dict, dataset, device: str, torch_dtype, model_files,
                 status=None) -> dict:
    """Encode this rank's rows; returns its shard record (rows done, failures, counts)."""
    job = ShardJob(options, ranks, settings, dataset, device, torch_dtype, model_files, status)
    job.plan_rows()
    if status is not None:
        status.planned(job.stats["rows"], job.stats["rows"] - job.work, job.failed)
    if job.work:
        job.view = ProgressView(job.work, ranks.rank, ranks.world_size, enabled=ranks.rank == 0)
        try:
            job.encode_clips()
            job.encode_texts_of_cached_clips()
        finally:
            job.view.close()
    if ranks.rank == 0:
        job.ensure_empty_prompt()
    return job.record(time.monotonic() - job.started)


# ---------------------------------------------------------------------------------------------
# Merging (rank 0)


def wait_for_shards(cache_dir: Path, world_size: int, poll_s: float = 0.5, report_s: float = 60.0,
                    status=None) -> list[dict]:
    """Rank 0 waits for every rank's shard record; with ``status``, its file says so and stays fresh meanwhile."""
    paths = [shard_path(cache_dir, rank, world_size) for rank in range(world_size)]
    missing = [rank for rank, path in enumerate(paths) if not path.is_file()]
    if missing and status is not None:
        with status.waiting(f"rank(s) {', '.join(map(str, missing))} to finish their share of the cache"):
            return wait_for_shards(cache_dir, world_size, poll_s, report_s)
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
    for folder in (cache_dir / CACHE_ENTRIES, cache_dir / CACHE_TEXT):
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
    atomic_write_text(cache_dir / CACHE_FAILURES, _failures_csv(failed))
    index = {"format": FORMAT, "version": VERSION, "settings": settings, "metadata": metadata,
             "rows": rows, "failed": [{"row": item["row"], "file": item["file"]} for item in failed]}
    empty_prompt = next((shard["empty_prompt"] for shard in shards if shard.get("empty_prompt")), None)
    if empty_prompt is not None:
        index["empty_prompt"] = empty_prompt
    atomic_write_json(cache_dir / CACHE_INDEX, index, indent=None, separators=(",", ":"))

    entries = {row["entry"] for row in rows}
    texts = {row["text"] for row in rows}
    entry_bytes = sum((cache_dir / path).stat().st_size for path in entries)
    stored_texts = texts | ({empty_prompt["text"]} if empty_prompt else set())
    text_bytes = sum((cache_dir / path).stat().st_size for path in stored_texts)
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
        "bytes_in_cache_dir": _folder_bytes(cache_dir / CACHE_ENTRIES) + _folder_bytes(cache_dir / CACHE_TEXT),
        "projected_1280x704x17_bf16": projected_bytes_per_sample(
            FULL_SIZE["height"], FULL_SIZE["width"], FULL_SIZE["num_frames"], mean_tokens, text_share,
            stored_first, dtype_bytes=2, z_dim=FULL_SIZE["z_dim"], text_dim=FULL_SIZE["text_dim"]),
        "settings": {key: settings[key] for key in ("height", "width", "num_frames", "dtype")},
        "world_size": len(shards), "seconds": round(seconds, 3),
        "per_rank": [{"rank": shard["rank"], **shard["stats"]} for shard in shards],
        "index": str(cache_dir / CACHE_INDEX), "failures": str(cache_dir / CACHE_FAILURES),
    }
    atomic_write_json(cache_dir / CACHE_SUMMARY, summary)
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


