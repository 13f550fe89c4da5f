"""Whose checkpoints a checkpoint folder holds: a run deletes or replaces only its own. Pure: no torch.

A fresh run pointed at a folder that holds another run's checkpoints is refused, naming them, unless it
resumes (it then goes on as that run) or is told to start over (``--start_over true``), which moves the
other run's checkpoints aside into ``replaced-<their run id>/`` rather than deleting them. Publishing never
replaces another run's folder, and pruning removes only the run's own checkpoints.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

REPLACED_PREFIX = "replaced-"


def owner(folder: str | Path) -> str | None:
    from diffsynth_mbc.training.checkpoints import read_manifest

    run_id = (read_manifest(folder) or {}).get("run_id")
    return run_id if isinstance(run_id, str) and run_id else None


def foreign_checkpoints(root: str | Path, run_id: str) -> list[tuple[Path, str | None]]:
    """The complete checkpoints in ``root`` that another run (or an unknown one) wrote: (folder, its run id)."""
    from diffsynth_mbc.training.checkpoints import complete_checkpoints

    found = [(folder, owner(folder)) for _step, folder in complete_checkpoints(root)]
    return [(folder, other) for folder, other in found if other != run_id]


def refusal(root: str | Path, foreign: list[tuple[Path, str | None]]) -> str:
    runs = sorted({other or "an unknown run" for _folder, other in foreign})
    names = ", ".join(folder.name for folder, _other in foreign[:5]) + (" ..." if len(foreign) > 5 else "")
    return (f"the checkpoint folder {root} holds {len(foreign)} checkpoint(s) of {', '.join(runs)} ({names}); "
            "a new run there would replace or prune them. Resume that run with --resume latest, start over with "
            f"--start_over true (they are moved into {Path(root) / (REPLACED_PREFIX + '<run id>')}/, not deleted), "
            "or give this run its own --output_path / --checkpoint_dir")


def set_aside(foreign: list[tuple[Path, str | None]]) -> list[Path]:
    """Move each foreign checkpoint into ``replaced-<its run id>/`` beside it; returns where they went."""
    moved = []
    for folder, other in foreign:
        target = folder.parent / f"{REPLACED_PREFIX}{other or 'unknown-run'}"
        target.mkdir(exist_ok=True)
        destination = target / folder.name
        suffix = 1
        while destination.exists():
            destination, suffix = target / f"{folder.name}.{suffix}", suffix + 1
        os.replace(folder, destination)
        moved.append(destination)
    return moved


def check_replaceable(final: Path, run_id: str | None) -> None:
    """Publishing over an existing folder is allowed only when it is this run's own checkpoint."""
    if final.exists() and (run_id is None or owner(final) != run_id):
        raise FileExistsError(f"checkpoint folder {final} exists and was not written by run {run_id}; "
                              "it is left as it is (move it away, or resume its run)")


def claim_folder(root: str | Path, run_id: str, start_over: bool, accelerator, status) -> None:
    """A fresh run's check of its checkpoint folder, on every rank alike: another run's checkpoints there are
    refused (ValueError naming them), or with ``start_over`` moved aside by rank 0. Every rank looks before
    any rank moves anything (a barrier between), so they all decide the same."""
    foreign = foreign_checkpoints(root, run_id)
    if foreign and not start_over:
        raise ValueError(refusal(root, foreign))
    accelerator.wait_for_everyone()
    if foreign and accelerator.is_main_process:
        moved = set_aside(foreign)
        status.update(phase=f"--start_over: moved {len(moved)} checkpoint(s) of another run into "
                            f"{moved[0].parent}")
        print(f"note: --start_over: {len(moved)} checkpoint(s) of another run moved into {moved[0].parent}",
              file=sys.stderr)
    accelerator.wait_for_everyone()
