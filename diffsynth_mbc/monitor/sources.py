"""Where a run's rank files come from: log folders on this machine, and other monitors' ``--serve`` URLs.

With node-local log folders each node sees only its own ranks; ``python -m diffsynth_mbc.monitor``
then takes several sources and shows one run with every rank. A URL source is another monitor's
``/api/training/status``, read with a short timeout; one that does not answer is named in the notes
and its ranks count as missing. Only the addresses the user names are ever contacted. A URL with
``?token=...`` (what a monitor bound to another address than loopback prints) sends its token as
``Authorization: Bearer``; the token is never shown in notes.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from pathlib import Path
from urllib.parse import parse_qs, urlsplit, urlunsplit

FETCH_TIMEOUT_S = 2.0
MAX_ANSWER_BYTES = 32 << 20


def split_sources(values: list[str]) -> tuple[list[Path], list["RemoteSource"]]:
    """Folders and ``http://HOST:PORT`` monitor URLs, in the order given."""
    folders, remotes = [], []
    for value in values:
        if value.startswith(("http://", "https://")):
            remotes.append(RemoteSource(value))
        else:
            folders.append(Path(value))
    return folders, remotes


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
