"""A real 2-rank CPU run whose rank 1 makes its checkpoints slow on purpose (``MBC_FAULT_SLOW_CHECKPOINT_S=1:3``):
the checkpoints, LoRA files and validation are timed apart from the steps, in the status file, the JSONL, the
terminal and the monitor, no step's time holds a checkpoint, and rank 0, waiting for rank 1 inside the save, says
so in its status file."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time

import pytest

from diffsynth_mbc.data.demo import prepare
from e2e_helpers import REPO, read_history, read_overheads, read_status
from forked_ranks import start_training

pytestmark = pytest.mark.slow
DELAY_S = 3.0     # added to rank 1's checkpoint saves; a step of the demo takes a tenth of a second or so
STEP_LIMIT_S = 2.0  # a step that held a checkpoint would take at least DELAY_S; the margin absorbs a loaded machine


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    work = tmp_path_factory.mktemp("step-times")
    root = work / "demo"
    prepare(root, num_videos=3, num_images=2)       # 5 rows x repeat 2 on 2 ranks: 5 steps, batch 1
    val = prepare(root / "val", num_videos=1, num_images=1)
    flags = [
        "--config", str(REPO / "configs" / "train_demo.yaml"), "--dataset_base_path", str(root / "catalog"),
        "--dataset_metadata_path", str(root / "metadata" / "metadata.csv"), "--output_path", str(root / "lora"),
        "--log_dir", str(root / "logs"), "--gradient_accumulation_steps", "1", "--num_epochs", "1",
        "--dataset_repeat", "2", "--image_batch_size", "1",   # the 5-step plan these checks are written for
        "--checkpoint_steps", "2", "--val_metadata_path", str(val), "--val_base_path", str(root / "val" / "catalog"),
        "--val_steps", "3", "--val_samples", "2", "--val_timestep_quantiles", "0.5", "--status_interval_s", "1"]
    process = start_training(work, flags, OMP_NUM_THREADS=1, MBC_FAULT_SLOW_CHECKPOINT_S=f"1:{DELAY_S}")
    waits = set()   # what rank 0's status file said it waited for, looked at every 0.1 s while the run went
    deadline = time.monotonic() + 300
    while process.poll() is None and time.monotonic() < deadline:
        try:
            waits.add((read_status(root / "logs", 0).get("waiting") or {}).get("for"))
        except (OSError, ValueError):
            pass
        time.sleep(0.1)
    _, stderr = process.communicate(timeout=60)
    assert process.returncode == 0, stderr[-4000:]
    return root / "logs", stderr, waits


def test_every_checkpoint_lora_file_and_validation_has_its_own_line(run):
    log_dir, _, _ = run
    for rank in (0, 1):
        records = read_overheads(log_dir, rank)
        by_kind = {kind: [(r["step"], r["seconds"]) for r in records if r["overhead"] == kind]
                   for kind in ("checkpoint", "lora", "validation")}
        # Checkpoints at steps 2 and 4 by the cadence, and at the end (5); each took the injected delay at least.
        assert [step for step, _ in by_kind["checkpoint"]] == [2, 4, 5]
        assert all(seconds >= DELAY_S for _, seconds in by_kind["checkpoint"])
        # lora-best at each new best validation (3, 5), epoch-001 and lora.safetensors
        assert [step for step, _ in by_kind["lora"]] == [3, 5, 5, 5]
        assert [step for step, _ in by_kind["validation"]] == [3, 5]     # every 3 steps and at the end
        assert all(isinstance(r["time"], float) for r in records)


def test_a_rank_waiting_for_another_inside_a_checkpoint_save_says_so(run):
    """Only rank 1 is slow: rank 0 waits for it in the save's collectives with its status file fresh, where it
    used to fall silent (a monitor called both ranks stalled when one hung while a checkpoint was saved)."""
    _, _, waits = run
    assert {"ranks saving checkpoint step-00000002", "ranks saving checkpoint step-00000004"} & waits, waits


def test_no_step_holds_a_checkpoint(run):
    log_dir, _, _ = run
    for rank in (0, 1):
        steps = [line for line in read_history(log_dir, rank) if line.get("kind") is None]
        assert [line["step"] for line in steps] == [1, 2, 3, 4, 5]
        # Steps 3 and 5 follow a checkpoint (and 4 a validation): their time is their own.
        assert max(line["step_time_s"] for line in steps) < STEP_LIMIT_S, steps


def test_the_status_file_tallies_the_time_between_steps(run):
    log_dir, _, _ = run
    for rank in (0, 1):
        state = read_status(log_dir, rank)
        checkpoints = state["overheads"]["checkpoint"]
        assert checkpoints["count"] == 3 and checkpoints["mean_s"] >= DELAY_S and checkpoints["last_s"] >= DELAY_S
        assert checkpoints["total_s"] == pytest.approx(
            sum(r["seconds"] for r in read_overheads(log_dir, rank) if r["overhead"] == "checkpoint"), abs=0.01)
        assert state["overheads"]["lora"]["count"] == 4 and state["overheads"]["validation"]["count"] == 2
        assert state["step_time_s"] < STEP_LIMIT_S
        assert state["step_time_avg_s"] < STEP_LIMIT_S
        assert state["gpu"] is None                      # CPU ranks: no GPU fields


def test_the_terminal_shows_the_step_time_and_the_checkpoints_apart(run):
    _, log, _ = run
    assert "checkpoint at step 2 saved in " in log
    summary = [line for line in log.splitlines() if line.startswith("  time: ")]
    assert len(summary) == 1 and re.search(r" s/step \(the steps alone\), \d+\.\d\d samples/s per GPU; "
                                           r"between steps: checkpoints 3 x ", summary[0]), summary
    assert "LoRA files 4 x" in summary[0] and "validation 2 x" in summary[0]


def test_the_monitor_reports_the_time_between_steps(run):
    log_dir, _, _ = run
    result = subprocess.run([sys.executable, "-m", "diffsynth_mbc.monitor", str(log_dir), "--once", "--json"],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    summary = json.loads(result.stdout)
    assert summary["overheads"]["checkpoint"]["count"] == 3
    assert summary["overheads"]["checkpoint"]["mean_s"] >= DELAY_S
    assert all(rank["overheads"]["validation"]["count"] == 2 for rank in summary["ranks"])
