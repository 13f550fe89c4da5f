"""What the inspection measured, kept between runs: a second run over an unchanged catalogue decodes nothing
again, and a run killed half way resumes where it stopped.

The store is one JSON line per measured row, ``{"version": V, "key": K, "measures": {...}}``, appended (and
flushed) as each row is measured, so the cost per row stays constant and a kill loses at most the line being
written. A row's key names the file as it is on disk (real path, size, modification time in nanoseconds) and the
window settings that chose its frames: touch the file or change a setting and the row is measured again. Lines
of another store version (measures computed differently) are ignored. Once a run is over, ``finish`` compacts
the file to the rows the catalogue still has, so it does not grow without end over catalogue edits.

One run writes a store at a time (the output folder of a conversion is not shared between runs).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import IO, Callable

from diffsynth_mbc.atomic import atomic_open
from diffsynth_mbc.data.cache.index import file_fingerprint

STORE_NAME = "inspect_measures.jsonl"


class MeasureStore:
    """The measures of earlier runs (read once, when made) and an append-only log of this run's new ones."""

    def __init__(self, path: Path, version: int, readable: Callable[[dict], bool] = lambda measures: True):
        """``readable(measures)``: whether a stored line's measures can be used (every field there, numbers
        finite); a line that cannot is measured again, and counted in ``spoiled``."""
        self.path = Path(path)
        self.version = version
        self.readable = readable
        self.hits = 0
        self.misses = 0
        self.spoiled = 0   # lines of this version whose measures were not readable: measured again
        self._handle: IO[bytes] | None = None
        self._measures: dict[str, dict] = {}
        self._file_is_compact = True   # one line per key of self._measures: no torn, foreign or repeated line
        self._ends_torn = False        # the last line has no newline: the next append starts a new one first
        self._load()

    @staticmethod
    def key(resolved_path: str, window_settings: dict) -> str | None:
        """The row's key: its file as it is now (real path, size, mtime) and the settings that chose the frames;
        None when the file cannot be stat'ed (nothing to reuse, and nothing worth storing)."""
        try:
            fingerprint = file_fingerprint(resolved_path)   # the latent cache's: real path, size, mtime
        except OSError:
            return None
        identity = json.dumps([fingerprint, window_settings], sort_keys=True)
        return hashlib.sha256(identity.encode("utf-8")).hexdigest()

    def get(self, key: str) -> dict | None:
        """The measures stored under ``key`` (a copy), counted as a hit; None, counted as a miss, when absent."""
        measures = self._measures.get(key)
        if measures is None:
            self.misses += 1
            return None
        self.hits += 1
        return dict(measures)

    def add(self, key: str, measures: dict) -> None:
        """Store one row's measures: one line appended and flushed (the file is opened on the first add)."""
        line = json.dumps({"version": self.version, "key": key, "measures": measures}, sort_keys=True)
        handle = self._append_handle()
        handle.write(line.encode("utf-8") + b"\n")
        handle.flush()
        if key in self._measures:
            self._file_is_compact = False
        self._measures[key] = dict(measures)

    def finish(self, used: set[str]) -> None:
        """Close the file and compact it once, to the keys in ``used`` (the rows of this run): a temp file in the
        same folder replaces it, so a kill during compaction leaves the old file whole. Calling it again, or
        after nothing changed, rewrites nothing."""
        self.close()
        kept = {key: self._measures[key] for key in sorted(used) if key in self._measures}
        if self._file_is_compact and kept.keys() == self._measures.keys():
            return
        with atomic_open(self.path, "w", encoding="utf-8") as handle:
            for key, measures in kept.items():
                handle.write(json.dumps({"version": self.version, "key": key, "measures": measures},
                                        sort_keys=True) + "\n")
        self._measures = kept
        self._file_is_compact = True
        self._ends_torn = False

    def close(self) -> None:
        """Close the append handle, compacting nothing: what was added stays for the next run."""
        if self._handle is not None:
            self._handle.close()
            self._handle = None

    def __enter__(self) -> MeasureStore:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def _append_handle(self) -> IO[bytes]:
        if self._handle is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._handle = open(self.path, "ab")
            if self._ends_torn:   # a killed run's half line: end it, so that it spoils only itself
                self._handle.write(b"\n")
                self._ends_torn = False
        return self._handle

    def _load(self) -> None:
        """Read the lines earlier runs wrote. Read as bytes and decoded line by line: a line torn by a kill may
        end inside a multi-byte character, and spoils only itself."""
        try:
            data = self.path.read_bytes()
        except FileNotFoundError:
            return
        self._ends_torn = bool(data) and not data.endswith(b"\n")
        for raw in data.splitlines():
            record = _record(raw)
            if record is None or record["version"] != self.version:
                self._file_is_compact = False
                continue
            if not self.readable(record["measures"]):   # a field missing, a NaN: this row is measured again
                self.spoiled += 1
                self._file_is_compact = False
                continue
            if record["key"] in self._measures:   # measured twice (two runs killed before finishing): last wins
                self._file_is_compact = False
            self._measures[record["key"]] = record["measures"]


def _record(raw: bytes) -> dict | None:
    """One stored line as ``{"version", "key", "measures"}``; None for a torn or otherwise unreadable line."""
    try:
        record = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        return None
    if not (isinstance(record, dict) and isinstance(record.get("key"), str)
            and isinstance(record.get("measures"), dict) and "version" in record):
        return None
    return record
