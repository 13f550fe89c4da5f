"""Whether catalogued media files are there: regular files (or links to one) inside the base path's real path.

Pure logic on the file system (no decoding). Each path gets its own reason, named by the codes below,
which are ``catalog.Reason``'s.
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass, field
from typing import Iterable

MISSING_FILE = "missing file"
NOT_A_FILE = "not a readable file"
OUTSIDE_BASE_PATH = "path outside --base_path"


def file_problems(paths: Iterable[str], base_path: str | None = None) -> dict[str, tuple[str, str]]:
    """Why each path that is not a regular file (nor a link to one) is not: path -> (reject code, detail).

    Paths left out of the answer are files. Each path gets its own reason: a symbolic link loop, a
    folder or a permission problem is named as such and never hides the other files of its folder.
    With ``base_path``, a file whose real path (symbolic links of its folders or of itself followed)
    is not inside the base's real path is rejected as outside it.
    Lists each folder once instead of a stat per file when many files share a folder: on network
    storage a listing costs a few round trips where 1,000 stats cost 1,000.
    """
    by_folder: dict[str, list[str]] = {}
    for path in paths:
        folder, _, name = path.rpartition(os.sep)
        by_folder.setdefault(folder or os.sep, []).append(name)
    real_base = None if base_path is None else os.path.join(os.path.realpath(base_path), "")
    problems: dict[str, tuple[str, str]] = {}
    for folder, names in by_folder.items():
        prefix = folder if folder.endswith(os.sep) else folder + os.sep
        listing = _list_folder(folder) if len(names) >= 16 else None
        real_folder = None
        for name in names:
            path = prefix + name
            if listing is not None and name not in listing.names:
                problem = (MISSING_FILE, path)
            else:
                problem = None if listing is not None and name in listing.files else _file_problem(path)
            if problem is None and real_base is not None:
                real_folder = real_folder or os.path.join(os.path.realpath(folder), "")
                linked = name in listing.links if listing is not None else os.path.islink(path)
                real = os.path.realpath(path) if linked else real_folder + name
                if not real.startswith(real_base):
                    problem = (OUTSIDE_BASE_PATH, f"{path} is {real} through a symbolic link, outside "
                                                         f"{real_base.rstrip(os.sep) or os.sep}")
            if problem:
                problems[path] = problem
    return problems


@dataclass
class _Listing:
    names: set[str] = field(default_factory=set)   # every entry of the folder
    files: set[str] = field(default_factory=set)   # regular files, or links to one
    links: set[str] = field(default_factory=set)   # symbolic links


def _list_folder(folder: str) -> _Listing | None:
    """One listing of ``folder``; None when it cannot be listed (each file is then checked on its own, which
    gives its own reason)."""
    found = _Listing()
    try:
        with os.scandir(folder) as listing:
            for entry in listing:
                found.names.add(entry.name)
                try:
                    if entry.is_symlink():
                        found.links.add(entry.name)
                    if entry.is_file():
                        found.files.add(entry.name)
                except OSError:   # a link loop, a permission problem: this entry's own reason, later
                    pass
    except FileNotFoundError:
        return found   # no folder: every name is missing
    except OSError:
        return None
    return found


def _file_problem(path: str) -> tuple[str, str] | None:
    """(reject code, detail) when ``path`` is not a regular file or a link to one, else None."""
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        if os.path.islink(path):
            return MISSING_FILE, f"{path}: symbolic link to {os.readlink(path)}, which does not exist"
        return MISSING_FILE, path
    except OSError as error:
        return NOT_A_FILE, f"{path}: {error.strerror or error}"
    if stat.S_ISREG(mode):
        return None
    kind = "a folder" if stat.S_ISDIR(mode) else "not a regular file"
    return NOT_A_FILE, f"{path}: {kind}"
