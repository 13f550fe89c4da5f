"""Noticing that a rank's log folder was deleted or replaced during the run, and taking its lock again. No torch.

The launcher holds an flock on ``LOG_DIR/.train.lock`` (``.train.nodeR.lock`` on node R of several: torchrun's
``GROUP_RANK``), so a second run cannot take the folder. Delete the folder and that lock is gone with it: the
status writer (``status_writer``) recreates the folder with its next write, and ``LogFolderWatch`` sees the
new inode; the rank then opens the same lock file name in the new folder and takes it in shared mode (every
rank of the run may hold it; a second launcher's exclusive ``flock -n`` is refused, and ``stop`` finds the
ranks by it as before).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from pathlib import Path

from diffsynth_mbc.run_layout import LOCK_PREFIX, LOCK_SUFFIX, lock_name


def held_lock_name(folder: str | os.PathLike) -> str | None:
    """The name of the run lock in ``folder`` that this process has open (inherited from the launcher), if any."""
    real = os.path.realpath(folder)
    try:
        descriptors = os.listdir("/proc/self/fd")
    except OSError:
        return None
    for fd in descriptors:
        try:
            head, name = os.path.split(os.readlink(f"/proc/self/fd/{fd}"))
        except OSError:
            continue
        if head == real and name.startswith(LOCK_PREFIX) and name.endswith(LOCK_SUFFIX):
            return name
    return None


def run_lock_name(folder: str | os.PathLike, environ=os.environ) -> str | None:
    """The lock of this node's run in ``folder``: the one this process holds open, else (the ranks of a launch do
    not inherit the launcher's descriptor) this node's lock name where that file exists; None without a launcher."""
    held = held_lock_name(folder)
    if held is not None:
        return held
    try:
        node = int(environ.get("GROUP_RANK") or environ.get("MACHINE_RANK") or 0)
    except ValueError:
        node = 0
    name = lock_name(node)
    return name if (Path(folder) / name).is_file() else None


def _identity(folder: Path) -> tuple[int, int] | None:
    try:
        st = os.stat(folder)
    except OSError:
        return None
    return st.st_dev, st.st_ino


class LogFolderWatch:
    def __init__(self, folder: str | os.PathLike):
        self.folder = Path(folder)
        self.identity = _identity(self.folder)
        self.lock_name = run_lock_name(self.folder)
        self._lock_handle = None

    def replaced(self) -> bool:
        """True once each time the folder is found to be another one than before (deleted and recreated)."""
        now = _identity(self.folder)
        if now is None or now == self.identity:
            return False
        first, self.identity = self.identity is None, now
        return not first

    def retake_lock(self) -> str:
        """Open and flock (shared) the run's lock file in the new folder; says what happened, for the warning."""
        if self.lock_name is None:
            return "no run lock was held in it (started without the launcher)"
        path = self.folder / self.lock_name
        try:
            handle = open(path, "a")
        except OSError as exc:
            return f"its lock {path} could not be opened again ({exc})"
        try:
            fcntl.flock(handle, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except OSError:
            handle.close()
            return f"its lock {path} is held by another process (another run on this folder?)"
        if self._lock_handle is not None:
            with contextlib.suppress(OSError):
                self._lock_handle.close()
        self._lock_handle = handle
        return f"its lock {path} is held again"

    def close(self) -> None:
        if self._lock_handle is not None:
            with contextlib.suppress(OSError):
                self._lock_handle.close()
            self._lock_handle = None
