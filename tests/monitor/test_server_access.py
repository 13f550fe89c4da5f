"""Who the dashboard server answers, over real sockets: Host names (DNS rebinding), the token of a server
bound to every interface (read by a browser and by another monitor), and slow clients (slowloris)."""

from __future__ import annotations

import http.client
import json
import os
import re
import select
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

import monitor_fixtures as F
from diffsynth_mbc.monitor.access import MAX_CONNECTIONS_PER_CLIENT
from diffsynth_mbc.monitor.server import MonitorServer
from diffsynth_mbc.monitor.state import MonitorState
from test_server import start_server, stop_server

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[2]
DATA_PATHS = ("/", "/api/training/status", "/api/training/metrics?points=10", "/api/training/metrics?since=5",
              "/api/training/samples", "/samples/step-00000001/01-a.mp4")


def ask(port, path, headers=None, method="GET"):
    """(status, headers, body) of one request to 127.0.0.1:port, the headers sent exactly as given."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        conn.request(method, path, headers=headers or {})
        resp = conn.getresponse()
        return resp.status, dict(resp.getheaders()), resp.read()
    finally:
        conn.close()


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    log_dir = tmp_path_factory.mktemp("access") / "training_logs"
    F.make_run(log_dir, world_size=2, steps=20, now=time.time())
    return log_dir


@pytest.fixture(scope="module")
def loopback(run_dir):
    srv = start_server(run_dir, "--no-view", "--allow-host", "Node0.Example")
    yield srv
    stop_server(srv)


@pytest.fixture(scope="module")
def everywhere(run_dir):
    """``--serve 0.0.0.0:0``: (process, port, token, stderr's first line)."""
    env = dict(os.environ, PYTHONPATH=str(REPO))
    proc = subprocess.Popen([sys.executable, "-m", "diffsynth_mbc.monitor", str(run_dir), "--serve", "0.0.0.0:0",
                             "--no-view"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        line = proc.stdout.readline()
        match = re.search(r"http://[^/\s]+:(\d+)/\?token=([A-Za-z0-9_-]{20,})\s", line)
        assert match, (line, proc.stderr.read() if proc.poll() is not None else "")
        yield proc, int(match.group(1)), match.group(2), proc.stderr.readline()
    finally:
        proc.kill()
        proc.wait()


def test_a_rebinding_host_name_gets_421(loopback):
    # Once any Host was answered: a page of attacker.example, its name pointed at 127.0.0.1, read it all.
    port = loopback.port
    for path in DATA_PATHS:
        for host in (f"attacker.example:{port}", "attacker.example", f"127.0.0.1.nip.io:{port}", f"10.1.2.3:{port}"):
            status, headers, body = ask(port, path, {"Host": host})
            assert status == 421, (path, host, status)
            assert b"node-a" not in body and b'"step"' not in body and b"<html" not in body.lower()
            assert json.loads(body)["status"] == 421 and "Set-Cookie" not in headers
    for host in (f"localhost:{port}", f"127.0.0.1:{port}", f"[::1]:{port}", "LOCALHOST", f"localhost.:{port}",
                 f"node0.example:{port}"):   # the last one by --allow-host
        status, _, body = ask(port, "/api/training/status", {"Host": host})
        assert status == 200 and json.loads(body)["world_size"] == 2, host
    status, _, _ = ask(port, "/api/training/status", {"Host": f"attacker.example:{port}"}, method="HEAD")
    assert status == 421


def test_a_loopback_server_wants_no_token(loopback):
    assert "token" not in loopback.url
    status, headers, _ = ask(loopback.port, "/api/training/status")
    assert status == 200 and "Set-Cookie" not in headers


def test_every_interface_needs_the_token_printed_once_in_the_url(everywhere):
    proc, port, token, warning = everywhere
    assert "token" in warning and "0.0.0.0:0" in warning and token not in warning
    for path in DATA_PATHS:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Cookie": f"mbc_monitor_token_{port}=wrong"},
                        {"Authorization": "Basic " + token}):
            status, answer, body = ask(port, path, headers)
            assert status == 401 and answer["WWW-Authenticate"].startswith("Bearer"), (path, headers)
            assert b"node-a" not in body and b"<html" not in body.lower()
        sep = "&" if "?" in path else "?"
        status, _, _ = ask(port, f"{path}{sep}token=wrong")
        assert status == 401
    status, headers, page = ask(port, f"/?token={token}")
    assert status == 200 and b"<html" in page.lower()
    cookie = headers["Set-Cookie"]
    assert cookie.startswith(f"mbc_monitor_token_{port}={token};") and "HttpOnly" in cookie
    assert "SameSite=Strict" in cookie
    cookie_pair = cookie.split(";")[0]
    for headers in ({"Cookie": cookie_pair}, {"Cookie": f"other=1; {cookie_pair}"}, {"Authorization": f"Bearer {token}"}):
        status, answer, body = ask(port, "/api/training/status", headers)
        assert status == 200 and json.loads(body)["world_size"] == 2 and token.encode() not in body
        assert "Set-Cookie" not in answer   # only a token in the query sets the cookie
    status, _, body = ask(port, "/api/training/metrics?rank=0&since=18&token=" + token)
    assert status == 200 and [r["step"] for r in json.loads(body)["ranks"]["0"]["records"]] == [19, 20]
    status, _, _ = ask(port, "/api/training/status", {"Host": f"10.9.8.7:{port}", "Cookie": cookie_pair})
    assert status == 200   # an address typed in a browser is no rebinding
    status, _, _ = ask(port, "/api/training/status", {"Host": f"attacker.example:{port}", "Cookie": cookie_pair})
    assert status == 421
    status, _, _ = ask(port, "/api/training/status", method="OPTIONS")
    assert status == 204   # a CORS preflight carries no token and answers no data
    assert proc.poll() is None


def test_a_monitor_reads_another_through_the_token_in_its_url(everywhere, tmp_path):
    _, port, token, _ = everywhere
    empty = tmp_path / "node1-logs"
    empty.mkdir()

    def monitor_json(*sources):
        result = subprocess.run([sys.executable, "-m", "diffsynth_mbc.monitor", str(empty), *sources, "--json"],
                                capture_output=True, text=True, timeout=60, env=dict(os.environ, PYTHONPATH=str(REPO)))
        return result.stdout, json.loads(result.stdout)

    text, snap = monitor_json(f"http://127.0.0.1:{port}/?token={token}")
    assert [r["rank"] for r in snap["ranks"]] == [0, 1] and snap["missing_ranks"] == []
    assert token not in text
    text, snap = monitor_json(f"http://127.0.0.1:{port}/")
    assert snap["ranks"] == [] and any("HTTP 401" in note and "token" in note for note in snap["notes"])


def _trickle(sockets, stop, every_s):
    """Send one more byte of a request head on every socket, every ``every_s`` seconds, until ``stop``."""
    while not stop.wait(every_s):
        for sock in list(sockets):
            try:
                sock.send(b"a")
            except OSError:
                sockets.remove(sock)


def _closed_by_server(sock) -> bool:
    """True when the server ended this connection (EOF, a reset, or its 503 answer)."""
    ready, _, _ = select.select([sock], [], [], 0)
    if not ready:
        return False
    try:
        data = sock.recv(4096)
    except OSError:
        return True
    return data == b"" or data.startswith(b"HTTP/1.0 503")


@pytest.fixture
def in_process(run_dir):
    servers = []

    def start(**options):
        server = MonitorServer(MonitorState(run_dir), **options).start()
        servers.append(server)
        return server.httpd.server_address[1]
    yield start
    for server in servers:
        server.stop()


def test_slow_clients_from_one_address_cannot_hold_every_worker(in_process):
    # Once 40 connections trickling a byte now and then held all 32 workers (only a timeout per read).
    port = in_process()
    slow, stop = [], threading.Event()
    trickler = threading.Thread(target=_trickle, args=(slow, stop, 1.0), daemon=True)
    try:
        for _ in range(40):
            sock = socket.socket()
            sock.bind(("127.0.0.2", 0))   # another loopback address: another client
            sock.connect(("127.0.0.1", port))
            sock.sendall(b"GET /api/training/status HTTP/1.1\r\nX-Slow: ")
            slow.append(sock)
        trickler.start()
        time.sleep(0.5)
        t0 = time.monotonic()
        status, _, body = ask(port, "/api/training/status")
        assert status == 200 and json.loads(body)["world_size"] == 2
        assert time.monotonic() - t0 < 5
        refused = [sock for sock in list(slow) if _closed_by_server(sock)]
        assert len(refused) >= 40 - MAX_CONNECTIONS_PER_CLIENT
    finally:
        stop.set()
        for sock in slow:
            sock.close()


def test_a_request_head_trickling_in_is_cut_off_at_the_deadline(in_process):
    # A byte every 0.5 s never tripped the 5 s timeout per read: the head could take forever.
    port = in_process(header_deadline_s=2.0)
    sock = socket.create_connection(("127.0.0.1", port))
    try:
        t0 = time.monotonic()
        sock.sendall(b"GET / HTTP/1.1\r\nX-Slow: ")
        while time.monotonic() - t0 < 12 and not _closed_by_server(sock):
            sock.send(b"a")
            time.sleep(0.5)
        cut_after = time.monotonic() - t0
    finally:
        sock.close()
    assert 1.5 < cut_after < 8, cut_after
    status, _, _ = ask(port, "/api/training/status")   # a request that comes at once is still answered
    assert status == 200
