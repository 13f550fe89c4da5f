"""Why a checkpoint could not be written, in words. No torch.

A full disk reaches the training as whatever the writer says: torch's ``[enforce fail at
inline_container.cc:...]`` or ``iostream error``, safetensors' ``IoError(... StorageFull ...)``, or an
``OSError`` with ``ENOSPC``. ``write_failure`` names the folder, says "no space left" when that is the
cause (the error says so, or the writer failed and the disk now has less free space than a checkpoint
needs), and how much a checkpoint needs against what is free.
"""

from __future__ import annotations

import errno
import os
import shutil
from pathlib import Path

# What writers say when a write fails part-way; with too little free space left, that is a full disk.
_WRITE_FAILED = ("inline_container.cc", "iostream error", "file write failed", "PytorchStreamWriter", "StorageFull",
                 "unexpected pos")
_NO_SPACE = ("No space left on device", "Disk quota exceeded", "StorageFull")


class CheckpointWriteError(RuntimeError):
    """A checkpoint could not be written; the message names the folder and, for a full disk, the space needed."""


def folder_bytes(folder: str | os.PathLike | None) -> int:
    """Bytes of every file under ``folder`` (0 if it is missing)."""
    if folder is None or not Path(folder).is_dir():
        return 0
    return sum(path.stat().st_size for path in Path(folder).rglob("*") if path.is_file())


def free_bytes(folder: str | os.PathLike) -> int | None:
    """Free bytes on the filesystem holding ``folder`` (or its nearest existing parent); None if unknown."""
    path = Path(folder).absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    try:
        return shutil.disk_usage(path).free
    except OSError:
        return None


def out_of_space(error: BaseException | str, free: int | None, needed: int | None) -> bool:
    """Whether a failed write was a full disk: the error says so, or a writer failed with less than ``needed``
    bytes free."""
    if isinstance(error, OSError) and error.errno in (errno.ENOSPC, errno.EDQUOT):
        return True
    text = str(error)
    if any(sign in text for sign in _NO_SPACE):
        return True
    return bool(needed) and free is not None and free < needed and any(sign in text for sign in _WRITE_FAILED)


def human(size: int | None) -> str:
    if size is None:
        return "unknown"
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if size >= scale:
            return f"{size / scale:.1f} {unit}"
    return f"{size} bytes"


def write_failure(name: str, root: str | os.PathLike, error: BaseException | str, *, free: int | None,
                  needed: int | None, previous: str | os.PathLike | None) -> str:
    """The message for checkpoint ``name`` not written under ``root`` (its partial folder already removed)."""
    kept = f"the previous checkpoint {previous} is intact" if previous else "there is no earlier checkpoint"
    said = error if isinstance(error, str) else f"{type(error).__name__}: {error}"
    detail = " ".join(said.split())[:300]
    if out_of_space(error, free, needed):
        return (f"could not write checkpoint {name} in {root}: no space left on that filesystem ({human(free)} free, "
                f"a checkpoint needs about {human(needed)}). The partial checkpoint was removed and {kept}. Free "
                f"space or point --checkpoint_dir at a larger disk, then continue with --resume latest. "
                f"(the writer said: {detail})")
    return (f"could not write checkpoint {name} in {root}: {detail}. The partial checkpoint "
            f"was removed and {kept}; continue with --resume latest once the folder can be written "
            f"({human(free)} free there, a checkpoint needs about {human(needed)}).")
