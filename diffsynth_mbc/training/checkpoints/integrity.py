"""Whether a checkpoint folder is whole: every file as it was written, every rank's state present. No torch.

When a checkpoint is published, ``checkpoint.json`` lists every file with its size and sha256
(``files``) and the number of ranks that wrote it (``world_size``). A resume checks both: a truncated or altered
file, or one of those ranks whose ``random_states_<rank>.pkl`` is missing (a node that saved elsewhere), makes
the checkpoint damaged, and the resume falls back to an older intact one or refuses, naming the file.
"""

from __future__ import annotations

import os
from pathlib import Path

from diffsynth_mbc.data.cache.index import file_sha256
from diffsynth_mbc.run_layout import CHECKPOINT_MANIFEST, rank_state_file


def rank_state_files(world_size: int) -> list[str]:
    """The files accelerate writes once per rank: each rank's RNG state."""
    return [rank_state_file(rank) for rank in range(world_size)]


def file_digest(path: Path) -> dict:
    return {"size": path.stat().st_size, "sha256": file_sha256(path)}


def inventory(folder: str | os.PathLike) -> dict[str, dict]:
    """{relative path: {size, sha256}} of every file under ``folder`` except the manifest."""
    folder = Path(folder)
    files = {}
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        name = path.relative_to(folder).as_posix()
        if name != CHECKPOINT_MANIFEST:
            files[name] = file_digest(path)
    return files


def missing_rank_files(names, world_size: int) -> list[str]:
    present = set(names)
    return [name for name in rank_state_files(world_size) if name not in present]


def damage(folder: str | os.PathLike, manifest: dict) -> str | None:
    """None if the checkpoint is whole (every file as written, a state for each of the ranks that wrote it); else what
    is wrong, naming the file. A resume on another number of ranks is no damage (training/plan/elastic.py)."""
    folder = Path(folder)
    if "files" not in manifest:
        return None   # saved before checkpoints listed their files: nothing to check against
    files = manifest["files"]
    if not isinstance(files, dict):
        return f"{folder / CHECKPOINT_MANIFEST}: its file list is unreadable"
    expected_ranks = manifest.get("world_size")
    if expected_ranks:
        missing = missing_rank_files(files, int(expected_ranks))
        if missing:
            return f"{folder / missing[0]}: missing (the state of rank {missing[0].split('_')[-1].split('.')[0]}; " \
                   "a checkpoint folder must be shared by every node)"
    for name, expected in files.items():
        path = folder / name
        try:
            size = path.stat().st_size
        except OSError:
            return f"{path}: missing"
        if size != expected.get("size"):
            return f"{path}: {size} bytes, {expected.get('size')} when it was saved (truncated or altered)"
        if file_digest(path)["sha256"] != expected.get("sha256"):
            return f"{path}: content differs from when it was saved (sha256 mismatch)"
    return None
