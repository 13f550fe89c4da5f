"""Files a run folder should never hold, and clients a server should survive: the monitor stays up."""

from __future__ import annotations

import http.client
import json
import os
import socket
import subprocess
import sys
import threading
import time

import monitor_fixtures as F
from diffsynth_mbc.monitor.access import MAX_CONNECTIONS_PER_CLIENT
from diffsynth_mbc.monitor.server import WORKERS, MonitorServer
from diffsynth_mbc.monitor.state import MonitorState
from diffsynth_mbc.monitor.status import MAX_RANKS

DEEP = "[" * 100_000 + "]" * 100_000


def refreshed(log_dir, timeout=10.0) -> dict:
    """refresh() in a thread, so a monitor that blocks fails the test instead of hanging it."""
    result = {}
    worker = threading.Thread(target=lambda: result.update(snap=MonitorState(log_dir, clock=lambda: F.NOW).refresh()),
                              daemon=True)
    worker.start()
    worker.join(timeout)
    assert "snap" in result, "the monitor blocked"
    return result["snap"]


def test_absurd_world_sizes_and_ranks_are_bad_data_not_a_memory_bomb(tmp_path):
    F.make_run(tmp_path, world_size=2, steps=5)
    F.write_status(tmp_path, 0, world_size=10**12)
    F.write_raw(tmp_path / "training_gpu99999999999.json", json.dumps(F.status(5)))
    no_world_size = {k: v for k, v in F.status(200000).items() if k != "world_size"}
    F.write_raw(tmp_path / "training_gpu200000.json", json.dumps(no_world_size))
    started = time.monotonic()
    snap = refreshed(tmp_path)
    assert time.monotonic() - started < 5
    assert snap["world_size"] <= MAX_RANKS and len(snap["missing_ranks"]) <= MAX_RANKS
    assert any("outside 0..65536" in note for note in snap["notes"])
    assert len(snap["notes"]) < 100


def test_deeply_nested_json_is_a_bad_record_and_http_keeps_answering(tmp_path):
    F.make_run(tmp_path, world_size=2, steps=5)
    F.write_raw(tmp_path / "training_gpu1.json", DEEP)
    with open(tmp_path / "training_gpu0.jsonl", "a") as history:
        history.write(DEEP + "\n" + F.history_line(6) + "\n")
    state = MonitorState(tmp_path, clock=lambda: F.NOW)
    snap = state.refresh()
    assert any("nested too deeply" in note for note in snap["notes"])
    server = MonitorServer(state).start()
    try:
        for path in ("/api/training/status", "/api/training/metrics?rank=0&since=4"):
            conn = http.client.HTTPConnection("127.0.0.1", server.httpd.server_address[1], timeout=10)
            conn.request("GET", path)
            response = conn.getresponse()
            body = response.read()
            assert response.status == 200, body[:200]
        assert [r["step"] for r in json.loads(body)["ranks"]["0"]["records"]] == [5, 6]
    finally:
        server.stop()


def test_status_text_is_shown_never_interpreted_by_the_terminal(tmp_path):
    F.make_run(tmp_path, world_size=2, steps=5)
    F.write_status(tmp_path, 0, phase="[/data/mbc] loading", hostname="[bold red]evil[link=http://x]y")
    F.write_status(tmp_path, 1, phase="\x1b[2Jclear\x1b]0;owned\x07 screen", status="failed",
                   error={"type": "X", "message": "[/oops]", "traceback_tail": "line [/x]\x1b[31m"})
    result = subprocess.run([sys.executable, "-m", "diffsynth_mbc.monitor", str(tmp_path), "--once"],
                            capture_output=True, text=True, timeout=60, env=dict(os.environ, COLUMNS="200"))
    assert result.returncode == 1, result.stderr      # a failed rank; not a crash (MarkupError once)
    out = result.stdout
    assert "[/data/mbc]" in out and "red]evil[link=http://x]y" in out and "[/oops]" in out
    assert "\x1b[2J" not in out and "\x1b]0;" not in out and "\x07" not in out


def test_oversized_records_are_skipped_and_answers_stay_small(tmp_path):
    F.make_run(tmp_path, world_size=1, ranks=[0], steps=3)
    with open(tmp_path / "training_gpu0.jsonl", "a") as history:
        history.write(json.dumps({"step": 4, "junk": "x" * (3 << 20)}) + "\n" + F.history_line(5) + "\n")
        history.write('{"step": 6, "tail": "' + "y" * (3 << 20))      # a huge unterminated tail
    state = MonitorState(tmp_path, clock=lambda: F.NOW)
    server = MonitorServer(state).start()
    try:
        for _ in range(3):
            conn = http.client.HTTPConnection("127.0.0.1", server.httpd.server_address[1], timeout=10)
            conn.request("GET", "/api/training/metrics?rank=0&since=0")
            response = conn.getresponse()
            body = response.read()
            assert response.status == 200 and len(body) < 100_000
            assert [r["step"] for r in json.loads(body)["ranks"]["0"]["records"]] == [1, 2, 3, 5]
    finally:
        server.stop()


def test_half_open_connections_neither_pile_up_threads_nor_starve_real_clients(tmp_path):
    F.make_run(tmp_path, world_size=1, ranks=[0], steps=3)
    server = MonitorServer(MonitorState(tmp_path, clock=lambda: F.NOW)).start()
    port = server.httpd.server_address[1]
    idle = []
    try:
        before = threading.active_count()
        for _ in range(WORKERS + 20):
            sock = socket.socket()
            sock.bind(("127.0.0.2", 0))              # another client than the real one below
            sock.connect(("127.0.0.1", port))
            idle.append(sock)                        # connected, sends nothing
        time.sleep(0.5)
        assert threading.active_count() - before <= MAX_CONNECTIONS_PER_CLIENT + 2   # the rest got 503 at once
        started = time.monotonic()
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        conn.request("GET", "/api/training/status")
        assert conn.getresponse().status == 200
        assert time.monotonic() - started < 25, "a real client waited behind idle connections"
    finally:
        for sock in idle:
            sock.close()
        server.stop()


def test_a_fifo_named_like_a_status_file_never_hangs_the_monitor(tmp_path):
    F.make_run(tmp_path, world_size=2, steps=5)
    os.unlink(tmp_path / "training_gpu1.json")
    os.mkfifo(tmp_path / "training_gpu1.json")
    os.unlink(tmp_path / "training_gpu0.jsonl")
    os.mkfifo(tmp_path / "training_gpu0.jsonl")
    snap = refreshed(tmp_path)
    assert snap["missing_ranks"] == [1]
    assert any("not a regular file" in note for note in snap["notes"])
