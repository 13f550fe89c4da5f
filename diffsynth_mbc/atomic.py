"""Write files so that a reader never sees half of one: temp file in the same folder, then rename."""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from pathlib import Path
from typing import IO, Iterator


@contextlib.contextmanager
def atomic_open(path: str | os.PathLike, mode: str = "w", **open_kwargs) -> Iterator[IO]:
    """Open a temp file beside ``path``; on clean exit it replaces ``path``, on error it is removed."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, mode, **open_kwargs) as handle:
            yield handle
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp_name, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp_name)
        raise


def atomic_write_text(path: str | os.PathLike, text: str, encoding: str = "utf-8") -> None:
    with atomic_open(path, "w", encoding=encoding, newline="") as handle:
        handle.write(text)


def atomic_write_json(path: str | os.PathLike, obj, **dumps_kwargs) -> None:
    dumps_kwargs.setdefault("ensure_ascii", False)
    dumps_kwargs.setdefault("indent", 2)
    atomic_write_text(path, json.dumps(obj, **dumps_kwargs) + "\n")


def atomic_save_safetensors(path: str | os.PathLike, tensors: dict, metadata: dict | None = None) -> int:
    """Serialise tensors as safetensors and write them atomically; returns the bytes written."""
    from safetensors.torch import save

    data = save({name: tensor.contiguous() for name, tensor in tensors.items()}, metadata=metadata)
    with atomic_open(path, "wb") as handle:
        handle.write(data)
    return len(data)
