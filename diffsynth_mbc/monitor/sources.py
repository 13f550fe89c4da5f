"""Where a run's rank files come from: log folders on this machine, and other monitors' ``--serve`` URLs.

With node-local log folders each node sees only its own ranks; ``python -m diffsynth_mbc.monitor``
then takes several sources and shows one run with every rank. A URL source is another monitor's
``/api/training/status``, read with a short timeout; one that does not answer is named in the notes
and its ranks count as missing. Only the addresses the user names are ever contacted. A URL with
``?token=...`` (what a monitor bound to another address than loopback prints) sends its token as
``Authorization: Bearer``; the token is never shown in notes.

A folder named on the command line must exist. One without rank files whose run's logs sit one level
down (a run's output folder with its ``training_logs/``, or ``runs/NAME`` holding it) is followed to
them, and the monitor says which folder it watches.
"""

from __future__ import annotations

import json
import os
import urllib.error
import urllib.request
from pathlib import Path
from urllib.parse import parse_qs, urlsplit, urlunsplit

from diffsynth_mbc import run_layout

FETCH_TIMEOUT_S = 2.0
MAX_ANSWER_BYTES = 32 << 20
# what an output folder holds, a log folder never
RUN_OUTPUT_MARKS = (run_layout.FINAL_LORA, run_layout.DEFAULT_CHECKPOINTS_FOLDER, run_layout.SAMPLES_FOLDER)


def split_sources(values: list[str]) -> tuple[list[Path], list["RemoteSource"]]:
    """Folders and ``http://HOST:PORT`` monitor URLs, in the order given."""
    folders, remotes = [], []
    for value in values:
        if value.startswith(("http://", "https://")):
            remotes.append(RemoteSource(value))
        else:
            folders.append(Path(value))
    return folders, remotes


def _holds_rank_files(folder: Path) -> bool:
    try:
        with os.scandir(folder) as entries:
            return any(run_layout.rank_of_status_file(entry.name) is not None for entry in entries)
    except OSError:
        return False


def follow_folder(folder: Path) -> tuple[Path, str | None]:
    """The folder to watch for ``folder`` as named, and a line saying so when it is another one.

    ``folder`` itself when it holds rank files, or nothing that says otherwise (a run that has not written
    yet); else the one folder one level down that holds rank files (or, before a run writes, its empty
    ``training_logs``). Raises ValueError, naming the folder, when it does not exist, is no folder, holds
    several runs' logs below it, or is a run's output folder whose logs are elsewhere."""
    if not folder.exists():
        raise ValueError(f"log folder {folder} does not exist (the launch printed the one to watch: "
                         f"\"watch: python -m diffsynth_mbc.monitor LOG_DIR\")")
    if not folder.is_dir():
        raise ValueError(f"{folder} is not a folder (give the run's log folder, which holds "
                         f"{run_layout.STATUS_FILE_GLOB})")
    if _holds_rank_files(folder):
        return folder, None
    try:
        children = sorted(child for child in folder.iterdir() if child.is_dir() and not child.is_symlink())
    except OSError as exc:
        raise ValueError(f"cannot list {folder}: {exc}") from None
    below = [child for child in children if _holds_rank_files(child)]
    logs = folder / run_layout.DEFAULT_LOGS_FOLDER   # where a run keeps its rank files unless --log_dir says otherwise
    if not below and logs in children:
        below = [logs]
    if len(below) == 1:
        return below[0], f"watching {below[0]} (the run's log folder inside {folder})"
    if below:
        raise ValueError(f"{folder} holds the logs of several runs, in {', '.join(str(b) for b in below)}: "
                         "name the one to watch")
    if any((folder / mark).exists() for mark in RUN_OUTPUT_MARKS) or any(folder.glob(run_layout.RUN_LOG_GLOB)):
        raise ValueError(f"{folder} is a run's output folder without its logs (they are where --log_dir put them; "
                         "the launch printed \"watch: python -m diffsynth_mbc.monitor LOG_DIR\")")
    return folder, None


class RemoteSource:
    def __init__(self, url: str, timeout_s: float = FETCH_TIMEOUT_S):
        parts = urlsplit(url)
        tokens = parse_qs(parts.query).get("token") or []
        if len(tokens) > 1:
            raise ValueError(f"source {parts.scheme}://{parts.netloc}{parts.path}: more than one token in its URL")
        self.token = tokens[0] if tokens else None
        self.base = urlunsplit((parts.scheme, parts.netloc, parts.path, "", "")).rstrip("/")
        self.timeout_s = timeout_s

    def __str__(self) -> str:
        return self.base

    def fetch_ranks(self) -> list[dict]:
        """The rank views another monitor shows; raises OSError (naming the source) when it does not answer."""
        request = urllib.request.Request(f"{self.base}/api/training/status")
        if self.token:
            request.add_header("Authorization", f"Bearer {self.token}")
        try:
            with urllib.request.urlopen(request, timeout=self.timeout_s) as response:
                body = response.read(MAX_ANSWER_BYTES + 1)
        except urllib.error.HTTPError as exc:
            hint = ": give its URL with the ?token=... it printed" if exc.code == 401 else ""
            raise OSError(f"source {self.base} refused the request (HTTP {exc.code}{hint})") from None
        except (urllib.error.URLError, OSError, ValueError) as exc:
            reason = getattr(exc, "reason", exc)
            raise OSError(f"source {self.base} did not answer ({reason})") from None
        if len(body) > MAX_ANSWER_BYTES:
            raise OSError(f"source {self.base} answered more than {MAX_ANSWER_BYTES >> 20} MiB; ignored")
        try:
            snapshot = json.loads(body)
        except (ValueError, RecursionError):
            raise OSError(f"source {self.base} did not answer with the monitor's JSON") from None
        ranks = snapshot.get("ranks") if isinstance(snapshot, dict) else None
        if not isinstance(ranks, list):
            raise OSError(f"source {self.base} did not answer with the monitor's JSON (no ranks)")
        return [view for view in ranks if isinstance(view, dict) and isinstance(view.get("rank"), int)]
