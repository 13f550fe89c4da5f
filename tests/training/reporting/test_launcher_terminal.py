"""The launcher in a real terminal (tmux): rank 0's live bar updates on it while the log gets plain lines, and
the watch command it prints works when pasted from it. The run trains with the frame options (a random window per
epoch at a source fps, short clips looped), which reach the ranks through the launcher."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import time

import pytest

from e2e_helpers import REPO, isolated_env, read_history, read_status

pytestmark = [
    pytest.mark.slow,
    # CI installs tmux and sets MBC_REQUIRE_TMUX=1, so there a missing tmux fails instead of skipping.
    pytest.mark.skipif(shutil.which("tmux") is None and not os.environ.get("MBC_REQUIRE_TMUX"),
                       reason="tmux not installed (apt-get install tmux)"),
]
# The bar's line: step/total, % and ETA first, the bar, then the other fields as the terminal's width allows.
BAR = re.compile(r"^step (\d+)/(\d+) \(\S+%\) ETA \S+ ━+(.*)$", re.M)
FRAME_OPTIONS = "--frame_sampling random_window --source_fps 6 --short_clips loop --num_frames 5"
TOTAL_STEPS = 14   # the demo's 2 epochs on 2 ranks, 5-frame windows


LOG_DIR = "logs of Kim's run"   # a space and a quote: the printed watch command must survive being pasted


@pytest.fixture(scope="module")
def terminal_run(tmp_path_factory):
    """The demo launched in a 160x40 tmux terminal, its log folder named ``LOG_DIR``; the screen read every 0.1 s
    while it runs: (work folder, the whole screen at the end, bar step counts seen, bar fields seen, exit code)."""
    work = tmp_path_factory.mktemp("terminal")
    env = isolated_env(work, OMP_NUM_THREADS=1, TERM="xterm-256color", HOME=str(work))
    socket = work / "tmux.sock"
    done = work / "exit-code"
    # the demo's steps (a few tenths of a second on 2 cores) outlast the 0.1 s between looks at the screen
    launcher = (f"bash {shlex.quote(str(REPO / 'launchers' / 'train_test.sh'))} --demo --log_dir {shlex.quote(LOG_DIR)} "
                f"{FRAME_OPTIONS}")
    command = f"cd {shlex.quote(str(work))} && {launcher}; echo $? > {shlex.quote(str(done))}; sleep 600"
    subprocess.run(["tmux", "-S", str(socket), "new-session", "-d", "-x", "160", "-y", "40", command],
                   check=True, env=env)
    bar_steps, bar_fields, screen = set(), set(), ""
    try:
        deadline = time.monotonic() + 300
        while not done.exists() and time.monotonic() < deadline:
            screen = subprocess.run(["tmux", "-S", str(socket), "capture-pane", "-p"], capture_output=True,
                                    text=True).stdout
            for match in BAR.finditer(screen):
                bar_steps.add((int(match.group(1)), int(match.group(2))))
                bar_fields.add(match.group(3))
            time.sleep(0.1)
        time.sleep(0.5)
        # -J: lines the terminal wrapped are joined back, as a mouse selection copies them
        screen = subprocess.run(["tmux", "-S", str(socket), "capture-pane", "-p", "-J", "-S", "-200"],
                                capture_output=True, text=True).stdout
    finally:
        subprocess.run(["tmux", "-S", str(socket), "kill-server"], capture_output=True)
    code = done.read_text().strip() if done.exists() else None
    return work, screen, bar_steps, bar_fields, code


def test_the_demo_launcher_draws_a_live_bar_in_a_terminal(terminal_run):
    work, screen, bar_steps, bar_fields, code = terminal_run
    assert code == "0", screen
    # The bar was redrawn in place as steps went by: several different step counts seen live, not only the end.
    assert {total for _, total in bar_steps} == {TOTAL_STEPS}, (sorted(bar_steps), screen)
    assert len({step for step, _ in bar_steps} - {TOTAL_STEPS}) >= 2, (sorted(bar_steps), screen)
    # The bar measured this terminal's 160 columns (rank 0's own streams are pipes: rich took 80 and cut it).
    assert any("samples/s" in fields and "elapsed" in fields for fields in bar_fields), (bar_fields, screen)
    assert f"finished: {TOTAL_STEPS}/{TOTAL_STEPS} steps" in screen and "python -m diffsynth_mbc.monitor" in screen
    # The log file, meanwhile, got the plain progress lines (not the bar) and the summary.
    log, = (work / "runs" / "demo" / "lora").glob("train-*.log")
    text = log.read_text()
    assert re.search(rf"^(epoch 1/2 done \| )?step \d+/{TOTAL_STEPS} \(.*ETA", text, re.M), text[-3000:]
    assert f"finished: {TOTAL_STEPS}/{TOTAL_STEPS} steps" in text and "━" not in text


def test_the_printed_watch_command_works_when_pasted_with_spaces_and_quotes_in_the_path(terminal_run):
    """The launcher printed `watch: python -m diffsynth_mbc.monitor $LOG_DIR` unquoted: pasted into a shell, a
    log folder with a space or a quote in its name broke it."""
    work, screen, _, _, code = terminal_run
    assert code == "0", screen
    command = re.search(r"watch: (python -m diffsynth_mbc\.monitor .*?)\s*$", screen, re.M).group(1)
    pasted = subprocess.run(["bash", "-c", command.replace("python", sys.executable, 1) + " --once --json"],
                            cwd=work, env=isolated_env(work), capture_output=True, text=True, timeout=60)
    assert pasted.returncode == 0, (command, pasted.stderr)
    assert json.loads(pasted.stdout)["status"] == "finished"


def test_the_frame_options_reach_the_ranks_and_a_random_window_trains_two_epochs_on_two_ranks(terminal_run):
    work, screen, _, _, code = terminal_run
    assert code == "0", screen
    log, = (work / "runs" / "demo" / "lora").glob("train-*.log")   # the launcher's command is in the run's log
    run_line, = [line for line in log.read_text().splitlines() if line.startswith("run run-")]
    assert FRAME_OPTIONS in run_line, run_line
    log_dir = work / LOG_DIR
    for rank in (0, 1):
        state = read_status(log_dir, rank)
        assert state["status"] == "finished" and state["step"] == state["total_steps"] == TOTAL_STEPS
        assert state.get("skipped_samples", 0) == 0 and state["num_epochs"] == 2
        assert [line["step"] for line in read_history(log_dir, rank)] == list(range(1, TOTAL_STEPS + 1))
    assert (work / "runs" / "demo" / "lora" / "lora.safetensors").stat().st_size > 0
