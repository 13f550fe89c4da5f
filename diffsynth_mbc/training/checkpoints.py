"""Checkpoint folders: naming, which one is ``latest``, pruning, and whether a checkpoint fits this run. No torch.

A checkpoint is ``CHECKPOINTS/step-00001234/`` holding the LoRA (``lora.safetensors``, loadable by
DiffSynth), accelerate's saved state (optimizer, LR scheduler, RNG state of every rank) and
``checkpoint.json`` (step, epoch, data position, configuration fingerprint). It is written as
``.tmp-step-00001234.<run id>/`` and renamed when complete, so a crash mid-save leaves only a temp folder,
which is never picked as ``latest`` and is removed by the next save. A folder with a ``KEEP`` file
is never pruned.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time
from pathlib import Path

from diffsynth_mbc.atomic import atomic_write_text

MANIFEST = "checkpoint.json"
KEEP_MARKER = "KEEP"
_COMPLETE_NAME = re.compile(r"^step-(\d{8})$")
TEMP_PREFIX = ".tmp-"

# Settings a checkpoint must share with the run that resumes it (exact data position and weights).
FINGERPRINT_KEYS = ("world_size", "batch_size", "gradient_accumulation_steps", "dataset_repeat", "num_frames",
                    "height", "width", "lora_rank", "lora_alpha", "lora_target_modules", "metadata_sha256",
                    "metadata_rows", "seed", "num_epochs", "cache")


def checkpoint_name(step: int) -> str:
    return f"step-{step:08d}"


def temp_path(root: str | Path, step: int, attempt: str = "") -> Path:
    suffix = f".{attempt}" if attempt else ""
    return Path(root) / f"{TEMP_PREFIX}{checkpoint_name(step)}{suffix}"


def read_manifest(folder: str | Path) -> dict | None:
    try:
        manifest = json.loads((Path(folder) / MANIFEST).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return manifest if isinstance(manifest, dict) and "step" in manifest else None


def complete_checkpoints(root: str | Path) -> list[tuple[int, Path]]:
    """(step, folder) of every complete checkpoint under ``root``, oldest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = []
    for entry in root.iterdir():
        match = _COMPLETE_NAME.match(entry.name)
        if match and entry.is_dir() and read_manifest(entry) is not None:
            found.append((int(match.group(1)), entry))
    return sorted(found)


def find_latest(root: str | Path) -> Path | None:
    checkpoints = complete_checkpoints(root)
    return checkpoints[-1][1] if checkpoints else None


def resolve_resume(resume: str, root: str | Path) -> Path:
    """``latest`` or a path -> a complete checkpoint folder; ValueError saying why not."""
    if resume == "latest":
        latest = find_latest(root)
        if latest is None:
            raise ValueError(f"--resume latest: no complete checkpoint in {root}")
        return latest
    folder = Path(resume)
    if read_manifest(folder) is None:
        raise ValueError(f"--resume {resume}: not a complete checkpoint (no readable {MANIFEST})")
    return folder


def publish(temp_folder: Path, manifest: dict) -> Path:
    """Write the manifest last, then rename the temp folder into place. Returns the final folder."""
    atomic_write_text(temp_folder / MANIFEST, json.dumps(manifest, indent=2, ensure_ascii=False) + "\n")
    final = temp_folder.with_name(temp_folder.name[len(TEMP_PREFIX):].split(".")[0])
    if final.exists():
        shutil.rmtree(final)
    os.replace(temp_folder, final)
    return final


def prune(root: str | Path, keep_last: int) -> list[Path]:
    """Remove complete checkpoints beyond the newest ``keep_last`` (never a KEEP one) and stale temp folders."""
    root = Path(root)
    removed = []
    checkpoints = complete_checkpoints(root)
    for _step, folder in checkpoints[:max(0, len(checkpoints) - keep_last)]:
        if not (folder / KEEP_MARKER).exists():
            shutil.rmtree(folder, ignore_errors=True)
            removed.append(folder)
    for entry in root.iterdir() if root.is_dir() else ():
        if entry.name.startswith(TEMP_PREFIX) and entry.is_dir():
            shutil.rmtree(entry, ignore_errors=True)
            removed.append(entry)
    return removed


def fingerprint_differences(saved: dict, current: dict) -> list[str]:
    """Human lines for every fingerprint key whose value differs: ``world_size: checkpoint 2, this run 4``."""
    return [f"{key}: checkpoint {saved.get(key)!r}, this run {current.get(key)!r}"
            for key in FINGERPRINT_KEYS if saved.get(key) != current.get(key)]


class CheckpointSchedule:
    """Due every ``every_steps`` optimizer steps and/or every ``every_minutes``, whichever comes first."""

    def __init__(self, every_steps: int | None, every_minutes: float | None, monotonic=time.monotonic):
        self.every_steps = every_steps or None
        self.every_seconds = every_minutes * 60 if every_minutes else None
        self._monotonic = monotonic
        self._last = monotonic()

    @property
    def enabled(self) -> bool:
        return bool(self.every_steps or self.every_seconds)

    def due_by_steps(self, step: int) -> bool:
        return bool(self.every_steps) and step % self.every_steps == 0

    def due_by_time(self) -> bool:
        return bool(self.every_seconds) and self._monotonic() - self._last >= self.every_seconds

    def saved(self) -> None:
        self._last = self._monotonic()


def truncate_history(path: str | Path, last_step: int) -> int:
    """Keep the JSONL lines up to ``last_step`` (a resumed run repeats what came after); returns lines kept."""
    path = Path(path)
    if not path.exists():
        return 0
    kept = []
    with open(path, encoding="utf-8") as handle:
        for line in handle:
            try:
                record = json.loads(line)
            except ValueError:
                continue  # a torn last line from a killed process
            if isinstance(record, dict) and isinstance(record.get("step"), int) and record["step"] <= last_step:
                kept.append(json.dumps(record, ensure_ascii=False) + "\n")
    atomic_write_text(path, "".join(kept))
    return len(kept)
