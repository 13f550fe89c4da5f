"""The latent cache's format: file layout, keys, fingerprints, the index file. No torch.

Keys say what determines a stored tensor (see ``cli``'s docstring for the layout); an entry whose
key exists is complete, because every file is written to a temp name and renamed into place.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from diffsynth_mbc.errors import OptionsError
from diffsynth_mbc.run_layout import CACHE_ENTRIES, CACHE_INDEX, CACHE_TEXT

FORMAT = "diffsynth-mbc-latent-cache"
VERSION = 1
DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}
# Wan2.2-TI2V-5B at the team's training size, for the projection in the summary.
FULL_SIZE = {"height": 704, "width": 1280, "num_frames": 17, "z_dim": 48, "text_dim": 4096, "factor": 16}


class CacheError(OptionsError):
    """A cache that is missing, unfinished or built with other settings; the message says what differs.

    An OptionsError, so the training command reports it like any bad option (exit code 2).
    """


# ---------------------------------------------------------------------------------------------
# Identities and keys (no torch)


def _sha256(obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, ensure_ascii=False).encode("utf-8")).hexdigest()


def files_identity(paths) -> str:
    """sha256 of the files' names, sizes and mtimes (names relative to the folder given, if any)."""
    items = []
    for path in paths:
        path = Path(path)
        files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
        for file in files:
            stat = file.stat()
            name = str(file.relative_to(path)) if path.is_dir() else file.name
            items.append([path.name, name, stat.st_size, stat.st_mtime_ns])
    return "sha256:" + _sha256(items)


def demo_identity(seed: int) -> str:
    return f"demo-seed-{seed}"


def encoder_identities(text_encoder, vae, tokenizer_dir) -> dict:
    return {"vae": files_identity([vae]), "text_encoder": files_identity([text_encoder, tokenizer_dir])}


def model_dir_identities(model_dir) -> dict:
    from diffsynth_mbc.models.model_files import locate_model_files

    files = locate_model_files(model_dir)
    return encoder_identities(files.text_encoder, files.vae, files.tokenizer_dir)


def file_fingerprint(path) -> dict:
    """Resolved path, size and mtime of a media file; raises OSError if it cannot be read."""
    resolved = Path(path).resolve(strict=True)
    stat = resolved.stat()
    return {"path": str(resolved), "size": stat.st_size, "mtime_ns": stat.st_mtime_ns}


def entry_key(fingerprint: dict, settings: dict, bucket=None) -> str:
    """Frames other than the default (``settings["frames"]``) are part of the key; the default's keys are those of
    caches built before frame selection existed. So is the row's bucket under ``--buckets aspect`` (``bucket``: its
    ``data.media.buckets.Bucket``, the size the latent is encoded at), so a row whose bucket changes is encoded
    again; ``--buckets off`` keys are those of caches built before buckets existed."""
    keyed = {"version": VERSION, "file": fingerprint, "height": settings["height"], "width": settings["width"],
             "num_frames": settings["num_frames"], "vae": settings["vae"], "dtype": settings["dtype"]}
    if settings.get("frames"):
        keyed["frames"] = settings["frames"]
    if bucket is not None:
        keyed["bucket"] = bucket.name
    return _sha256(keyed)


def bucket_mode(settings: dict) -> str:
    """A cache's ``--buckets`` mode: recorded in its settings for ``aspect``; absent (``off``) in caches built
    with ``off`` and before buckets existed."""
    return settings.get("buckets", "off")


def text_key(caption: str, settings: dict) -> str:
    return _sha256({"version": VERSION, "caption": caption, "text_encoder": settings["text_encoder"],
                    "text_len": settings["text_len"], "dtype": settings["dtype"]})


def entry_relpath(key: str) -> str:
    return f"{CACHE_ENTRIES}/{key[:2]}/{key}.safetensors"


def text_relpath(key: str) -> str:
    return f"{CACHE_TEXT}/{key[:2]}/{key}.safetensors"


def file_sha256(path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def read_index(cache_dir) -> dict:
    """The finished cache's index; CacheError (naming the folder) if there is none or it is not one."""
    path = Path(cache_dir) / CACHE_INDEX
    try:
        index = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise CacheError(f"no finished latent cache in {cache_dir} ({CACHE_INDEX} is missing): build it with "
                         "`python -m diffsynth_mbc.cache ... --cache_dir " f"{cache_dir}` first") from None
    except (OSError, ValueError) as exc:
        raise CacheError(f"{path}: not a readable cache index ({exc})") from None
    if index.get("format") != FORMAT or index.get("version") != VERSION:
        raise CacheError(f"{path}: not a {FORMAT} index of version {VERSION} "
                         f"(format {index.get('format')!r}, version {index.get('version')!r})")
    return index


def projected_bytes_per_sample(height: int, width: int, num_frames: int, text_tokens: float,
                               text_share: float = 1.0, first_frame_share: float = 0.0, dtype_bytes: int = 2,
                               z_dim: int = 48, text_dim: int = 4096, factor: int = 16) -> dict:
    """Bytes one video row costs: latent + its share of a caption's embedding (+ a stored first frame)."""
    latent_cells = z_dim * ((num_frames - 1) // 4 + 1) * (height // factor) * (width // factor)
    latent = latent_cells * dtype_bytes
    first_frame = z_dim * (height // factor) * (width // factor) * dtype_bytes * first_frame_share
    text = text_tokens * text_dim * dtype_bytes * text_share
    total = latent + first_frame + text
    return {"latent_bytes": latent, "first_frame_bytes": round(first_frame), "text_bytes": round(text),
            "bytes": round(total), "mib": round(total / 2**20, 3)}


def safetensors_is_whole(path) -> bool:
    """Whether a safetensors file is complete: its header parses and the file is exactly as long as the header
    says (a killed copy or a full disk leaves it shorter). Reads only the header."""
    try:
        with open(path, "rb") as handle:
            header_len = int.from_bytes(handle.read(8), "little")
            if not 2 <= header_len <= 100 << 20:
                return False
            header = json.loads(handle.read(header_len))
            end = max((spec["data_offsets"][1] for name, spec in header.items() if name != "__metadata__"),
                      default=0)
            return os.fstat(handle.fileno()).st_size == 8 + header_len + end
    except (OSError, ValueError, KeyError, TypeError, IndexError):
        return False


def stale_rows(rows: list[dict], base_path, limit: int = 5) -> tuple[list[str], int]:
    """Rows whose media changed since they were encoded (size or modification time differ, or gone).

    A stat per row, no reading. Returns (descriptions of the first ``limit``, how many in all); rows from
    caches built before fingerprints were recorded are not checked.
    """
    described, count = [], 0
    for row in rows:
        if "size" not in row or "mtime_ns" not in row:
            continue
        path = Path(base_path) / row["file"]
        try:
            stat = path.stat()
            changed = (stat.st_size, stat.st_mtime_ns) != (row["size"], row["mtime_ns"])
            what = f"size {row['size']} -> {stat.st_size}" if stat.st_size != row["size"] else "modified"
        except OSError:
            changed, what = True, "missing"
        if changed:
            count += 1
            if len(described) < limit:
                described.append(f"metadata row {row['row']} ({row['file']}: {what})")
    return described, count
