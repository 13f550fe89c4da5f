"""The run's size table: each media file's displayed size, read from its header once and kept beside the run
(``OUTPUT/size_table.json``), keyed by the file's fingerprint (resolved path, byte size, mtime and inode change
time: ``cp -p`` or ``touch -r`` set a swapped file's size and mtime back, never its change time). The plan, the
doctor, the launch, the latent cache and the training's rank 0 look a file up by a ``stat``; only a file that is
new or changed since (another fingerprint) has its header read again, in parallel, with a progress bar and ETA on a
terminal (a line every 30 s in a log). No torch.

A file whose header cannot be read is kept as ``null`` (its row fails to decode later, named, like any bad file);
a missing file is not looked up at all. The table is written atomically, by one process (rank 0, or a command run
outside the training), and only into a folder that exists: a dry run or a plan before the first launch reads
without writing. It is not trusted as written: a table that cannot be read (damaged, another version) or whose
checksum says it changed since it was written (edited by hand) is read again from the files, and so is an entry
that is no size (``[10**30, 1]``, ``[true, true]``); each said once. A table of version 1 (fingerprints without the
change time) is no error: its files are read again.
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
import sys
from typing import Sequence

from diffsynth_mbc.atomic import atomic_write_text
from diffsynth_mbc.run_layout import SIZE_TABLE

VERSION = 2
WITHOUT_CHANGE_TIME = 1   # the version before: its fingerprints never match a file now, so every entry is read again
MAX_SIDE = 1 << 16   # pixels: no image or clip the training reads is wider or taller
SIZES_KEY = '"sizes":'   # written last: the table's checksum is that of the text after it
Size = tuple[int, int]
LONG_READ = 100   # files: a read of this many or more shows its progress
_READ_HERE: dict = {}   # fingerprint key: size, every header this process read (a plan reads the rows twice)


def table_path_in(folder: str | os.PathLike | None) -> str | None:
    """Where the size table of the run (or cache) writing into ``folder`` lives; None without a folder."""
    return os.path.join(os.fspath(folder), SIZE_TABLE) if folder else None


def fingerprint_key(path: str) -> str | None:
    """``size:mtime_ns:ctime_ns:resolved path`` of a regular file; None when it is missing or not a file."""
    return fingerprint_keys([path])[0]


def fingerprint_keys(paths: Sequence[str]) -> list[str | None]:
    """``fingerprint_key`` of each path. A catalogue's files share a few folders: each folder is resolved once, and
    a file that is no link resolves to its folder's resolved path and its name (one ``lstat`` a file, where
    ``realpath`` looked up every folder above it again: 170,000 files, 1.6 s then, 0.5 s now)."""
    folders: dict[str, str] = {}
    keys = []
    for path in paths:
        try:
            info = os.lstat(path)
            if stat.S_ISLNK(info.st_mode):
                resolved = os.path.realpath(path)
                info = os.stat(resolved)
            else:
                folder, name = os.path.split(path)
                if folder not in folders:
                    folders[folder] = os.path.realpath(folder or os.curdir)
                resolved = os.path.join(folders[folder], name)
        except (OSError, ValueError):
            keys.append(None)
            continue
        keys.append(f"{info.st_size}:{info.st_mtime_ns}:{info.st_ctime_ns}:{resolved}" if stat.S_ISREG(info.st_mode)
                    else None)
    return keys


def _path_of(key: str) -> str:
    return key.split(":", 3)[-1]


def _checksum(sizes_text: str) -> str:
    return hashlib.sha256(sizes_text.encode()).hexdigest()


def _sizes_text(text: str) -> str:
    """The ``sizes`` object of a table's text as it was written (last, after the version and checksum)."""
    start = text.find(SIZES_KEY)
    return text[start + len(SIZES_KEY):text.rstrip().rfind("}")] if start >= 0 else ""


def load_table(path: str | None) -> dict[str, Size | None]:
    """The table at ``path``; {} when there is none, or when it cannot be used or was changed since it was written
    (said once, then read again). Entries that are no size are left out (said once): their files are read again."""
    if not path or not os.path.isfile(path):
        return {}
    try:
        with open(path, encoding="utf-8") as handle:
            text = handle.read()
        saved = json.loads(text)
        if saved.get("version") == WITHOUT_CHANGE_TIME:
            _note(f"the size table {path} was written before a file's fingerprint held its inode change time")
            return {}
        if saved.get("version") != VERSION:
            raise ValueError(f"version {saved.get('version')!r}, not {VERSION}")
        sizes = dict(saved["sizes"])
    except (OSError, ValueError, TypeError, KeyError, AttributeError) as exc:
        _note(f"the size table {path} cannot be used ({type(exc).__name__}: {exc})")
        return {}
    if saved.get("sha256") != _checksum(_sizes_text(text)):
        _note(f"the size table {path} was changed since it was written (its checksum does not match)")
        return {}
    table, no_sizes = {}, []
    for key, value in sizes.items():
        if value is None or is_size(value):   # None: a file whose header could not be read
            table[key] = (value[0], value[1]) if value else None
        else:
            no_sizes.append(key)
    if no_sizes:
        first, one = no_sizes[0], len(no_sizes) == 1
        _note(f"{len(no_sizes):,} {'entry' if one else 'entries'} of the size table {path} {'is' if one else 'are'} "
              f"no size (first: {_path_of(first)}: {sizes[first]!r})", "those files")
    return table


def _note(problem: str, what: str = "the media sizes") -> None:
    if _is_main():
        print(f"note: {problem}; reading {what} from the files again", file=sys.stderr)


def is_size(value) -> bool:
    """Two whole numbers of pixels from 1 to MAX_SIDE (a bool is no number)."""
    return (isinstance(value, list) and len(value) == 2
            and all(type(side) is int and 1 <= side <= MAX_SIDE for side in value))


def save_table(path: str, table: dict[str, Size | None]) -> None:
    sizes = json.dumps({key: list(size) if size else None for key, size in table.items()}, separators=(",", ":"))
    atomic_write_text(path, f'{{"version":{VERSION},"sha256":"{_checksum(sizes)}",{SIZES_KEY}{sizes}}}\n')


def _is_main() -> bool:
    """Rank 0 of a launched job, or a command run on its own: the process that shows progress and writes."""
    return os.environ.get("RANK", "0") == "0"


def file_sizes(items: Sequence[tuple[str, str]], table_path: str | None = None, workers: int | None = None
               ) -> list[Size | None]:
    """(width, height) as displayed of every (path, media type): from the table at ``table_path``, else read from
    the file's header (and added to the table); None for a missing or unreadable file."""
    keys = fingerprint_keys([path for path, _ in items])
    table = load_table(table_path)
    to_read, unsaved = {}, False
    for (path, media_type), key in zip(items, keys):
        if key is None or key in table:
            continue
        unsaved = True
        if key in _READ_HERE:   # a fingerprint's size never changes: what this process read holds anywhere
            table[key] = _READ_HERE[key]
        elif key not in to_read:
            to_read[key] = (path, media_type)
    if to_read:
        read = _read_headers(to_read, workers)
        _READ_HERE.update(read)
        table.update(read)
    if unsaved:
        _keep(table_path, table, keys)
    return [table.get(key) if key else None for key in keys]


def _read_headers(to_read: dict[str, tuple[str, str]], workers: int | None) -> dict[str, Size | None]:
    from diffsynth_mbc.data.cache.progress import ProgressView
    from diffsynth_mbc.data.media.media_probe import probe_files

    # A long read shows its progress (a bar on a terminal, else a line every 30 s and one at the end); a few new or
    # changed files go unmentioned.
    view = ProgressView(len(to_read), 0, 1, enabled=_is_main() and len(to_read) >= LONG_READ,
                        label="reading media sizes", unit="files")
    try:
        results = probe_files(list(to_read.values()), workers=workers, on_done=lambda _result: view.advance())
    finally:
        view.close()
    return {key: (result.info.width, result.info.height) if result.info else None
            for key, result in zip(to_read, results)}


def _keep(table_path: str | None, table: dict[str, Size | None], current: list[str | None]) -> None:
    """Write the table (rank 0, into an existing folder), without the older versions of the files just looked up."""
    if not table_path or not _is_main() or not os.path.isdir(os.path.dirname(table_path) or "."):
        return
    now = {key for key in current if key}
    paths = {_path_of(key) for key in now}
    stale = [key for key in table if key not in now and _path_of(key) in paths]
    for key in stale:
        del table[key]
    try:
        save_table(table_path, table)
    except OSError as exc:   # a read-only output folder: the sizes were read, the next command reads them again
        print(f"note: could not keep the media sizes in {table_path} ({exc})", file=sys.stderr)


def first_rank_reads(read, is_first: bool, broadcast):
    """``read()`` on the first rank, its result on every rank (``broadcast``: rank 0's value everywhere), so the
    ranks of one job never size a row differently. A failure there stops every rank with its message: the first
    rank raises its own error, the others a MetadataError (a refused metadata row) or RuntimeError saying it."""
    from diffsynth_mbc.errors import MetadataError

    if not is_first:
        outcome, value = broadcast(None)
        if outcome == "ok":
            return value
        error = MetadataError if outcome == "MetadataError" else RuntimeError
        raise error(f"rank 0 stopped reading the media sizes: {value}")
    try:
        value = read()
    except Exception as exc:
        broadcast((type(exc).__name__, str(exc)))
        raise
    broadcast(("ok", value))
    return value
