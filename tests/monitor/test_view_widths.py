"""The live monitor in a real terminal (tmux): readable at 80x24, the full table at 200x50."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time

import pytest

import monitor_fixtures as F
from e2e_helpers import REPO

# CI installs tmux and sets MBC_REQUIRE_TMUX=1, so there a missing tmux fails instead of skipping.
pytestmark = pytest.mark.skipif(shutil.which("tmux") is None and not os.environ.get("MBC_REQUIRE_TMUX"),
                                reason="tmux not installed (apt-get install tmux)")


def screen(tmp_path, width, height) -> str:
    socket = tmp_path / "tmux.sock"
    command = f"cd {REPO} && {sys.executable} -m diffsynth_mbc.monitor {tmp_path / 'logs'} --interval 0.5"
    subprocess.run(["tmux", "-S", str(socket), "new-session", "-d", "-x", str(width), "-y", str(height), command],
                   check=True, env={"PATH": "/usr/bin:/bin", "TERM": "xterm-256color", "HOME": str(tmp_path)})
    try:
        deadline = time.monotonic() + 30
        text = ""
        while time.monotonic() < deadline:
            time.sleep(0.5)
            text = subprocess.run(["tmux", "-S", str(socket), "capture-pane", "-p"], capture_output=True,
                                  text=True).stdout
            if "rank" in text and "1000" in text:
                break
        return text
    finally:
        subprocess.run(["tmux", "-S", str(socket), "kill-server"], capture_output=True)


@pytest.mark.parametrize("width,height", [(80, 24), (200, 50)])
def test_step_loss_and_eta_appear_whole(tmp_path, width, height):
    overheads = {"checkpoint": {"count": 3, "total_s": 13.8, "last_s": 4.5, "mean_s": 4.6}}
    F.make_run(tmp_path / "logs", world_size=2, steps=100, overheads=overheads)
    F.write_status(tmp_path / "logs", 1, phase="loading a very long phase name " * 5, overheads=overheads)
    text = screen(tmp_path, width, height)
    lines = text.splitlines()
    assert lines and max(len(line) for line in lines) <= width
    # step, each rank's loss, ETA, the time between steps
    for whole in ("100/1000", "0.4293", "0.4383", "30m00s", "checkpoints 3 x 4.6 s"):
        assert whole in text, text
    assert all("…" not in line or "phase" not in line for line in lines)
    if width < 110:
        rank_lines = [line for line in lines if line.strip().startswith(("0 ", "1 "))]
        assert len(rank_lines) == 2, text                          # one line per rank
        assert rank_lines[1].rstrip().endswith("…")                # the long phase is cut at the end
    else:
        assert "GPU mem" in text and "trend" in text                # the full table
