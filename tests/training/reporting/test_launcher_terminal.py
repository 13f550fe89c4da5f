"""The launcher in a real terminal (tmux): rank 0's live bar updates on it while the log gets plain lines."""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import time

import pytest

from e2e_helpers import REPO, isolated_env

pytestmark = [
    pytest.mark.slow,
    # CI installs tmux and sets MBC_REQUIRE_TMUX=1, so there a missing tmux fails instead of skipping.
    pytest.mark.skipif(shutil.which("tmux") is None and not os.environ.get("MBC_REQUIRE_TMUX"),
                       reason="tmux not installed (apt-get install tmux)"),
]
# The bar's line: step/total, % and ETA first, the bar, then the other fields as the terminal's width allows.
BAR = re.compile(r"^step (\d+)/12 \(\S+%\) ETA \S+ ━+(.*)$", re.M)


def test_the_demo_launcher_draws_a_live_bar_in_a_terminal(tmp_path):
    env = isolated_env(tmp_path, OMP_NUM_THREADS=1, TERM="xterm-256color", HOME=str(tmp_path))
    socket = tmp_path / "tmux.sock"
    done = tmp_path / "exit-code"
    # 128x128 frames: steps slow enough (a few tenths of a second) to watch the bar move
    launcher = f"bash {shlex.quote(str(REPO / 'launchers' / 'train_test.sh'))} --demo --height 128 --width 128"
    command = f"cd {shlex.quote(str(tmp_path))} && {launcher}; echo $? > {shlex.quote(str(done))}; sleep 600"
    subprocess.run(["tmux", "-S", str(socket), "new-session", "-d", "-x", "160", "-y", "40", command],
                   check=True, env=env)
    bar_steps, bar_fields, screen = set(), set(), ""
    try:
        deadline = time.monotonic() + 300
        while not done.exists() and time.monotonic() < deadline:
            screen = subprocess.run(["tmux", "-S", str(socket), "capture-pane", "-p"], capture_output=True,
                                    text=True).stdout
            for match in BAR.finditer(screen):
                bar_steps.add(int(match.group(1)))
                bar_fields.add(match.group(2))
            time.sleep(0.1)
        time.sleep(0.5)
        screen = subprocess.run(["tmux", "-S", str(socket), "capture-pane", "-p", "-S", "-200"], capture_output=True,
                                text=True).stdout
    finally:
        subprocess.run(["tmux", "-S", str(socket), "kill-server"], capture_output=True)
    assert done.exists() and done.read_text().strip() == "0", screen
    # The bar was redrawn in place as steps went by: several different step counts seen live, not only the end.
    assert len(bar_steps - {12}) >= 2, (sorted(bar_steps), screen)
    # The bar measured this terminal's 160 columns (rank 0's own streams are pipes: rich took 80 and cut it).
    assert any("samples/s" in fields and "elapsed" in fields for fields in bar_fields), (bar_fields, screen)
    assert "finished: 12/12 steps" in screen and "python -m diffsynth_mbc.monitor" in screen
    # The log file, meanwhile, got the plain progress lines (not the bar) and the summary.
    log, = (tmp_path / "runs" / "demo" / "lora").glob("train-*.log")
    text = log.read_text()
    assert re.search(r"^(epoch 1/2 done \| )?step \d+/12 \(.*ETA", text, re.M), text[-3000:]
    assert "finished: 12/12 steps" in text and "━" not in text
