"""The monitor command: --once --json exit codes (real subprocesses and in-process), the rich frame, the live view."""

from __future__ import annotations

import json
import os
import pty
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

import monitor_fixtures as F
from diffsynth_mbc.monitor import cli as monitor

REPO = Path(__file__).resolve().parents[2]


def run_cli(*args, timeout=60, **kw):
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run([sys.executable, "-m", "diffsynth_mbc.monitor", *map(str, args)], capture_output=True,
                          text=True, timeout=timeout, env=env, **kw)


def live_run(log_dir, now):
    """A run as a live training writes it: updated just now, by the real clock."""
    F.make_run(log_dir, world_size=2, steps=30, now=now)
    return log_dir


@pytest.mark.slow
@pytest.mark.parametrize("case, code, status", [
    ("training", 0, "training"), ("failed", 1, "failed"), ("stalled", 3, "stalled"), ("empty", 4, "no_data"),
])
def test_json_exit_codes_in_a_subprocess(tmp_path, case, code, status):
    now = time.time()
    if case != "empty":
        live_run(tmp_path, now)
    if case == "failed":
        F.write_status(tmp_path, 1, status="failed", error=F.failed_error(), now=now)
    if case == "stalled":
        F.write_status(tmp_path, 0, step=30, now=now, updated_at=now - 1000)
    proc = run_cli(tmp_path, "--once", "--json")
    assert proc.returncode == code, proc.stderr
    snap = json.loads(proc.stdout)
    assert snap["status"] == status
    for key in ("world_size", "step", "total_steps", "progress", "elapsed_s", "eta_s", "samples_per_s", "loss",
                "ranks", "stalled_ranks", "missing_ranks", "errors", "notes"):
        assert key in snap
    if case == "stalled":
        assert snap["stalled_ranks"] == [0] and snap["ranks"][0]["age_s"] >= 1000
    if case == "failed":
        assert snap["errors"][0]["rank"] == 1 and "loss.backward()" in snap["errors"][0]["traceback_tail"]
    if case == "empty":
        assert snap["ranks"] == [] and snap["world_size"] is None


def test_json_in_process_default_dir_stopped_finished_and_stall_after(workdir, capsys):
    log_dir = workdir / "training_logs"  # the default LOG_DIR
    now = time.time()
    F.make_run(log_dir, world_size=2, steps=1000, status="finished", now=now - 7200)
    assert monitor.main(["--json"]) == 0
    assert json.loads(capsys.readouterr().out)["status"] == "finished"
    F.write_status(log_dir, 1, status="stopped", step=400, now=now)
    assert monitor.main(["--once", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["status"] == "stopped"
    F.make_run(log_dir, world_size=2, steps=10, now=now - 30)
    assert monitor.main([str(log_dir), "--json"]) == 0
    capsys.readouterr()
    assert monitor.main([str(log_dir), "--json", "--stall-after", "5"]) == 3
    snap = json.loads(capsys.readouterr().out)
    assert snap["stalled_ranks"] == [0, 1] and snap["ranks"][0]["stall_after_s"] == 5


def test_once_renders_a_frame_with_the_key_facts(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")
    now = time.time()
    F.make_run(tmp_path, world_size=4, steps=40, ranks=[0, 1, 2], now=now)
    F.write_status(tmp_path, 1, world_size=4, step=40, now=now, updated_at=now - 900)
    F.write_status(tmp_path, 2, world_size=4, status="failed", step=40, now=now, error=F.failed_error())
    code = monitor.main([str(tmp_path), "--once"])
    out = capsys.readouterr().out
    assert code == 1
    for text in ("FAILED", "STALLED", "missing", "no status file", "40/1000", "rank 2 failed on node-a",
                 "RuntimeError: CUDA out of memory", "loss.backward()", "21.5/32 GB", "97%", "rank 3 missing"):
        assert text in out, text
    assert any(ch in out for ch in "▁▂▃▄▅▆▇█")  # the loss sparkline


def test_the_same_error_on_several_ranks_is_said_once_naming_them(tmp_path, capsys, monkeypatch):
    """A DDP run fails on every rank with one error: the terminal printed it in full once per rank."""
    monkeypatch.setenv("COLUMNS", "200")
    now = time.time()
    F.make_run(tmp_path, world_size=4, steps=40, ranks=[], now=now)
    for rank in (0, 1, 3):
        F.write_status(tmp_path, rank, world_size=4, status="failed", step=40, now=now, error=F.failed_error())
    other = {**F.failed_error(), "type": "ValueError", "message": "a different failure"}
    F.write_status(tmp_path, 2, world_size=4, status="failed", step=40, now=now, error=other)
    assert monitor.main([str(tmp_path), "--once"]) == 1
    out = capsys.readouterr().out
    assert "ranks 0-1, 3 failed on node-a" in out and "rank 0 failed" not in out and "rank 1 failed" not in out
    assert "rank 2 failed on node-a" in out and "ValueError: a different failure" in out
    assert out.count("Traceback (most recent call last)") == 2   # one per distinct error, not one per rank


def test_once_on_an_empty_directory_says_so(tmp_path, capsys):
    assert monitor.main([str(tmp_path), "--once"]) == 4   # a run that has not written yet
    assert "NO_DATA" in capsys.readouterr().out


@pytest.mark.parametrize("argv", [["--once"], ["--json"], []])
def test_a_folder_that_does_not_exist_is_an_error_naming_it(tmp_path, capsys, argv):
    """A typo (training_log for training_logs) used to wait forever for a run that would never write there."""
    F.make_run(tmp_path / "runs" / "demo" / "training_logs", world_size=2, steps=5, now=time.time())
    typo = tmp_path / "runs" / "demo" / "training_log"
    assert monitor.main([str(typo), *argv]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.count("\n") == 1 and f"log folder {typo} does not exist" in captured.err
    assert monitor.main([str(typo / "training_gpu0.json"), "--once"]) == 2
    assert monitor.main([str(tmp_path / "runs" / "demo" / "training_logs" / "training_gpu0.json"), "--once"]) == 2
    assert "is not a folder" in capsys.readouterr().err


def test_a_folder_holding_the_run_logs_one_level_down_is_followed_and_named(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")
    output = tmp_path / "runs" / "test" / "lora"     # the output folder, its logs in training_logs/ (the default)
    logs = output / "training_logs"
    F.make_run(logs, world_size=2, steps=7, now=time.time())
    (output / "checkpoints").mkdir()
    assert monitor.main([str(output), "--json"]) == 0
    captured = capsys.readouterr()
    assert json.loads(captured.out)["step"] == 7
    assert captured.err.strip() == f"watching {logs} (the run's log folder inside {output})"
    assert monitor.main([str(output), "--once"]) == 0
    assert str(logs) in capsys.readouterr().out           # the frame's title names the folder watched
    fresh = tmp_path / "runs" / "fresh"                     # a launch made its empty log folder; no rank wrote yet
    (fresh / "training_logs").mkdir(parents=True)
    assert monitor.main([str(fresh), "--once"]) == 4
    assert f"watching {fresh / 'training_logs'}" in capsys.readouterr().err


def test_a_folder_that_is_neither_logs_nor_holds_them_is_named(tmp_path, capsys):
    runs = tmp_path / "runs"
    for name in ("a", "b"):
        F.make_run(runs / name / "training_logs", world_size=1, steps=3, now=time.time())
    assert monitor.main([str(runs / "a"), "--json"]) == 0    # one run below: followed
    capsys.readouterr()
    F.make_run(runs / "a" / "other_logs", world_size=1, steps=3, now=time.time())
    assert monitor.main([str(runs / "a"), "--json"]) == 2    # two log folders below: which one is for the user
    assert "holds the logs of several runs" in capsys.readouterr().err
    output = tmp_path / "demo" / "lora"                      # an output folder whose --log_dir is elsewhere
    (output / "checkpoints").mkdir(parents=True)
    (output / "lora.safetensors").write_bytes(b"x")
    assert monitor.main([str(output), "--once"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"{output} is a run's output folder without its logs" in err


def test_help_documents_exit_codes_and_rules(capsys):
    with pytest.raises(SystemExit) as exc:
        monitor.main(["--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    for text in ("--stall_after", "--serve", "1 failed; 3 stalled; 4 no data", "stopped", "newest started_at",
                 "max(120 s, 10 x"):
        assert text in out, text


@pytest.mark.parametrize("argv", [["--serve", "1234", "--once"], ["--serve", "1234", "--json"],
                                  ["--serve", "nope"], ["--interval", "0"], ["--stall-after", "-1"]])
def test_usage_errors_exit_2(argv, capsys):
    with pytest.raises(SystemExit) as exc:
        monitor.main(argv)
    assert exc.value.code == 2


class TerminalReader(threading.Thread):
    """Reads a pty master for as long as the program writes, like a terminal emulator does.

    A test that stops reading while the program keeps refreshing fills the pty's buffer; the program's
    writer then blocks, and on a loaded machine Ctrl-C lands while it is blocked. Reading all the time
    keeps the program's timing independent of the test's."""

    def __init__(self, master: int):
        super().__init__(daemon=True)
        self.master, self.chunks, self.lock = master, [], threading.Lock()

    def run(self):
        while True:
            try:
                chunk = os.read(self.master, 65536)
            except OSError:   # EIO: every writer closed the terminal
                return
            if not chunk:
                return
            with self.lock:
                self.chunks.append(chunk)

    def output(self) -> bytes:
        with self.lock:
            return b"".join(self.chunks)


@pytest.mark.slow
def test_live_view_in_a_terminal_quits_cleanly_on_ctrl_c(tmp_path):
    live_run(tmp_path, time.time())
    master, slave = pty.openpty()
    env = dict(os.environ, PYTHONPATH=str(REPO), COLUMNS="160", LINES="50", TERM="xterm-256color")
    proc = subprocess.Popen([sys.executable, "-m", "diffsynth_mbc.monitor", str(tmp_path), "--interval", "0.2"],
                            stdin=slave, stdout=slave, stderr=slave, env=env, close_fds=True)
    os.close(slave)
    reader = TerminalReader(master)
    reader.start()
    try:
        deadline = time.monotonic() + 60    # generous: a loaded 2-core machine imports slowly
        while time.monotonic() < deadline and reader.output().count(b"refreshed ") < 2:
            time.sleep(0.1)
        out = reader.output()
        assert out.count(b"refreshed ") >= 2, out[-2000:]
        assert b"\x1b[?25l" in out  # the live display hid the cursor...
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=60) == 0
        reader.join(timeout=10)    # the program has exited: the reader sees EIO once the output is drained
        out = reader.output()
        assert out.rfind(b"\x1b[?25h") > out.rfind(b"\x1b[?25l")  # ...and showed it again on exit
        assert b"Traceback" not in out
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        reader.join(timeout=10)
        os.close(master)
