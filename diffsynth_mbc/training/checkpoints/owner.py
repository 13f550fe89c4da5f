"""Whose checkpoints and LoRA files a run's folders hold: a run deletes or replaces only its own. Pure: no torch.

A fresh run pointed at folders that hold another run's checkpoints or LoRA files (``lora.safetensors``, ``lora-best``,
``epoch-001``, ``step-N``, their ``_ema`` twins: each file names its run in its metadata) is refused, naming them,
unless it resumes (it then goes on as that run) or is told to start over (``--start_over true``), which moves
everything of the other run aside into the checkpoint folder's ``replaced-<their run id>/`` rather than deleting or
overwriting it. Publishing never replaces another run's folder, and pruning removes only the run's own checkpoints.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from diffsynth_mbc.run_layout import LORA_FILE, replaced_folder_name
from diffsynth_mbc.training.distributed.collectives import wait_for_everyone

CLAIMING = "ranks claiming the run's folders"   # what a rank at claim_folder's barriers waits for


def owner(folder: str | Path) -> str | None:
    from diffsynth_mbc.training.checkpoints.folder import read_manifest

    run_id = (read_manifest(folder) or {}).get("run_id")
    return run_id if isinstance(run_id, str) and run_id else None


def foreign_checkpoints(root: str | Path, run_id: str) -> list[tuple[Path, str | None]]:
    """The complete checkpoints in ``root`` that another run (or an unknown one) wrote: (folder, its run id)."""
    from diffsynth_mbc.training.checkpoints.folder import complete_checkpoints

    found = [(folder, owner(folder)) for _step, folder in complete_checkpoints(root)]
    return [(folder, other) for folder, other in found if other != run_id]


def lora_file_owner(path: str | Path) -> str | None:
    """The run id in a safetensors file's metadata (read from its header alone); None when it has none."""
    try:
        with open(path, "rb") as handle:
            length = int.from_bytes(handle.read(8), "little")
            header = json.loads(handle.read(min(length, 100_000_000)))
        run_id = header.get("__metadata__", {}).get("run_id")
    except (OSError, ValueError, AttributeError):
        return None
    return run_id if isinstance(run_id, str) and run_id else None


def foreign_lora_files(output: str | Path, run_id: str) -> list[tuple[Path, str | None]]:
    """The LoRA files in ``output`` that another run (or an unknown one) wrote: (file, its run id)."""
    output = Path(output)
    if not output.is_dir():
        return []
    found = [(path, lora_file_owner(path)) for path in sorted(output.iterdir())
             if LORA_FILE.match(path.name) and path.is_file()]
    return [(path, other) for path, other in found if other != run_id]


def refusal(root: str | Path, foreign: list[tuple[Path, str | None]], output: str | Path | None = None,
            log_dir: str | Path | None = None) -> str:
    runs = sorted({other or "an unknown run" for _folder, other in foreign})
    names = ", ".join(folder.name for folder, _other in foreign[:5]) + (" ..." if len(foreign) > 5 else "")
    folders = [("--output_path", output), ("--checkpoint_dir", root), ("--log_dir", log_dir)]
    now = "; ".join(f"{flag} is now {value}" for flag, value in folders if value is not None)
    return (f"the run's folders hold {len(foreign)} checkpoint(s) or LoRA file(s) of {', '.join(runs)} ({names}); "
            "a new run there would replace, overwrite or prune them. Resume that run with --resume latest, start "
            f"over with --start_over true (they are moved into {Path(root) / replaced_folder_name('<run id>')}/, not "
            "deleted), or give this run folders of its own: --output_path (its checkpoint and log folders follow it "
            f"unless --checkpoint_dir or --log_dir is given{'; ' + now if now else ''})")


def set_aside(foreign: list[tuple[Path, str | None]], root: str | Path | None = None) -> list[Path]:
    """Move each foreign checkpoint or file into ``replaced-<its run id>/`` of ``root`` (default: the folder
    beside it); returns where they went."""
    moved = []
    for folder, other in foreign:
        target = Path(root or folder.parent) / replaced_folder_name(other or "unknown-run")
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


def foreign_outputs(root: str | Path, output: str | Path, run_id: str) -> list[tuple[Path, str | None]]:
    """Another run's checkpoints in ``root`` and LoRA files in ``output``."""
    return foreign_checkpoints(root, run_id) + foreign_lora_files(output, run_id)


def check_claim(root: str | Path, output: str | Path, run_id: str, start_over: bool,
                log_dir: str | Path | None = None) -> None:
    """A fresh run's refusal, from the files alone: another run's checkpoints or LoRA files without --start_over."""
    foreign = foreign_outputs(root, output, run_id)
    if foreign and not start_over:
        raise ValueError(refusal(root, foreign, output, log_dir))


def claim_folder(root: str | Path, output: str | Path, run_id: str, start_over: bool, accelerator, status,
                 log_dir: str | Path | None = None) -> None:
    """A fresh run's claim of its folders, on every rank alike: another run's checkpoints and LoRA files there are
    refused (ValueError naming them), or with ``start_over`` moved aside by rank 0 into the checkpoint folder's
    ``replaced-<run id>/``. Every rank looks before any rank moves anything (a barrier between), so they all
    decide the same."""
    check_claim(root, output, run_id, start_over, log_dir)
    foreign = foreign_outputs(root, output, run_id)
    wait_for_everyone(accelerator, status, CLAIMING)
    if foreign and accelerator.is_main_process:
        Path(root).mkdir(parents=True, exist_ok=True)
        moved = set_aside(foreign, root)
        places = sorted({str(path.parent) for path in moved})
        status.update(phase=f"--start_over: moved {len(moved)} checkpoint(s) and LoRA file(s) of another run into "
                            f"{', '.join(places)}")
        print(f"note: --start_over: {len(moved)} checkpoint(s) and LoRA file(s) of another run moved into "
              f"{', '.join(places)}", file=sys.stderr)
    wait_for_everyone(accelerator, status, CLAIMING)
