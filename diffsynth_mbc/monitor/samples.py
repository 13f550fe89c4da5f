"""The run's sample clips for the dashboard: which sets exist, and which file a ``/samples/...`` URL may name.

The folder comes from the run's status files (``samples_dir``), which the monitor treats as untrusted:
it must be named ``samples``, and a URL may only name ``step-NNNNNNNN/NN-slug.mp4|png`` inside it
(checked on the decoded text of each part, then on the resolved path, so neither ``..``, an absolute path, an
encoded escape nor a symlink leads anywhere else). A slug is letters and digits of any script joined by '-'
(``01-도시-거리-밤.mp4``); the listing gives each clip's full prompt from the set's ``prompts.json`` when there
is one (sets written before it existed show their slug). Byte ranges follow RFC 9110: one range per request; a Range header
that is not one byte range is ignored (the whole file, 200).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from urllib.parse import quote, unquote

from diffsynth_mbc.sample_prompts import PROMPTS_FILE

SET_NAME = re.compile(r"step-(\d{8})")
FILE_NAME = re.compile(r"([0-9]{2})-((?:[^\W_]|-){1,60})\.(mp4|png)")
CONTENT_TYPES = {"mp4": "video/mp4", "png": "image/png"}
MAX_SETS = 1000
MAX_FILES_PER_SET = 200
MAX_PROMPTS_FILE = 1 << 20   # bytes; a bigger prompts file is not read (its clips show their slugs)


def samples_root(snapshot: dict) -> Path | None:
    """The current run's samples folder, as its ranks' status files name it (rank 0 first)."""
    for rank in sorted(snapshot.get("ranks") or [], key=lambda r: r.get("rank", 0)):
        folder = rank.get("samples_dir")
        if isinstance(folder, str) and folder:
            path = Path(folder)
            if path.name == "samples" and path.is_absolute():
                return path
    return None


def read_prompts(folder: Path) -> dict[int, str]:
    """Clip number -> full prompt, from the set's prompts file; {} when it is missing or unreadable."""
    try:
        with open(folder / PROMPTS_FILE, "rb") as handle:
            raw = handle.read(MAX_PROMPTS_FILE + 1)
        data = json.loads(raw) if len(raw) <= MAX_PROMPTS_FILE else None
    except (OSError, ValueError):
        return {}
    entries = data.get("prompts") if isinstance(data, dict) else None
    return {entry["index"]: entry["prompt"] for entry in entries or []
            if isinstance(entry, dict) and type(entry.get("index")) is int and isinstance(entry.get("prompt"), str)}


def list_sets(root: Path | None) -> list[dict]:
    """[{step, name, clips: [{index, slug, prompt, video, still}]}] in step order; at most MAX_SETS sets.

    ``prompt`` is the full text (None for a set without a prompts file); URLs are percent-encoded."""
    if root is None or not root.is_dir():
        return []
    sets = []
    for folder in sorted(root.iterdir()):
        match = SET_NAME.fullmatch(folder.name)
        if not match or not folder.is_dir() or folder.is_symlink():
            continue
        clips: dict[str, dict] = {}
        prompts = read_prompts(folder)
        for file in sorted(folder.iterdir())[:2 * MAX_FILES_PER_SET]:
            name = FILE_NAME.fullmatch(file.name)
            if not name or not file.is_file():
                continue
            index = int(name.group(1))
            clip = clips.setdefault(name.group(1), {"index": index, "slug": name.group(2),
                                                    "prompt": prompts.get(index)})
            clip["video" if name.group(3) == "mp4" else "still"] = f"samples/{folder.name}/{quote(file.name)}"
        sets.append({"step": int(match.group(1)), "name": folder.name, "clips": list(clips.values())})
    return sets[-MAX_SETS:]


def resolve_file(root: Path | None, url_path: str) -> tuple[Path, str] | None:
    """The file a ``/samples/SET/FILE`` path names and its content type; None for anything else."""
    parts = url_path.split("/")
    if root is None or len(parts) != 4 or parts[:2] != ["", "samples"]:
        return None
    try:
        set_name, file_name = parts[2], unquote(parts[3], errors="strict")
    except UnicodeDecodeError:
        return None
    name = FILE_NAME.fullmatch(file_name)
    if not SET_NAME.fullmatch(set_name) or not name:
        return None
    try:
        real_root = root.resolve(strict=True)
        path = (root / set_name / file_name).resolve(strict=True)
    except OSError:
        return None
    if path.parent.parent != real_root or not path.is_file():
        return None
    return path, CONTENT_TYPES[name.group(3)]


_RANGE = re.compile(r"[ \t]*bytes[ \t]*=[ \t]*(\d*)-(\d*)[ \t]*", re.IGNORECASE)
_MAX_DIGITS = 18   # positions with more digits lie past any file; never handed to int() (its 4,300-digit limit)


def _position(digits: str) -> int:
    """A byte position as written; a number too long for any file becomes 10**18, without parsing it."""
    digits = digits.lstrip("0") or "0"
    return 10 ** _MAX_DIGITS if len(digits) > _MAX_DIGITS else int(digits)


def byte_range(header: str | None, size: int) -> tuple[int, int] | None | str:
    """``Range: bytes=a-b`` -> (first, last) inclusive; "unsatisfiable" for a range that starts past the end
    (or a zero-length suffix, or any range of an empty file); None for no header, and for a header to ignore.

    RFC 9110 section 14.2: a range unit other than ``bytes``, a header that does not parse, a range whose last
    position is before its first, and several ranges (this server sends no multipart answers) are ignored:
    the answer is 200 with the whole file.
    """
    if not header:
        return None
    match = _RANGE.fullmatch(header)
    if not match or (not match.group(1) and not match.group(2)):
        return None
    first, last = match.group(1), match.group(2)
    if not first:   # the last N bytes
        count = _position(last)
        if count == 0 or size == 0:
            return "unsatisfiable"
        return max(0, size - count), size - 1
    start = _position(first)
    if last and _position(last) < start:
        return None
    if start >= size:
        return "unsatisfiable"
    end = min(_position(last), size - 1) if last else size - 1
    return start, end
