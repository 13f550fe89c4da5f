"""Read-only HTTP server over the monitor's state (stdlib only).

Routes (GET and HEAD; OPTIONS answers CORS preflight; anything else 405):

- ``/``                      the dashboard page (diffsynth_mbc/monitor/web/dashboard.html, self-contained);
- ``/api/training/status``   the run aggregate (the same object as ``--once --json``);
- ``/api/training/samples``  the run's sample sets (``samples_dir`` of its status files): steps, clips (with
  their LoRA strength and weights), URLs, and the base model's clips (``base``);
- ``/samples/step-N/NN-slug.mp4|png``, ``/samples/base/NN-slug-base.mp4|png``  one sample file (byte ranges;
  nothing outside that folder);
- ``/api/training/metrics``  per-step history, keyed by rank: ``rank`` (optional, default every
  rank of the run with a status file), ``since`` (a step; records with a larger step), ``limit`` (records per
  rank, 1..10000, default 1000), ``points`` (optional, 2..5000: the bounded down-sampled
  series instead of raw records).

Only ``/samples/`` takes a path, and only one of the strict form above inside the run's samples folder;
everything else reads nothing but the run files of the log directory, so ``..`` in a URL only ever
gets a 404. Bad query values get a 400 JSON error naming the
parameter. No answer carries ``Access-Control-Allow-Origin`` unless ``--cors ORIGIN`` names the one
origin (another local web page) allowed to read the run's data. A request for another host name gets 421,
and a server bound to anything but loopback wants its token on every request (401 without it; see
``access``). Requests are served by a bounded thread pool; a request's line and headers must arrive within
a deadline (not only a timeout per read), and one client address holds at most a few connections at a time.
"""

from __future__ import annotations

import io
import json
import math
import os
import socket
import threading
import time
from http import HTTPStatus
from concurrent.futures import ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from importlib import resources
from urllib.parse import parse_qs, quote, urlsplit

from diffsynth_mbc.monitor import samples
from diffsynth_mbc.monitor.access import (HEADER_DEADLINE_S, MAX_CONNECTIONS_PER_CLIENT, Access, ClientSlots,
                                          DeadlineReader, refuse_busy)
from diffsynth_mbc.monitor.state import MonitorState
from diffsynth_mbc.monitor.status import json_safe

STATUS_PATH = "/api/training/status"
METRICS_PATH = "/api/training/metrics"
SAMPLES_PATH = "/api/training/samples"
FILE_CHUNK = 1 << 20
MAX_LIMIT = 10_000
DEFAULT_LIMIT = 1000
MAX_POINTS_PARAM = 5000
STATUS_MAX_AGE_S = 0.5
WORKERS = 32                # threads serving requests; more clients wait in the listen backlog
CONNECTION_TIMEOUT_S = 5.0  # longest wait for one read from a client


class QueryError(ValueError):
    def __init__(self, parameter: str, message: str):
        super().__init__(message)
        self.parameter = parameter


PAGE_PARTS = {  # marker in dashboard.html -> the file inlined there when the page is served
    b"/*UPLOT_CSS*/": "web/vendor/uPlot.min.css",
    b"/*UPLOT_JS*/": "web/vendor/uPlot.iife.min.js",
    b"/*PANELS_JS*/": "web/panels.js",
    b"/*DASHBOARD_JS*/": "web/dashboard.js",
}


def dashboard_html() -> bytes:
    """The dashboard as one self-contained page: uPlot (vendored, MIT) and the page's scripts inlined,
    so it works offline and the browser never asks anything but this server."""
    web = resources.files("diffsynth_mbc.monitor")
    page = web.joinpath("web/dashboard.html").read_bytes()
    for marker, name in PAGE_PARTS.items():
        part = web.joinpath(name).read_bytes()
        if b"</script" in part.lower() or b"</style" in part.lower():
            raise ValueError(f"{name} cannot be inlined: it contains a closing script or style tag")
        if page.count(marker) != 1:
            raise ValueError(f"dashboard.html must hold {marker.decode()} exactly once")
        page = page.replace(marker, part)
    return page


def _one(query: dict, name: str) -> str | None:
    values = query.get(name)
    if not values:
        return None
    if len(values) > 1:
        raise QueryError(name, f"parameter '{name}' given more than once")
    return values[0]


def _int_param(query: dict, name: str, lo: int, hi: int | None) -> int | None:
    raw = _one(query, name)
    if raw is None or raw == "":
        return None
    try:
        value = int(raw)
    except ValueError:
        raise QueryError(name, f"parameter '{name}' must be a whole number, got {raw[:40]!r}") from None
    if value < lo or (hi is not None and value > hi):
        bound = f"between {lo} and {hi}" if hi is not None else f"at least {lo}"
        raise QueryError(name, f"parameter '{name}' must be {bound}, got {value}")
    return value


def _float_param(query: dict, name: str) -> float | None:
    raw = _one(query, name)
    if raw is None or raw == "":
        return None
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not math.isfinite(value):
        raise QueryError(name, f"parameter '{name}' must be a number, got {raw[:40]!r}")
    return int(value) if value.is_integer() else value


class _Server(ThreadingHTTPServer):
    """Requests are served by a bounded pool of threads; the listen backlog absorbs bursts. A connection
    that sends nothing is dropped after the handler's timeout, one whose request head trickles in at the
    handler's deadline, and a client address over its connection limit gets 503 without taking a thread."""
    daemon_threads = True
    allow_reuse_address = True
    block_on_close = False
    request_queue_size = 128
    slots: ClientSlots

    def server_activate(self):
        super().server_activate()
        self._pool = ThreadPoolExecutor(max_workers=WORKERS, thread_name_prefix="mbc-monitor-request")

    def process_request(self, request, client_address):
        client = client_address[0]
        if not self.slots.take(client):
            refuse_busy(request)
            self.shutdown_request(request)
            return
        self._pool.submit(self._serve_and_give_back, request, client_address)

    def _serve_and_give_back(self, request, client_address):
        try:
            self.process_request_thread(request, client_address)
        finally:
            self.slots.give_back(client_address[0])

    def server_close(self):
        super().server_close()
        pool = getattr(self, "_pool", None)
        if pool is not None:
            pool.shutdown(wait=False, cancel_futures=True)


class MonitorRequestHandler(BaseHTTPRequestHandler):
    """One request: the page or a JSON route. ``state``, ``page`` and ``quiet`` are set by ``make_handler``."""

    state: MonitorState
    page: bytes
    access: Access
    quiet = True
    cors_origin: str | None = None   # Access-Control-Allow-Origin only when --cors names an origin
    timeout = CONNECTION_TIMEOUT_S   # a client that sends nothing is dropped after this long
    header_deadline_s = HEADER_DEADLINE_S   # ... and one whose request line and headers take longer than this
    server_version = "mbc-monitor"

    def version_string(self):
        return self.server_version

    def log_message(self, format, *args):  # noqa: A002 - signature of the base class
        if not self.quiet:
            super().log_message(format, *args)

    def _start(self, code: int, content_type: str, length: int, extra: dict | None = None,
               cache: str = "no-store") -> None:
        """Status line and headers of every answer with a body (CORS only for the origin --cors names)."""
        self.send_response(code)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(length))
        self.send_header("Cache-Control", cache)
        self.send_header("X-Content-Type-Options", "nosniff")
        if getattr(self, "_token_from", None) == "query":   # the page's own requests then carry the cookie
            self.send_header("Set-Cookie", self.access.set_cookie())
        if self.cors_origin:
            self.send_header("Access-Control-Allow-Origin", self.cors_origin)
            self.send_header("Vary", "Origin")
        for key, value in (extra or {}).items():
            self.send_header(key, value)
        self.end_headers()

    def _send(self, code: int, body: bytes, content_type: str, extra: dict | None = None) -> None:
        self._start(code, content_type, len(body), extra)
        if self.command != "HEAD":
            self.wfile.write(body)

    def _json(self, code: int, obj, extra: dict | None = None) -> None:
        try:
            body = json.dumps(obj, allow_nan=False, separators=(",", ":")).encode()
        except ValueError:  # a non-finite number slipped through: send null instead
            body = json.dumps(json_safe(obj), allow_nan=False, separators=(",", ":")).encode()
        self._send(code, body, "application/json; charset=utf-8", extra)

    def _error(self, code: int, message: str, parameter: str | None = None, extra: dict | None = None) -> None:
        obj = {"error": message, "status": int(code)}
        if parameter is not None:
            obj["parameter"] = parameter
        self._json(code, obj, extra)

    def setup(self):
        super().setup()
        self.rfile.close()   # read through a deadline for the whole request head instead
        self._reader = DeadlineReader(self.connection, self.timeout, time.monotonic() + self.header_deadline_s)
        self.rfile = io.BufferedReader(self._reader)

    def parse_request(self) -> bool:
        """The request line and headers, then who may ask: the Host it names (421), the token (401)."""
        if not super().parse_request():
            return False
        self._reader.deadline = None   # the head is in: writing the answer has the usual timeout per send
        self.connection.settimeout(self.timeout)
        self._token_from = None
        problem = self.access.host_problem(self.headers.get("Host"))
        if problem is not None:
            self._error(HTTPStatus.MISDIRECTED_REQUEST, problem)
            return False
        if self.command == "OPTIONS":   # a CORS preflight carries no credentials, and its answer holds no data
            return True
        self._token_from = self.access.token_source(parse_qs(urlsplit(self.path).query), self.headers)
        if self._token_from is None:
            self._error(HTTPStatus.UNAUTHORIZED, "this server wants its token: open the URL it printed "
                        "(http://HOST:PORT/?token=...) or send 'Authorization: Bearer TOKEN'",
                        extra={"WWW-Authenticate": 'Bearer realm="mbc-monitor"'})
            return False
        return True

    def do_OPTIONS(self):  # noqa: N802 - http.server naming
        self.send_response(HTTPStatus.NO_CONTENT)
        if self.cors_origin:
            self.send_header("Access-Control-Allow-Origin", self.cors_origin)
        self.send_header("Access-Control-Allow-Methods", "GET, HEAD, OPTIONS")
        self.send_header("Access-Control-Allow-Headers", "*")
        self.send_header("Access-Control-Max-Age", "600")
        self.send_header("Content-Length", "0")
        self.end_headers()

    def do_HEAD(self):  # noqa: N802
        self.do_GET()

    def do_GET(self):  # noqa: N802
        try:
            parts = urlsplit(self.path)
            path = parts.path
            if path != "/" and path.endswith("/"):
                path = path.rstrip("/")
            self._route(path, parse_qs(parts.query, keep_blank_values=True), parts.path)
        except QueryError as exc:
            self._error(400, str(exc), exc.parameter)
        except (BrokenPipeError, ConnectionResetError):
            pass
        except Exception as exc:  # a bad request must never take the server down
            try:
                self._error(500, f"internal error: {type(exc).__name__}: {exc}")
            except OSError:
                pass

    def _route(self, path: str, query: dict, raw_path: str) -> None:
        if path in ("/", "/index.html"):
            self._send(200, self.page, "text/html; charset=utf-8", {
                "Content-Security-Policy": "default-src 'none'; script-src 'unsafe-inline'; "
                                           "style-src 'unsafe-inline'; connect-src 'self'; img-src 'self' data:; "
                                           "media-src 'self'",
            })
        elif path == "/favicon.ico":   # browsers ask for it; answer without an error in their console
            self.send_response(HTTPStatus.NO_CONTENT)
            self.send_header("Content-Length", "0")
            self.end_headers()
        elif path == STATUS_PATH:
            self._json(200, self.state.snapshot(max_age_s=STATUS_MAX_AGE_S))
        elif path == METRICS_PATH:
            self._metrics(query)
        elif path == SAMPLES_PATH:
            snapshot = self.state.snapshot(max_age_s=STATUS_MAX_AGE_S)
            root = samples.samples_root(snapshot)
            self._json(200, {"run_id": snapshot.get("run_id"), "sets": samples.list_sets(root),
                             "base": samples.list_base(root)})
        elif raw_path.startswith("/samples/"):
            self._sample_file(raw_path)
        else:
            self._error(404, f"no such path: {raw_path[:100]}")

    def _metrics(self, query: dict) -> None:
        rank = _int_param(query, "rank", 0, None)
        since = _float_param(query, "since")
        limit = _int_param(query, "limit", 1, MAX_LIMIT)
        points = _int_param(query, "points", 2, MAX_POINTS_PARAM)
        if rank is not None:
            self.state.snapshot(max_age_s=STATUS_MAX_AGE_S)
            if rank not in self.state.run_ranks():
                self._error(404, f"rank {rank} is not a rank of the current run", "rank")
                return
        self._json(200, self.state.metrics(rank=rank, since=since,
                                      limit=DEFAULT_LIMIT if limit is None else limit, points=points))

    def _sample_file(self, raw_path: str) -> None:
        """A sample clip or still of the current run, with byte ranges so a browser can seek in a video."""
        found = samples.resolve_file(samples.samples_root(self.state.snapshot(max_age_s=STATUS_MAX_AGE_S)), raw_path)
        if found is None:
            self._error(404, f"no such sample file: {raw_path[:100]}")
            return
        path, content_type = found
        with open(path, "rb") as handle:
            size = os.fstat(handle.fileno()).st_size
            wanted = samples.byte_range(self.headers.get("Range"), size)
            if wanted == "unsatisfiable":
                self._send(416, b"", "text/plain", {"Content-Range": f"bytes */{size}", "Accept-Ranges": "bytes"})
                return
            first, last = wanted if wanted else (0, size - 1)
            extra = {"Accept-Ranges": "bytes"}
            if wanted:
                extra["Content-Range"] = f"bytes {first}-{last}/{size}"
            self._start(206 if wanted else 200, content_type, max(0, last - first + 1), extra, cache="no-cache")
            if self.command == "HEAD":
                return
            handle.seek(first)
            remaining = last - first + 1
            while remaining > 0:
                chunk = handle.read(min(FILE_CHUNK, remaining))
                if not chunk:
                    break
                self.wfile.write(chunk)
                remaining -= len(chunk)

    def _not_allowed(self):
        self._error(405, f"method {self.command} not allowed (read-only)")

    do_POST = do_PUT = do_DELETE = do_PATCH = _not_allowed  # noqa: N815


def make_handler(state: MonitorState, page: bytes, quiet: bool = True,
                 cors_origin: str | None = None) -> type[MonitorRequestHandler]:
    """A handler class bound to one monitor state and page (http.server makes one instance per request)."""
    return type("BoundMonitorRequestHandler", (MonitorRequestHandler,),
                {"state": state, "page": page, "quiet": quiet, "cors_origin": cors_origin})


class MonitorServer:
    """The HTTP server, run in a daemon thread; ``stop`` shuts it down and closes the socket."""

    def __init__(self, state: MonitorState, host: str = "127.0.0.1", port: int = 0, quiet: bool = True,
                 cors_origin: str | None = None, allow_hosts=(), header_deadline_s: float = HEADER_DEADLINE_S,
                 max_connections_per_client: int = MAX_CONNECTIONS_PER_CLIENT):
        if not header_deadline_s > 0:
            raise ValueError(f"header_deadline_s must be positive, got {header_deadline_s}")
        handler = make_handler(state, dashboard_html(), quiet=quiet, cors_origin=cors_origin)
        handler.header_deadline_s = header_deadline_s
        server_cls = type("_BoundServer", (_Server,), {"slots": ClientSlots(max_connections_per_client)})
        if ":" in host:
            server_cls = type("_Server6", (server_cls,), {"address_family": socket.AF_INET6})
        self.httpd = server_cls((host, port), handler)
        self.access = handler.access = Access(host, self.httpd.server_address[1], allow_hosts)
        self._thread: threading.Thread | None = None

    @property
    def token(self) -> str | None:
        """The token every request must carry; None on a loopback bind."""
        return self.access.token

    @property
    def address(self) -> str:
        """The server's URL without its token (what may be shown again and again)."""
        host, port = self.httpd.server_address[:2]
        if self.access.wildcard:
            host = socket.gethostname()
        shown = f"[{host}]" if ":" in host else host
        return f"http://{shown}:{port}/"

    @property
    def url(self) -> str:
        """The URL to open: with ``?token=`` when the server wants one (print it once)."""
        return self.address + (f"?token={quote(self.token)}" if self.token else "")

    def start(self) -> "MonitorServer":
        self._thread = threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.2},
                                        name="mbc-monitor-http", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._thread is not None:
            self.httpd.shutdown()
            self._thread.join(timeout=5)
            self._thread = None
        self.httpd.server_close()
