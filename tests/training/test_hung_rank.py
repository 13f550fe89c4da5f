"""A hung rank told from a healthy one, on a real 2-rank run (gloo): rank 1 is stopped with SIGSTOP; only it
goes stale and is called stalled, while rank 0, blocked in a collective, keeps its file fresh and says what it
waits for. SIGCONT lets the run go on."""

import os
import signal
import subprocess

import pytest

from diffsynth_mbc.data.demo import prepare
from diffsynth_mbc.monitor.state import MonitorState
from e2e_helpers import REPO, cpu_launch_command, isolated_env, kill_tree, read_status, wait_for

pytestmark = pytest.mark.slow
STALL_AFTER_S = 20.0   # well above a heartbeat starved for seconds on a loaded 2-core machine
POLL_S = 0.2           # how often the monitor is asked: each answer reads both ranks' files


def status_or_none(log_dir, rank):
    try:
        return read_status(log_dir, rank)
    except (OSError, ValueError):
        return None


def test_a_stopped_rank_is_the_only_stalled_one_and_the_other_names_its_wait(tmp_path):
    data = tmp_path / "data"
    prepare(data, num_videos=6, num_images=5)
    log_dir = tmp_path / "run" / "logs"
    flags = {"config": REPO / "configs" / "train_demo.yaml", "dataset_base_path": data / "catalog",
             "dataset_metadata_path": data / "metadata" / "metadata.csv", "output_path": tmp_path / "run" / "lora",
             "log_dir": log_dir, "num_epochs": 200, "checkpoint_steps": 100000, "status_interval_s": 1}
    # Started by accelerate launch itself (torchrun's agent and sessions): a stopped rank as users will meet it.
    command = cpu_launch_command(*[item for key, value in flags.items() for item in (f"--{key}", str(value))])
    run = subprocess.Popen(command, cwd=tmp_path, env=isolated_env(tmp_path, OMP_NUM_THREADS=1),
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    stopped_pid = None
    try:
        wait_for(lambda: all((status_or_none(log_dir, r) or {}).get("step", 0) >= 3 for r in (0, 1)), run, 240,
                 "both ranks to train", every=POLL_S)
        stopped_pid = read_status(log_dir, 1)["pid"]            # the rank's pid, from its own status file
        os.kill(stopped_pid, signal.SIGSTOP)
        monitor = MonitorState(log_dir, stall_after=STALL_AFTER_S, backfill=False)
        wait_for(lambda: monitor.refresh()["stalled_ranks"], run, 180, "the monitor to see a stalled rank",
                 every=POLL_S)

        last = {}

        def rank_1_alone_stalled_while_rank_0_waits():
            snap = last["snap"] = monitor.refresh()
            waiting = {r["rank"]: r["waiting_text"] for r in snap["ranks"]}
            return snap if snap["stalled_ranks"] == [1] and (waiting.get(0) or "").startswith("waiting for") else None

        # On a loaded machine one snapshot may catch rank 0 between two heartbeats; a healthy run shows this state
        # within a few of them, a run whose waiting rank wrote nothing never does.
        snap = wait_for(rank_1_alone_stalled_while_rank_0_waits, run, 120, "rank 1 alone stalled, rank 0 waiting",
                        seen=lambda: (last["snap"]["stalled_ranks"], [(r["rank"], r.get("phase"), r.get("age_s"),
                                      r["waiting_text"], r.get("step")) for r in last["snap"]["ranks"]]), every=POLL_S)
        ranks = {r["rank"]: r for r in snap["ranks"]}
        assert snap["status"] == "stalled" and snap["stalled_ranks"] == [1], (snap["notes"], {r: (v.get("phase"), v.get("age_s"), v.get("waiting_text"), v.get("step")) for r, v in ranks.items()})
        assert not ranks[0]["stalled"] and ranks[0]["age_s"] < STALL_AFTER_S
        assert ranks[0]["waiting_text"].startswith("waiting for ranks "), ranks[0]
        assert ranks[1]["waiting_text"] is None
        assert any(note.startswith("rank 1 silent (stalled) while rank 0 is waiting for") for note in snap["notes"])

        os.kill(stopped_pid, signal.SIGCONT)
        stopped_pid = None
        wait_for(lambda: (lambda s: s["status"] == "training" and not s["stalled_ranks"]
                          and all(r["waiting_text"] is None for r in s["ranks"]))(monitor.refresh()),
                 run, 180, "the run to go on after SIGCONT", every=POLL_S)
    finally:
        if stopped_pid is not None:
            os.kill(stopped_pid, signal.SIGCONT)
        kill_tree(run.pid)
        run.communicate(timeout=60)
