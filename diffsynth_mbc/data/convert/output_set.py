"""Publishing the converter's outputs all at once: the set is written to a staging folder beside them and
only moved into place when every file was written, so metadata.csv never describes one run while
summary.json or rejects.csv describe another. Files we do not write are never touched.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

from diffsynth_mbc.atomic import atomic_write_text


class OutputError(OSError):
    """An output could not be written; the message names the path. Nothing was published."""


def _check_targets(output: Path, names) -> None:
    for name in names:
        target = output / name
        if target.exists() and not target.is_file():
            raise OutputError(f"cannot write {target}: it exists and is not a regular file; nothing was written")


def publish_output_set(output: Path, files: dict[str, str], stale: list[str] = ()) -> list[str]:
    """Write ``files`` ({name: text}) into ``output`` together and remove the ``stale`` names not in ``files``.

    Returns the stale names removed. On any failure, what was there before is left as it was.
    """
    stale = [name for name in stale if name not in files]
    try:
        output.mkdir(parents=True, exist_ok=True)
        _check_targets(output, list(files) + stale)
        staging = Path(tempfile.mkdtemp(prefix=".convert-staging-", dir=output))
    except OutputError:
        raise
    except OSError as exc:
        raise OutputError(f"cannot write to --output {output}: {exc.strerror or exc}; nothing was written") from None
    try:
        for name, text in files.items():
            atomic_write_text(staging / name, text)
        return _swap_in(output, staging, list(files), stale)
    except OutputError:
        raise
    except OSError as exc:
        where = exc.filename or output
        raise OutputError(f"cannot write {where}: {exc.strerror or exc}; nothing was published") from None
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _swap_in(output: Path, staging: Path, names: list[str], stale: list[str]) -> list[str]:
    """Move the previous files aside, the new ones in; on a failure put the previous ones back."""
    previous = staging / ".previous"
    previous.mkdir()
    moved_aside, moved_in = [], []
    try:
        for name in names + stale:
            if (output / name).exists():
                os.replace(output / name, previous / name)
                moved_aside.append(name)
        for name in names:
            os.replace(staging / name, output / name)
            moved_in.append(name)
    except OSError:
        for name in moved_in:
            os.replace(output / name, staging / name)
        for name in moved_aside:
            os.replace(previous / name, output / name)
        raise
    return [name for name in stale if name in moved_aside]
