"""A checkpoint folder as files: the names of its checkpoints, which are complete, which one ``--resume`` means,
which are damaged. Pure: no torch (what a resume can refuse from the files alone is decided here, before anything
loads).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from diffsynth_mbc.run_layout import CHECKPOINT_MANIFEST, checkpoint_temp_name, damaged_name, step_of_folder
from diffsynth_mbc.training.checkpoints.integrity import damage


def temp_path(root: str | Path, step: int, attempt: str = "") -> Path:
    return Path(root) / checkpoint_temp_name(step, attempt)


def read_manifest(folder: str | Path) -> dict | None:
    try:
        manifest = json.loads((Path(folder) / CHECKPOINT_MANIFEST).read_text(encoding="utf-8"))
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
        step = step_of_folder(entry.name)
        if step is not None and entry.is_dir() and read_manifest(entry) is not None:
            found.append((step, entry))
    return sorted(found)


def unreadable_checkpoints(root: str | Path) -> list[Path]:
    """Folders named as checkpoints whose manifest is missing or unreadable (cut off by a crash, damaged since):
    no resume can start from them, and a run that reaches their step cannot publish there."""
    root = Path(root)
    if not root.is_dir():
        return []
    return sorted(entry for entry in root.iterdir()
                  if step_of_folder(entry.name) is not None and entry.is_dir() and read_manifest(entry) is None)


def set_aside_unreadable(root: str | Path, after_step: int) -> list[Path]:
    """Move the unreadable checkpoint folders past ``after_step`` (the step a run resumes from) to
    ``damaged-<name>`` beside them, so the run can write that step again; returns where they went."""
    moved = []
    for folder in unreadable_checkpoints(root):
        if step_of_folder(folder.name) <= after_step:
            continue
        target, suffix = folder.with_name(damaged_name(folder.name)), 1
        while target.exists():
            target, suffix = folder.with_name(damaged_name(folder.name, suffix)), suffix + 1
        os.replace(folder, target)
        moved.append(target)
    return moved


def describe_unreadable(folder: Path) -> str:
    manifest = folder / CHECKPOINT_MANIFEST
    why = "is missing" if not manifest.exists() else "cannot be read (damaged or cut off)"
    return f"skipping {folder.name}: its {CHECKPOINT_MANIFEST} {why}"


def find_latest(root: str | Path) -> Path | None:
    checkpoints = complete_checkpoints(root)
    return checkpoints[-1][1] if checkpoints else None


def resolve_resume(resume: str, root: str | Path, report=None) -> Path:
    """``latest`` or a path -> an intact checkpoint folder; ValueError saying why not.

    ``latest`` falls back from a damaged checkpoint (a file truncated or altered since it was saved, a
    rank's state missing) to the newest intact one, telling ``report`` which file was damaged; an
    explicit path that is damaged is refused, naming the file. A resume is exact or does not happen.
    """
    if resume == "latest":
        checkpoints = complete_checkpoints(root)
        newest = checkpoints[-1][0] if checkpoints else -1
        for folder in unreadable_checkpoints(root):
            if report and step_of_folder(folder.name) > newest:
                report(describe_unreadable(folder))
        if not checkpoints:
            raise ValueError(f"--resume latest: no complete checkpoint in {root}")
        for _step, folder in reversed(checkpoints):
            problem = damage(folder, read_manifest(folder))
            if problem is None:
                return folder
            if report:
                report(f"skipping damaged checkpoint {folder.name}: {problem}")
        raise ValueError(f"--resume latest: every checkpoint in {root} is damaged (newest first: "
                         f"{damage(checkpoints[-1][1], read_manifest(checkpoints[-1][1]))})")
    folder = Path(resume)
    manifest = read_manifest(folder)
    if manifest is None:
        raise ValueError(f"--resume {resume}: not a complete checkpoint (no readable {CHECKPOINT_MANIFEST})")
    problem = damage(folder, manifest)
    if problem:
        raise ValueError(f"--resume {resume}: the checkpoint is damaged: {problem}. Resume from another "
                         "checkpoint (--resume latest picks the newest intact one)")
    return folder


def resumed_run_id(resume: str | None, root: str | Path) -> str | None:
    """The run id a ``--resume`` continues (the newest complete checkpoint's for ``latest``), read from its
    manifest without checking the files: the load checks them, and corrects the id if it falls back."""
    if not resume:
        return None
    if resume == "latest":
        found = complete_checkpoints(root)
        manifest = read_manifest(found[-1][1]) if found else None
    else:
        manifest = read_manifest(resume)
    run_id = (manifest or {}).get("run_id")
    return run_id if isinstance(run_id, str) and run_id else None


def different_configuration(folder: Path, differences: list[str]) -> str:
    return (f"checkpoint {folder} was made with a different configuration:\n  " + "\n  ".join(differences)
            + "\nresume with the checkpoint's settings, or pass --force_resume true to resume with this run's (the "
              "continuation will not be the run the checkpoint came from)")
