"""The run's sample clips for the dashboard: which sets exist, and which file a ``/samples/...`` URL may name.

The folder comes from the run's status files (``samples_dir``), which the monitor treats as untrusted:
it must be named ``samples``, and a URL may only name ``step-NNNNNNNN/NN-slug[-sS][-ema].mp4|png`` or
``base/NN-slug-base.mp4|png`` inside it (checked on the decoded text of each part, then on the resolved path, so
neither ``..``, an absolute path, an encoded escape nor a symlink leads anywhere else). A slug is letters and
digits of any script joined by '-' (``01-도시-거리-밤.mp4``); the listing gives each clip's full prompt from the
set's ``prompts.json`` when there is one (sets written before it existed show their slug), and the LoRA strength
and weights it was rendered with, read from the name after the prompt's stem (``sample_prompts.clip_suffix``:
strength 1 and the raw LoRA keep the bare stem; ``base/`` holds the base model's clips, strength 0, each rendered
once). Byte ranges follow RFC 9110: one range per request; a Range header that is not one byte range is ignored
(the whole file, 200).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from urllib.parse import quote, unquote

from diffsynth_mbc.run_layout import BASE_SAMPLES_FOLDER, PROMPTS_FILE, SAMPLES_FOLDER, step_of_folder
from diffsynth_mbc.sample_prompts import read_clip_suffix

# the prompt's number, then its slug and what follows it (the shortest slug first: a set without a prompts file
# has only the name to go by)
FILE_NAME = re.compile(r"([0-9]{2})-((?:[^\W_]|-){1,60}?)((?:-s-?[0-9]{1,2}(?:\.[0-9]{1,3})?)?(?:-ema|-base)?)"
                       r"\.(mp4|png)")
CONTENT_TYPES = {"mp4": "video/mp4", "png": "image/png"}
WEIGHTS_ORDER = {None: 0, "raw": 1, "ema": 2}
MAX_SETS = 1000
MAX_FILES_PER_SET = 200
MAX_PROMPTS_FILE = 1 << 20   # bytes; a bigger prompts file is not read (its clips show their slugs)


def samples_root(snapshot: dict) -> Path | None:
    """The current run's samples folder, as its ranks' status files name it (rank 0 first)."""
    for rank in sorted(snapshot.get("ranks") or [], key=lambda r: r.get("rank", 0)):
        folder = rank.get("samples_dir")
        if isinstance(folder, str) and folder:
            path = Path(folder)
            if path.name == SAMPLES_FOLDER and path.is_absolute():
                return path
    return None


def read_prompt_entries(folder: Path) -> dict[int, dict]:
    """Clip number -> {prompt, stem, step} from the set's prompts file (each None where it says nothing); {} when
    the file is missing or unreadable."""
    try:
        with open(folder / PROMPTS_FILE, "rb") as handle:
            raw = handle.read(MAX_PROMPTS_FILE + 1)
        data = json.loads(raw) if len(raw) <= MAX_PROMPTS_FILE else None
    except (OSError, ValueError):
        return {}
    entries = data.get("prompts") if isinstance(data, dict) else None
    found = {}
    for entry in entries if isinstance(entries, list) else []:
        if isinstance(entry, dict) and type(entry.get("index")) is int and isinstance(entry.get("prompt"), str):
            found[entry["index"]] = {key: entry.get(key) if isinstance(entry.get(key), kind) else None
                                     for key, kind in (("prompt", str), ("stem", str), ("step", int))}
    return found


def read_prompts(folder: Path) -> dict[int, str]:
    """Clip number -> full prompt, from the set's prompts file; {} when it is missing or unreadable."""
    return {index: entry["prompt"] for index, entry in read_prompt_entries(folder).items()}


def clip_name(file_name: str, entries: dict[int, dict]) -> tuple[int, str, float, str | None, str] | None:
    """(number, slug, strength, weights, "mp4"|"png") of a clip's file name; None for a name that is none.

    The prompts file's stem of that number, where the name starts with it, says where the slug ends (a prompt
    whose words end in "ema" is not taken for an EMA clip); otherwise the name alone."""
    match = FILE_NAME.fullmatch(file_name)
    if not match:
        return None
    index, extension = int(match.group(1)), match.group(4)
    stem = (entries.get(index) or {}).get("stem")
    name = file_name[:-len(extension) - 1]
    if stem and name.startswith(stem) and read_clip_suffix(name[len(stem):]) is not None:
        slug, suffix = stem[3:], name[len(stem):]
    else:
        slug, suffix = match.group(2), match.group(3)
    kind = read_clip_suffix(suffix)
    return None if kind is None else (index, slug, kind[0], kind[1], extension)


def _clips(folder: Path, step: int | None) -> list[dict]:
    """The clips of one folder: [{index, slug, prompt, step, strength, weights, video, still}], by prompt number,
    then strength, then weights (raw before EMA); ``step`` from the prompts file where it names one."""
    clips: dict[tuple, dict] = {}
    entries = read_prompt_entries(folder)
    for file in sorted(folder.iterdir())[:2 * MAX_FILES_PER_SET]:
        name = clip_name(file.name, entries)
        if not name or not file.is_file():
            continue
        index, slug, strength, weights, extension = name
        entry = entries.get(index) or {}
        clip = clips.setdefault((index, strength, WEIGHTS_ORDER[weights]), {
            "index": index, "slug": slug, "prompt": entry.get("prompt"),
            "step": step if step is not None else entry.get("step"), "strength": strength, "weights": weights})
        clip["video" if extension == "mp4" else "still"] = f"samples/{folder.name}/{quote(file.name)}"
    return [clips[key] for key in sorted(clips)]


def list_sets(root: Path | None) -> list[dict]:
    """[{step, name, clips: [{index, slug, prompt, step, strength, weights, video, still}]}] in step order; at most
    MAX_SETS sets.

    ``prompt`` is the full text (None for a set without a prompts file); ``strength`` the LoRA's (1: as trained),
    ``weights`` "raw" or "ema"; URLs are percent-encoded."""
    if root is None or not root.is_dir():
        return []
    sets = []
    for folder in sorted(root.iterdir()):
        step = step_of_folder(folder.name)
        if step is None or not folder.is_dir() or folder.is_symlink():
            continue
        sets.append({"step": step, "name": folder.name, "clips": _clips(folder, step)})
    return sets[-MAX_SETS:]


def list_base(root: Path | None) -> list[dict]:
    """The base model's clips (``--sample_strengths`` with 0), one per prompt: as ``list_sets``' clips with
    strength 0, weights None and the step each was rendered at (None where its prompts file says none)."""
    folder = None if root is None else root / BASE_SAMPLES_FOLDER
    if folder is None or not folder.is_dir() or folder.is_symlink():
        return []
    return [clip for clip in _clips(folder, None) if clip["weights"] is None]


def resolve_file(root: Path | None, url_path: str) -> tuple[Path, str] | None:
    """The file a ``/samples/SET/FILE`` path names and its content type; None for anything else."""
    parts = url_path.split("/")
    if root is None or len(parts) != 4 or parts[:2] != ["", "samples"]:   # the URL's route
        return None
    try:
        set_name, file_name = parts[2], unquote(parts[3], errors="strict")
    except UnicodeDecodeError:
        return None
    name = FILE_NAME.fullmatch(file_name)
    if not (step_of_folder(set_name) is not None or set_name == BASE_SAMPLES_FOLDER) or not name:
        return None
    try:
        real_root = root.resolve(strict=True)
        path = (root / set_name / file_name).resolve(strict=True)
    except OSError:
        return None
    if path.parent.parent != real_root or not path.is_file():
        return None
    return path, CONTENT_TYPES[name.group(4)]


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
