"""Who the dashboard server answers.

- **Host names** (DNS rebinding): a web page on any site can point a name of its own at 127.0.0.1 and read
  what a local server answers for that name. The server answers only requests whose ``Host`` names
  loopback (``localhost``, ``127.0.0.1``, ``[::1]``), the address or name it was bound to, or a name
  given with ``--allow-host``; bound to every interface (``0.0.0.0``, ``::``) also this machine's host
  names and any IP address (an address typed in a browser involves no DNS). Other names get 421.
- **Token**: a server bound to anything but loopback has no other protection, so it makes a random token,
  printed once in its URL (``http://HOST:PORT/?token=...``), and every request must carry it: in the
  query, in the cookie the server sets when the token came in the query (the dashboard's own requests),
  or as ``Authorization: Bearer TOKEN`` (another monitor reading this one as a source).
"""

from __future__ import annotations

import hmac
import ipaddress
import secrets
import socket
from http.cookies import CookieError, SimpleCookie

LOOPBACK_NAMES = frozenset({"localhost", "127.0.0.1", "::1"})
TOKEN_PARAMETER = "token"


def is_loopback(host: str) -> bool:
    if host.lower().rstrip(".") == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def _is_wildcard(host: str) -> bool:
    try:
        return ipaddress.ip_address(host.strip("[]")).is_unspecified
    except ValueError:
        return False


def _is_ip(name: str) -> bool:
    try:
        ipaddress.ip_address(name)
        return True
    except ValueError:
        return False


def host_name(header: str) -> str:
    """The name in a ``Host`` header, without port, brackets or trailing dot, in lower case."""
    value = header.strip().lower()
    if value.startswith("["):
        return value[1:value.find("]")] if "]" in value else value
    return value.rsplit(":", 1)[0].rstrip(".") if ":" in value else value.rstrip(".")


class Access:
    """The rules of one server: the names it answers for, and its token (None on a loopback bind)."""

    def __init__(self, bound_host: str, port: int, allow_hosts=(), token: str | None = None):
        self.loopback = is_loopback(bound_host)
        self.wildcard = _is_wildcard(bound_host)
        names = set(LOOPBACK_NAMES) | {host_name(name) for name in allow_hosts if name.strip()}
        if not self.wildcard:
            names.add(host_name(bound_host))
        else:
            names |= {socket.gethostname().lower(), socket.getfqdn().lower()}
        self.names = frozenset(names)
        self.token = None if self.loopback else (token or secrets.token_urlsafe(24))
        self.cookie_name = f"mbc_monitor_token_{port}"   # cookies ignore ports: one per server on a host

    def host_problem(self, header: str | None) -> str | None:
        """Why a request with this Host header is refused; None to answer it (no header: not a browser)."""
        if header is None:
            return None
        name = host_name(header)
        if name in self.names or (not self.loopback and _is_ip(name)):
            return None
        return f"this server does not answer for the host {header.strip()[:100]!r}"

    def token_source(self, query: dict, headers) -> str | None:
        """Where a valid token came from ("query", "cookie", "header"); "open" without a token to check."""
        if self.token is None:
            return "open"
        values = query.get(TOKEN_PARAMETER) or []
        if len(values) == 1 and self._same(values[0]):
            return "query"
        auth = headers.get("Authorization") or ""
        if auth[:7].lower() == "bearer " and self._same(auth[7:].strip()):
            return "header"
        try:
            cookie = SimpleCookie(headers.get("Cookie") or "")
        except CookieError:
            return None
        morsel = cookie.get(self.cookie_name)
        return "cookie" if morsel is not None and self._same(morsel.value) else None

    def _same(self, given: str) -> bool:
        return hmac.compare_digest(given.encode("utf-8", "replace"), self.token.encode())

    def set_cookie(self) -> str:
        return f"{self.cookie_name}={self.token}; Path=/; HttpOnly; SameSite=Strict"
