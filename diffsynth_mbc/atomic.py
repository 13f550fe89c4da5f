"""Write files so that a reader never sees half of one: temp file in the same folder, then rename."""

from __future__ import annotations

import contextlib
import errno
import filecmp
import json
import os
import tempfile
from pathlib import Path
from typing import IO, Iterator


def current_umask() -> int:
    """The process umask, read without changing it (os.umask would, for a moment, in every thread)."""
    try:
        with open("/proc/self/status", encoding="ascii") as status:
            for line in status:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike, suffix: str = ".tmp", keep_if_same: bool = False) -> Iterator[Path]:
    """A temp file name beside ``path`` (for writers that need a name, such as a video encoder, which picks
    its format from ``suffix``); on clean exit the temp file replaces ``path``, on error it is removed.
    ``keep_if_same``: when ``path`` already holds the same bytes it is left as it is (its mtime too)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=suffix, dir=path.parent)
    try:
        # mkstemp creates 0600; give the file the mode a plain open() would, so a dashboard or a
        # teammate running as another user can read what the run writes.
        os.fchmod(fd, 0o666 & ~current_umask())
        os.close(fd)
        yield Path(tmp_name)
        if keep_if_same and path.is_file() and filecmp.cmp(path, tmp_name, shallow=False):
            os.unlink(tmp_name)
        else:
            os.replace(tmp_name, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp_name)
        raise


@contextlib.contextmanager
def atomic_open(path: str | os.PathLike, mode: str = "w", **open_kwargs) -> Iterator[IO]:
    """Open a temp file beside ``path``; on clean exit it replaces ``path`` (flushed to disk first), on error
    it is removed."""
    with atomic_path(path) as tmp_path, open(tmp_path, mode, **open_kwargs) as handle:
        yield handle
        handle.flush()
        os.fsync(handle.fileno())


def atomic_write_text(path: str | os.PathLike, text: str, encoding: str = "utf-8") -> None:
    with atomic_open(path, "w", encoding=encoding, newline="") as handle:
        handle.write(text)


def atomic_write_json(path: str | os.PathLike, obj, **dumps_kwargs) -> None:
    dumps_kwargs.setdefault("ensure_ascii", False)
    dumps_kwargs.setdefault("indent", 2)
    atomic_write_text(path, json.dumps(obj, **dumps_kwargs) + "\n")


def write_json_even_when_full(path: str | os.PathLike, obj) -> None:
    """``atomic_write_json``, or, when the disk is full (no room for the temp file), ``obj`` as compact JSON over
    the existing file in place, within the blocks it already has: a status file still says how a run ended when
    its log folder filled up. A reader may catch that rewrite half done (and keep its previous read); a rewrite
    that would need more room than the file has is not tried, the original error is raised instead."""
    try:
        atomic_write_json(path, obj)
    except OSError as exc:
        if exc.errno not in (errno.ENOSPC, errno.EDQUOT):
            raise
        data = (json.dumps(obj, ensure_ascii=False, separators=(",", ":")) + "\n").encode("utf-8")
        try:
            fd = os.open(path, os.O_WRONLY)
        except OSError:
            raise exc from None
        try:
            st = os.fstat(fd)
            if len(data) > max(st.st_size, st.st_blocks * 512):
                raise exc from None
            view = memoryview(data)
            while view:
                view = view[os.pwrite(fd, view, len(data) - len(view)):]
            os.ftruncate(fd, len(data))
        finally:
            os.close(fd)


def atomic_save_safetensors(path: str | os.PathLike, tensors: dict, metadata: dict | None = None) -> int:
    """Serialise tensors as safetensors and write them atomically; returns the bytes written. The same tensors and
    metadata give the same bytes (``canonical_safetensors``)."""
    from safetensors.torch import save

    data = canonical_safetensors(save({name: tensor.contiguous() for name, tensor in tensors.items()},
                                      metadata=metadata))
    with atomic_open(path, "wb") as handle:
        handle.write(data)
    return len(data)


def canonical_safetensors(data: bytes) -> bytes:
    """The safetensors bytes with the header's ``__metadata__`` in sorted key order. safetensors writes the metadata
    from a hash map, in an order that changes from process to process, so two runs that train the same weights
    would otherwise write different files. The tensors' entries and data are left as they are; the header is padded
    with spaces to a multiple of 8 bytes, as safetensors pads it."""
    length = int.from_bytes(data[:8], "little")
    header = json.loads(data[8:8 + length])
    if "__metadata__" not in header:
        return data
    header["__metadata__"] = dict(sorted(header["__metadata__"].items()))
    text = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    text += b" " * (-len(text) % 8)
    return len(text).to_bytes(8, "little") + text + data[8 + length:]
