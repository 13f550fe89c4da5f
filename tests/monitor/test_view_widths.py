"""The live monitor in a real terminal (tmux): readable at 80x24, the full table at 200x50."""

from __future__ import annotations

import os
import re
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


def test_the_loss_per_mode_fits_a_80x24_pane(tmp_path):
    """A run whose history has modes: each rank's recent loss per mode, whole, under the rank lines."""
    F.make_run(tmp_path / "logs", world_size=2, steps=100)
    for rank in (0, 1):
        with open(tmp_path / "logs" / f"training_gpu{rank}.jsonl", "a", encoding="utf-8") as handle:
            handle.write("".join(F.history_line(s, rank, timesteps=[100.0, 500.0, 900.0], modes=["t2i", "i2v", "t2v"],
                                                timestep_losses=[0.4123, 0.5331 + rank / 100, 0.6012])
                                 for s in range(101, 121)))
    text = screen(tmp_path, 80, 24)
    lines = text.splitlines()
    assert lines and max(len(line) for line in lines) <= 80
    for whole in ("loss by mode", "rank 0  t2i 0.4123  i2v 0.5331  t2v 0.6012",
                  "rank 1  t2i 0.4123  i2v 0.5431  t2v 0.6012", "30m00s"):
        assert whole in text, text
    assert len(lines) <= 24


@pytest.mark.parametrize("width,height", [(80, 24), (200, 50)])
def test_a_loss_reads_the_same_wherever_the_terminal_shows_it(tmp_path, width, height):
    """Every loss is written by one rule (4 significant digits, zeros kept): 0.41 is "0.4100" in the header's mean,
    each rank's row and each rank's loss by mode, never "0.41" beside a "0.4123"."""
    F.make_run(tmp_path / "logs", world_size=2, steps=100, loss=0.41)
    for rank in (0, 1):
        with open(tmp_path / "logs" / f"training_gpu{rank}.jsonl", "a", encoding="utf-8") as handle:
            handle.write("".join(F.history_line(s, rank, timesteps=[100.0, 500.0], modes=["t2i", "i2v"],
                                                timestep_losses=[0.41, 0.4123]) for s in range(101, 121)))
    text = screen(tmp_path, width, height)
    shown = re.findall(r"(?<![\d.])0\.41\d*", text)
    # the mean, rank 0's and rank 1's loss, and t2i's on both ranks; i2v's on both
    assert sorted(shown) == ["0.4100"] * 5 + ["0.4123"] * 2, text
    for rank in (0, 1):
        assert f"rank {rank}  t2i 0.4100  i2v 0.4123" in text, text


@pytest.mark.parametrize("width,height", [(100, 30), (200, 50)])
def test_the_validation_best_lora_stage_and_early_stop_appear_whole(tmp_path, width, height):
    """At 100 columns the terminal monitor showed no validation loss, best LoRA, stage or early stop, all of which
    the status files say (and the dashboard shows)."""
    best = {"step": 80, "val_loss": 0.3912, "val_loss_base": 0.4, "gain": 0.022, "file": "runs/x/lora-best.safetensors"}
    stage = {"stage": 2, "size": "96x96x9", "from_step": 61, "to_step": 100, "steps": 40, "tokens": 27, "of": 2,
             "final": True}
    early_stop = {"step": 100, "best_step": 80, "validations_without_improvement": 3, "since_step": 70,
                  "patience": 3, "min_delta": 0.001}
    F.make_run(tmp_path / "logs", world_size=2, steps=100, val_loss=0.4021, val_step=100, best=best, stage=stage,
               early_stop=early_stop)
    text = screen(tmp_path, width, height)
    lines = text.splitlines()
    assert lines and max(len(line) for line in lines) <= width
    for whole in ("validation 0.4021 at step 100", "stage 2/2: 96x96x9 (the final size)",
                  "best LoRA 0.3912 at step 80 (2.20% below the base): runs/x/lora-best.safetensors",
                  "stopped early at step 100: no better validation in 3 evaluations since step 70"):
        assert whole in text, text


def test_where_the_early_stops_count_stands_appears_while_the_run_trains(tmp_path):
    """While the run trains, --early_stop's count (the status file's early_stop_count) is the early-stop state."""
    count = {"step": 80, "count": 1, "patience": 3, "min_delta": 0.001, "not_counted": None, "counts_from_step": 1,
             "finite": True, "compared_with_step": 60, "change": -0.0004, "reset": False, "since_step": 60}
    F.make_run(tmp_path / "logs", world_size=2, steps=100, val_loss=0.4021, val_step=80, early_stop_count=count)
    text = screen(tmp_path, 100, 30)
    assert "early stop: 1 of 3 validations without improvement since step 60" in text, text
