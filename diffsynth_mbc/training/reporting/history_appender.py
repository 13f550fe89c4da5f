"""Appending whole lines to a rank's JSONL history, through a full disk and a deleted log folder. No torch.

Every line goes out with ``os.write`` on a descriptor opened ``O_APPEND``; the size after the last whole line
is remembered. A write that fails half-way (``ENOSPC``: the disk filled up in the middle of a line) is taken
back by truncating the file to that size, so its retry starts a fresh line instead of gluing itself to the
torn one (``"loss": 2.318{"step": 24, ...``). Where even the truncation fails, the next open cuts the file back
to its last newline (or, where it cannot, starts with a newline): a reader never meets two records on a line.

Before each write the descriptor's link count is checked: 0 means the file was deleted under the run (most
often with its whole log folder), and lines appended to it would reach nobody. The appender then opens the
history again at its path (recreating the folder) and, where no file is there yet, first copies the deleted
file's whole lines into it, so the charts keep the whole run. ``replaced`` says what happened, for a warning.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

COPY_CHUNK = 1 << 20
TAIL_SCAN = 1 << 20   # how far back a torn tail is looked for a newline before giving up and starting a new line


class HistoryAppender:
    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self._fd: int | None = None
        self._good = 0              # bytes in the open file up to the end of its last whole line
        self._new_line = False      # the file ends with a torn line that could not be cut off
        self.replaced: str | None = None   # set when the file was found deleted and started again

    def write_lines(self, pending) -> None:
        """Write the lines of ``pending`` (a deque of str ending in newlines) in order, removing each once it is
        whole in the file. Raises OSError with the failed line still first in ``pending``."""
        if self._fd is not None and os.fstat(self._fd).st_nlink == 0:
            self._reopen_after_deletion()
        if self._fd is None:
            self._open()
        while pending:
            data = pending[0].encode("utf-8")
            if self._new_line:
                data = b"\n" + data
            try:
                _write_all(self._fd, data)
            except OSError:
                self._take_back()
                raise
            self._good += len(data)
            self._new_line = False
            pending.popleft()

    def close(self) -> None:
        if self._fd is not None:
            with contextlib.suppress(OSError):
                os.close(self._fd)
            self._fd = None

    # -- inside --------------------------------------------------------------------------------
    def _open(self) -> None:
        fd = os.open(self.path, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o666)
        try:
            self._good, self._new_line = _cut_torn_tail(fd)
        except OSError:
            os.close(fd)
            raise
        self._fd = fd

    def _take_back(self) -> None:
        """Remove the part of a line a failed write left; if that is impossible, close (the next open repairs)."""
        try:
            os.ftruncate(self._fd, self._good)
        except OSError:
            self.close()


    def _reopen_after_deletion(self) -> None:
        """Start the file again at its path; on failure the deleted one stays open, to be tried again."""
        old, whole = self._fd, self._good
        self._fd = None
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            created = not self.path.exists()
            self._open()
            copied = _copy_lines(old, self._fd, whole) if created and self._good == 0 else 0
        except OSError:
            self.close()
            self._fd, self._good = old, whole
            raise
        os.close(old)
        self._good += copied
        self.replaced = (f"{self.path} was deleted during the run; it was started again"
                         + (f" with the {copied} bytes of history written before" if copied else ""))


def _copy_lines(source: int, target: int, length: int) -> int:
    """Append the first ``length`` bytes of ``source`` (whole lines) to ``target``; returns the bytes copied. A
    failure half-way is taken back (the target is emptied again) and raised."""
    done = 0
    try:
        while done < length:
            chunk = os.pread(source, min(COPY_CHUNK, length - done), done)
            if not chunk:
                break
            _write_all(target, chunk)
            done += len(chunk)
    except OSError:
        os.ftruncate(target, 0)
        raise
    return done


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def _cut_torn_tail(fd: int) -> tuple[int, bool]:
    """(size, whether the next line must start with a newline) after cutting off a last line without its newline
    (a write that failed half-way, a process killed while writing). Where it cannot be cut, it stays, ended by
    the newline the next line starts with: one malformed line, which readers skip, instead of a glued record."""
    size = os.fstat(fd).st_size
    if size == 0 or os.pread(fd, 1, size - 1) == b"\n":
        return size, False
    start = max(0, size - TAIL_SCAN)
    cut = os.pread(fd, size - start, start).rfind(b"\n")
    if cut < 0 and start > 0:
        return size, True
    try:
        os.ftruncate(fd, start + cut + 1)
    except OSError:
        return size, True
    return start + cut + 1, False
