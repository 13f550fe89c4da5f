"""Who the dashboard server answers, and how long a client may take to ask.

- **Host names** (DNS rebinding): a web page on any site can point a name of its own at 127.0.0.1 and read
  what a local server answers for that name. The server answers only requests whose ``Host`` names
  loopback (``localhost``, ``127.0.0.1``, ``[::1]``), the address or name it was bound to, or a name
  given with ``--allow_host``; bound to every interface (``0.0.0.0``, ``::``) also this machine's host
  names and any IP address (an address typed in a browser involves no DNS). Other names get 421.
- **Token**: a server bound to anything but loopback has no other protection, so it makes a random token,
  printed once in its URL (``http://HOST:PORT/?token=...``), and every request must carry it: in the
  query, in the cookie the server sets when the token came in the query (the dashboard's own requests),
  or as ``Authorization: Bearer TOKEN`` (another monitor reading this one as a source).
- **Slow clients** (slowloris): the request line and headers must arrive within a deadline for the
  whole head, not only within a timeout per read, and one client address holds at most a few
  connections at a time, so that a few slow clients cannot occupy every worker.
"""

from __future__ import annotations

import hmac
import io
import ipaddress
import secrets
import socket
import threading
import time
from http.cookies import CookieError, SimpleCookie

LOOPBACK_NAMES = frozenset({"localhost", "127.0.0.1", "::1"})
HEADER_DEADLINE_S = 10.0         # the request line and every header within this long of the connection
MAX_CONNECTIONS_PER_CLIENT = 8   # connections one client address may hold at a time (a browser uses up to 6)
TOKEN_PARAMETER = "token"


def parse_serve(value: str) -> tuple[str, int]:
    """``PORT``, ``:PORT``, ``HOST:PORT`` or ``[V6HOST]:PORT`` -> (host, port); host defaults to 127.0.0.1."""
    text = value.strip()
    host = "127.0.0.1"
    if text.startswith("["):
        end = text.find("]")
        if end < 0 or not text[end + 1:].startswith(":"):
            raise ValueError(f"bad address {value!r}: expected [HOST]:PORT")
        host, text = text[1:end], text[end + 2:]
    elif ":" in text:
        head, _, text = text.rpartition(":")
        if head:
            host = head
    try:
        port = int(text)
    except ValueError:
        raise ValueError(f"bad port in {value!r}") from None
    if not 0 <= port <= 65535:
        raise ValueError(f"port out of range in {value!r}")
    return host, port


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


class DeadlineReader(io.RawIOBase):
    """A socket's bytes; each read waits at most ``per_read_s`` and, while ``deadline`` (monotonic) is set,
    never past it: a client that sends its request head a byte at a time is cut off at the deadline."""

    def __init__(self, sock: socket.socket, per_read_s: float, deadline: float | None):
        super().__init__()
        self._sock = sock
        self.per_read_s = per_read_s
        self.deadline = deadline

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        timeout = self.per_read_s
        if self.deadline is not None:
            left = self.deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("request line and headers did not arrive in time")
            timeout = min(timeout, left)
        self._sock.settimeout(timeout)
        return self._sock.recv_into(buffer)


class ClientSlots:
    """Connections in flight per client address, at most ``limit`` each."""

    def __init__(self, limit: int = MAX_CONNECTIONS_PER_CLIENT):
        if limit < 1:
            raise ValueError(f"the connection limit per client must be at least 1, got {limit}")
        self.limit = limit
        self._held: dict[str, int] = {}
        self._lock = threading.Lock()

    def take(self, address: str) -> bool:
        with self._lock:
            held = self._held.get(address, 0)
            if held >= self.limit:
                return False
            self._held[address] = held + 1
            return True

    def give_back(self, address: str) -> None:
        with self._lock:
            held = self._held.get(address, 0) - 1
            if held > 0:
                self._held[address] = held
            else:
                self._held.pop(address, None)


def refuse_busy(sock) -> None:
    """Tell a client over its connection limit so, without waiting for it (a fresh socket's buffer takes it)."""
    body = b'{"error":"too many connections from this client at once","status":503}'
    head = (f"HTTP/1.0 503 Service Unavailable\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n"
            "Retry-After: 5\r\nConnection: close\r\n\r\n").encode()
    try:
        sock.setblocking(False)
        sock.send(head + body)
    except OSError:
        pass
