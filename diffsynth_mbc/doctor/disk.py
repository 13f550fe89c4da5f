"""The doctor's disk check: what the run writes, per disk, against that disk's free space. No torch.

The run writes its checkpoints (``--keep_checkpoints`` + 1 of them at a time, each sized from the model it trains:
the demo's tiny one with ``--demo``) and, when it builds a latent cache (the launchers' ``--cached``) or reads one
(``--cache DIR``, which it builds first when it is not finished), the cache: every row's latent and its caption's
embedding, a clip at the training size, an image at one frame (the validation set's cache too). A finished cache (its index written) adds nothing; an unfinished one adds what is
not on disk yet, since a build skips the entries it finds. Folders on the same disk share its free space, so
their needs are added up: ``disk_check`` is the verdict on one disk, a pure function of the numbers.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
from pathlib import Path

from diffsynth_mbc.doctor.checks import FAIL, OK, WARN, Check
from diffsynth_mbc.training.checkpoints.space import human
from diffsynth_mbc.training.plan import memory

TEXT_TOKENS = 120   # a caption's tokens, as the cache's own projection takes them
# A checkpoint's files besides the LoRA and the optimizer (RNG states, scheduler, sampler, manifest): allowed for at
# full size; on the demo's tiny model they are about 65 KB and 15 KB a rank (measured: 245 KB a checkpoint, 1 rank)
STATE_BYTES = 64 * 2**20
DEMO_STATE_BYTES = 256 * 2**10


@dataclasses.dataclass(frozen=True)
class Need:
    """Bytes the run writes into ``path``: ``what`` they are and, for the reader, how they were counted."""
    path: str
    what: str
    bytes: int
    note: str = ""


def trained_dit(options) -> dict:
    """The widths of the DiT the run trains: Wan2.2-TI2V-5B's, or the demo's tiny model's with --demo."""
    return memory.DEMO_DIT if options.demo else memory.DIT


def checkpoint_bytes(options) -> int:
    """One checkpoint of the LoRA on the model the run trains: the LoRA, AdamW's m and v and the file for export
    (16 bytes a parameter), and the RNG, scheduler and manifest files."""
    dit = trained_dit(options)
    lora = memory.lora_params(options.lora_rank, list(options.lora_target_modules), dit["dim"], dit["ffn_dim"],
                              dit["num_layers"])
    return lora * 16 + (DEMO_STATE_BYTES if options.demo else STATE_BYTES)


def cache_bytes(options, videos: int, images: int) -> int:
    """The latent cache of ``videos`` clips and ``images`` images at the training size (each row encoded once), and
    at each of --resolution_stages' sizes (a latent each; the caption's embedding once)."""
    from diffsynth_mbc.data.cache.index import projected_bytes_per_sample

    dtype_bytes = 4 if options.mixed_precision == "no" else 2
    text_tokens = min(TEXT_TOKENS, memory.DEMO_TEXT_TOKENS) if options.demo else TEXT_TOKENS
    per = {frames: projected_bytes_per_sample(options.height, options.width, frames, text_tokens=text_tokens,
                                              text_dim=trained_dit(options)["text_dim"],
                                              dtype_bytes=dtype_bytes)["bytes"] for frames in (options.num_frames, 1)}
    total = videos * per[options.num_frames] + images * per[1]
    for stage in options.resolution_stages:
        frames = stage.num_frames or options.num_frames
        latent = {count: projected_bytes_per_sample(stage.height, stage.width, count, text_tokens=0,
                                                    dtype_bytes=dtype_bytes)["latent_bytes"] for count in (frames, 1)}
        total += videos * latent[frames] + images * latent[1]
    return total


def _bytes_in(folder: Path) -> int:
    from diffsynth_mbc.run_layout import CACHE_ENTRIES, CACHE_TEXT

    return sum(p.stat().st_size for sub in (CACHE_ENTRIES, CACHE_TEXT) if (folder / sub).is_dir()
               for p in (folder / sub).rglob("*.safetensors"))


def cache_need(folder: str, options, media: tuple[int, int], how: str) -> Need:
    """What a cache of ``media`` rows in ``folder`` still needs: nothing when finished, else what is not there yet."""
    from diffsynth_mbc.run_layout import CACHE_INDEX

    if (Path(folder) / CACHE_INDEX).is_file():
        return Need(folder, "latent cache", 0, f"{how}: finished already, read as it is, nothing more to write")
    projected, there = cache_bytes(options, *media), _bytes_in(Path(folder))
    written = f"; {human(there)} of its {human(projected)} written already" if there else ""
    return Need(folder, "latent cache", max(0, projected - there),
                f"{media[0]:,} clips + {media[1]:,} images, {how}{written}")


def disk_needs(options, media: tuple[int, int] | None, cached_launch: bool,
               val_media: tuple[int, int] | None = None) -> list[Need]:
    """Every folder the run writes into and how much: checkpoints, and the cache(s) it builds or reads."""
    from diffsynth_mbc.training.plan.command import cache_dirs

    needs = [Need(options.checkpoint_dir, "checkpoints", checkpoint_bytes(options) * (options.keep_checkpoints + 1),
                  f"{options.keep_checkpoints + 1} at a time")]
    cache_dir, val_cache_dir = cache_dirs(options)
    for folder, given, rows in ((cache_dir, options.cache, media), (val_cache_dir, options.val_cache, val_media)):
        if folder and rows and (cached_launch or given):
            how = ("built first by --cached" if cached_launch else
                   f"--cache {given}" if folder == options.cache else f"--val_cache {given}")
            needs.append(cache_need(folder, options, rows, how))
    return needs


def nearest_existing(path: str) -> Path:
    p = Path(path).resolve()
    while not p.exists() and p != p.parent:
        p = p.parent
    return p


def disk_check(free: int, needs: list[Need]) -> Check:
    """The verdict on one disk: ``free`` bytes against the sum of ``needs`` (fail below it, warn below 1.5x)."""
    needed = sum(need.bytes for need in needs)
    parts = " + ".join(f"{need.what} {human(need.bytes)} in {need.path}"
                       + (f" ({need.note})" if need.note else "") for need in needs)
    detail = f"{human(free)} free, needs about {human(needed)}: {parts}"
    status = FAIL if free < needed else WARN if free < 1.5 * needed else OK
    return Check("disk", status, detail, "" if status == OK else
                 "free space, or point " + (" / ".join(need.path for need in needs)) + " at a larger disk")


def disk_checks(options, media: tuple[int, int] | None, cached_launch: bool = False) -> list[Check]:
    """One check per disk the run writes to (folders on one disk share its free space)."""
    from diffsynth_mbc.training.plan.run_length import count_media

    val_media = None
    if options.val_metadata_path and os.path.isfile(options.val_metadata_path):
        val_media = count_media(options.val_metadata_path)
    by_disk: dict[int, list[Need]] = {}
    where = {}
    for need in disk_needs(options, media, cached_launch, val_media):
        existing = nearest_existing(need.path)
        device = existing.stat().st_dev
        by_disk.setdefault(device, []).append(need)
        where.setdefault(device, existing)
    return [disk_check(shutil.disk_usage(where[device]).free, needs) for device, needs in by_disk.items()]
