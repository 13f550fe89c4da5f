"""Real HTTP requests against ``python -m diffsynth_mbc.monitor LOG_DIR --serve 127.0.0.1:0`` in a subprocess."""

from __future__ import annotations

import http.client
import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from urllib.parse import urlsplit

import pytest

import monitor_fixtures as F
from diffsynth_mbc.monitor.access import parse_serve

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
SECRET = "top-secret-token-8d1f"


class Served:
    def __init__(self, proc, url, log_dir):
        self.proc, self.url, self.log_dir = proc, url, log_dir
        parts = urlsplit(url)
        self.host, self.port = parts.hostname, parts.port

    def get(self, path, method="GET"):
        """(status, headers, body bytes) for a path sent exactly as given (no client-side normalisation)."""
        conn = http.client.HTTPConnection(self.host, self.port, timeout=10)
        try:
            conn.request(method, path)
            resp = conn.getresponse()
            return resp.status, dict(resp.getheaders()), resp.read()
        finally:
            conn.close()

    def json(self, path):
        status, headers, body = self.get(path)
        return status, headers, json.loads(body)


def start_server(log_dir, *extra):
    env = dict(os.environ, PYTHONPATH=str(REPO))
    proc = subprocess.Popen([sys.executable, "-m", "diffsynth_mbc.monitor", str(log_dir), "--serve", "127.0.0.1:0",
                             *extra], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        line = proc.stdout.readline()  # blocks until the server prints its URL (or exits)
        match = re.search(r"http://127\.0\.0\.1:\d+/", line)
        assert match, (line, proc.stderr.read() if proc.poll() is not None else "")
        return Served(proc, match.group(0), log_dir)
    except BaseException:
        proc.kill()
        proc.wait()
        raise


def stop_server(served):
    if served.proc.poll() is None:
        served.proc.kill()
    served.proc.wait(timeout=10)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    root = tmp_path_factory.mktemp("serve")
    (root / "secret.txt").write_text(SECRET)
    log_dir = root / "training_logs"
    now = time.time()
    F.make_run(log_dir, world_size=3, steps=300, ranks=[0, 1], now=now)
    F.write_history(log_dir, 1, [100, 200], append=True, kind="val", val_loss=0.3)
    F.write_status(log_dir, 1, world_size=3, step=300, now=now, updated_at=now - 3600)
    srv = start_server(log_dir, "--interval", "0.5")
    try:
        yield srv
    finally:
        stop_server(srv)


def test_status_is_the_aggregate_and_no_other_page_may_read_it(served):
    status, headers, snap = served.json("/api/training/status")
    # Once every answer said Access-Control-Allow-Origin: *, so any web page in a local browser could read it.
    assert status == 200 and "Access-Control-Allow-Origin" not in headers
    assert headers["Content-Type"].startswith("application/json")
    assert snap["status"] == "stalled" and snap["stalled_ranks"] == [1] and snap["missing_ranks"] == [2]
    assert snap["world_size"] == 3 and snap["step"] == 300 and len(snap["ranks"]) == 2
    assert {"stalled", "age_s"} <= set(snap["ranks"][0])


def test_metrics_windows_per_rank_and_all_ranks(served):
    status, _, body = served.json("/api/training/metrics?rank=1&since=290&limit=5")
    assert status == 200 and list(body["ranks"]) == ["1"]
    r1 = body["ranks"]["1"]
    assert [r["step"] for r in r1["records"]] == [291, 292, 293, 294, 295]
    assert r1["truncated"] and r1["next_since"] == 295
    assert r1["records"][0]["loss"] == F.loss_at(291, 1)
    status, _, body = served.json("/api/training/metrics?since=295")
    assert sorted(body["ranks"]) == ["0", "1"]
    assert [r["step"] for r in body["ranks"]["0"]["records"]] == [296, 297, 298, 299, 300]
    assert [r["step"] for r in body["ranks"]["1"]["records"]] == [296, 297, 298, 299, 300]
    status, _, body = served.json("/api/training/metrics?rank=1&since=99&limit=300")
    vals = [r for r in body["ranks"]["1"]["records"] if r.get("kind") == "val"]
    assert [v["step"] for v in vals] == [100, 200]


def test_metrics_downsampled(served):
    status, _, body = served.json("/api/training/metrics?rank=0&points=50")
    r0 = body["ranks"]["0"]
    assert status == 200 and r0["downsampled"] and 25 <= len(r0["loss"]) <= 50
    assert sum(p["n"] for p in r0["loss"]) == 300 and r0["last_step"] == 300


def test_new_lines_appear_without_restart(served):
    F.write_history(served.log_dir, 0, [301, 302], append=True)
    status, _, body = served.json("/api/training/metrics?rank=0&since=300")
    assert [r["step"] for r in body["ranks"]["0"]["records"]] == [301, 302]


@pytest.mark.parametrize("query, parameter", [
    ("rank=-1", "rank"), ("rank=abc", "rank"), ("rank=1.5", "rank"), ("rank=0&rank=1", "rank"),
    ("since=abc", "since"), ("since=nan", "since"), ("since=inf", "since"),
    ("limit=0", "limit"), ("limit=100001", "limit"), ("limit=ten", "limit"),
    ("points=1", "points"), ("points=999999", "points"),
])
def test_bad_query_values_get_400_naming_the_parameter(served, query, parameter):
    status, headers, body = served.json("/api/training/metrics?" + query)
    assert status == 400 and body["parameter"] == parameter and parameter in body["error"]
    assert "Access-Control-Allow-Origin" not in headers


def test_rank_not_in_run_is_404(served):
    status, _, body = served.json("/api/training/metrics?rank=7")
    assert status == 404 and body["parameter"] == "rank"


@pytest.mark.parametrize("path", [
    "/nope", "/api/training", "/api/training/statusx", "/training_gpu0.json", "/training_logs/training_gpu0.json",
    "/../secret.txt", "/../../secret.txt", "/api/training/../../secret.txt", "/%2e%2e/secret.txt",
    "/..%2fsecret.txt", "//secret.txt", "/api/training/metrics/../../../secret.txt", "/../../../../etc/passwd",
    "/dashboard.html", "/web/dashboard.html",
])
def test_nothing_outside_the_routes_is_served(served, path):
    status, headers, body = served.get(path)
    assert status == 404, path
    assert json.loads(body)["status"] == 404
    assert SECRET.encode() not in body and b"root:" not in body and b'"step"' not in body


def test_read_only_methods(served):
    status, _, body = served.get("/api/training/status", method="POST")
    assert status == 405 and b"read-only" in body
    status, headers, _ = served.get("/api/training/metrics", method="OPTIONS")
    assert status == 204 and "Access-Control-Allow-Origin" not in headers
    status, headers, body = served.get("/api/training/status", method="HEAD")
    assert status == 200 and body == b"" and int(headers["Content-Length"]) > 0


def test_page_is_self_contained(served):
    with urllib.request.urlopen(served.url, timeout=10) as resp:
        html = resp.read().decode()
        assert resp.headers["Content-Type"].startswith("text/html")
        assert "connect-src 'self'" in resp.headers["Content-Security-Policy"]
    assert "api/training/status" in html and "api/training/metrics" in html
    assert not re.search(r"<(script|link|img)[^>]+(src|href)=", html)  # nothing loaded from elsewhere
    assert "cdn" not in html.lower()


def test_urllib_raises_http_errors_as_json(served):
    with pytest.raises(urllib.error.HTTPError) as exc:
        urllib.request.urlopen(served.url + "api/training/metrics?limit=-5", timeout=10)
    assert exc.value.code == 400 and json.loads(exc.value.read())["parameter"] == "limit"


def test_sigterm_stops_the_server_cleanly(tmp_path):
    F.make_run(tmp_path, world_size=1, steps=3)
    srv = start_server(tmp_path)
    try:
        status, _, snap = srv.json("/api/training/status")
        assert status == 200 and snap["world_size"] == 1
        srv.proc.send_signal(signal.SIGTERM)
        assert srv.proc.wait(timeout=10) == 0
        assert "Traceback" not in srv.proc.stderr.read()
    finally:
        stop_server(srv)


def test_cors_only_for_the_origin_named(tmp_path):
    log_dir = tmp_path / "logs"
    log_dir.mkdir()
    served = start_server(log_dir, "--no-view", "--cors", "http://localhost:3000")
    try:
        status, headers, _ = served.get("/api/training/status")
        assert status == 200 and headers["Access-Control-Allow-Origin"] == "http://localhost:3000"
        status, headers, _ = served.get("/api/training/status", method="OPTIONS")
        assert status == 204 and headers["Access-Control-Allow-Origin"] == "http://localhost:3000"
    finally:
        stop_server(served)


def test_serve_address_parsing():
    assert parse_serve("8080") == ("127.0.0.1", 8080)
    assert parse_serve(":0") == ("127.0.0.1", 0)
    assert parse_serve("0.0.0.0:7010") == ("0.0.0.0", 7010)
    assert parse_serve("[::1]:7010") == ("::1", 7010)
    for bad in ("x", "70000", "host:", "[::1]7010"):
        with pytest.raises(ValueError):
            parse_serve(bad)


def test_a_long_history_does_not_hold_up_the_first_answer(tmp_path):
    # Once the first /status parsed the whole history first, and every other request waited behind it.
    F.make_run(tmp_path, world_size=1, ranks=[0], steps=90_000, now=time.time())   # about 9 MB of history
    srv = start_server(tmp_path, "--no-view")
    try:
        status, _, snap = srv.json("/api/training/status")
        assert status == 200 and snap["ranks"][0]["history_complete"] is False   # answered from the tail
        assert snap["ranks"][0]["median_step_time_s"] == 2.0 and len(snap["ranks"][0]["loss_trend"]) > 0
        status, _, body = srv.json("/api/training/metrics?rank=0&points=50")     # waits for the whole read
        assert status == 200 and sum(p["n"] for p in body["ranks"]["0"]["loss"]) == 90_000
        time.sleep(0.6)   # past the status' 0.5 s cache
        status, _, snap = srv.json("/api/training/status")
        assert snap["ranks"][0]["history_complete"] is True and snap["ranks"][0]["history_lines"] == 90_000
    finally:
        stop_server(srv)
