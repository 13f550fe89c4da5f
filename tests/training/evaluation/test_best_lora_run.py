"""Keep the best LoRA and stop when validation stops improving, on real 2-rank demo runs validating every 2 steps:
``lora-best.safetensors`` is the LoRA of the lowest validation (the tensors of that step's checkpoint) and the status
files name it; at a learning rate of 1e-12 ``--early_stop 2`` ends the run before its planned total on every rank, with
a checkpoint of that step, and ``--resume latest`` trains nothing more; ZeRO-2 and two nodes stop at the same step;
a SIGKILL and a resume keep the best."""

from __future__ import annotations

import psutil
import pytest
import torch
from safetensors.torch import load_file

from diffsynth_mbc.data.demo import prepare
from diffsynth_mbc.training.checkpoints.folder import complete_checkpoints
from e2e_helpers import (REPO, assert_the_monitor_reads_what_the_ranks_wrote, demo_flags, free_port, kill_tree, launch,
                         read_history, read_status, wait_for)
from forked_ranks import run_training
from multinode_helpers import finish, start_nodes

pytestmark = pytest.mark.slow
TOTAL = 12   # the demo's catalogue below: 3 steps an epoch on 2 ranks, 4 epochs
STOPS_AT = 6  # 1e-12: no change; the warm-up's validation (step 2) sets the loss, steps 4 and 6 count: 2 of 2


def flags(root, run, **more):
    return demo_flags(root / "demo", run, num_epochs=4, val_metadata_path=root / "val" / "metadata" / "metadata.csv",
                      val_base_path=root / "val" / "catalog", val_steps=2, val_samples=4, checkpoint_steps=2,
                      keep_checkpoints=10, **more)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("best")
    prepare(root / "demo", num_videos=3, num_images=2)
    prepare(root / "val", num_videos=2, num_images=2)
    outputs = {}
    for name, more in (("learning", {}), ("still", {"learning_rate": 1e-12, "early_stop": 2})):
        result = run_training(root, flags(root, root / name, **more), timeout=400, OMP_NUM_THREADS=1)
        assert result.returncode == 0, result.stderr[-3000:]
        outputs[name] = result.stdout + result.stderr
    return root, outputs


def validations(log_dir):
    return [line for line in read_history(log_dir, 0) if line.get("kind") == "val"]


def assert_same_tensors(path_a, path_b):
    a, b = load_file(str(path_a)), load_file(str(path_b))
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key


def test_lora_best_is_the_lowest_validations_lora_and_every_rank_names_it(runs):
    root, outputs = runs
    run = root / "learning"
    records = validations(run / "logs")
    assert [record["step"] for record in records] == list(range(2, TOTAL + 1, 2))
    lowest = min(records, key=lambda record: (record["val_loss"], record["step"]))
    assert_same_tensors(run / "lora" / "lora-best.safetensors",
                        run / "lora" / "checkpoints" / f"step-{lowest['step']:08d}" / "lora.safetensors")
    so_far = float("inf")
    for record in records:   # the history marks each new best, and only those
        assert record.get("new_best", False) == (record["val_loss"] < so_far), record["step"]
        so_far = min(so_far, record["val_loss"])
    for rank in (0, 1):
        best = read_status(run / "logs", rank)["best"]
        assert best["step"] == lowest["step"] and best["val_loss"] == lowest["val_loss"]
        assert best["file"] == str(run / "lora" / "lora-best.safetensors")
        assert best["gain"] == pytest.approx((best["val_loss_base"] - best["val_loss"]) / best["val_loss_base"])
    assert f"validation at step {records[0]['step']}: val_loss" in outputs["learning"]
    assert ", new best" in outputs["learning"]
    assert f"best LoRA: {run / 'lora' / 'lora-best.safetensors'} (step {lowest['step']}" in outputs["learning"]


def test_early_stop_ends_every_rank_before_the_total_with_a_checkpoint(runs):
    root, outputs = runs
    run = root / "still"
    for rank in (0, 1):
        state = read_status(run / "logs", rank)
        assert state["status"] == "finished" and state["step"] == STOPS_AT and state["total_steps"] == TOTAL
        assert state["early_stop"] == {"step": STOPS_AT, "best_step": 2, "validations_without_improvement": 2,
                                       "since_step": 2, "patience": 2, "min_delta": 0.001}
    assert max(line["step"] for line in read_history(run / "logs", 0) if "step" in line) == STOPS_AT
    assert complete_checkpoints(run / "lora" / "checkpoints")[-1][0] == STOPS_AT
    last = outputs["still"].rstrip().splitlines()[-1]
    assert last == (f"stopped early at step {STOPS_AT} of {TOTAL}: no better validation in 2 evaluations since step 2; "
                    f"best: {run / 'lora' / 'lora-best.safetensors'} (step 2)")


def test_a_resume_of_an_early_stopped_run_trains_nothing_and_says_how_to_go_on(runs):
    root, _ = runs
    run = root / "still"
    resumed = run_training(root, flags(root, run, learning_rate=1e-12, early_stop=2, resume="latest"), timeout=400,
                           OMP_NUM_THREADS=1)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    said = resumed.stdout + resumed.stderr
    assert f"this run stopped early at step {STOPS_AT}: no better validation in 2 evaluations since step 2" in said
    assert "To go on: a larger --early_stop N, or --early_stop off" in said
    state = read_status(run / "logs", 0)
    assert state["status"] == "finished" and state["step"] == STOPS_AT and state["early_stop"]["step"] == STOPS_AT
    assert max(line["step"] for line in read_history(run / "logs", 0) if "step" in line) == STOPS_AT


def test_zero2_stops_both_ranks_at_the_same_step(runs, tmp_path):
    root, _ = runs
    result = run_training(root, flags(root, tmp_path, learning_rate=1e-12, early_stop=2), timeout=540,
                          OMP_NUM_THREADS=1, config_file=str(REPO / "configs" / "accelerate" / "deepspeed_zero2.yaml"))
    assert result.returncode == 0, result.stderr[-3000:]
    assert [read_status(tmp_path / "logs", rank)["early_stop"]["step"] for rank in (0, 1)] == [STOPS_AT, STOPS_AT]


def test_two_nodes_stop_at_the_same_step(runs, tmp_path):
    root, _ = runs
    val = root / "val"
    nodes = start_nodes(tmp_path, free_port(), "--val_metadata_path", str(val / "metadata" / "metadata.csv"),
                        "--val_base_path", str(val / "catalog"), "--val_steps", "2", "--val_samples", "4",
                        "--learning_rate", "1e-12", "--early_stop", "2", "--num_epochs", "4")
    finish(nodes)
    logs = tmp_path / "runs" / "demo" / "training_logs"
    states = [read_status(logs, rank) for rank in (0, 1)]
    assert [state["early_stop"]["step"] for state in states] == [STOPS_AT, STOPS_AT]
    assert states[0]["step"] < states[0]["total_steps"]


def test_a_sigkill_and_a_resume_keep_the_best(runs, tmp_path):
    root, _ = runs
    killed = tmp_path / "killed"
    process = launch(root, flags(root, killed))

    def logged():
        try:
            return max(line["step"] for line in read_history(killed / "logs", 0) if line.get("kind") is None)
        except (FileNotFoundError, ValueError):
            return 0

    checkpoints = killed / "lora" / "checkpoints"
    wait_for(lambda: (killed / "lora" / "lora-best.safetensors").is_file() and len(complete_checkpoints(checkpoints))
             >= 2 and logged() >= 7, process, what="a best LoRA, two checkpoints and step 7")
    assert logged() < TOTAL, "the kill must come before the end"
    rank_pids = [read_status(killed / "logs", rank)["pid"] for rank in (0, 1)]
    kill_tree(process.pid)
    process.wait(timeout=30)
    psutil.wait_procs([psutil.Process(pid) for pid in rank_pids if psutil.pid_exists(pid)], timeout=30)
    resumed = run_training(root, flags(root, killed, resume="latest"), timeout=400, OMP_NUM_THREADS=1)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    straight = root / "learning"
    assert_same_tensors(killed / "lora" / "lora-best.safetensors", straight / "lora" / "lora-best.safetensors")
    best = read_status(killed / "logs", 0)["best"]
    expected = read_status(straight / "logs", 0)["best"]
    assert (best["step"], best["val_loss"]) == (expected["step"], expected["val_loss"])


def test_every_status_field_the_runs_wrote_is_declared_and_read_back_as_written(runs):
    root, _ = runs
    assert {"best", "new_best", "val_loss_base"} <= set(assert_the_monitor_reads_what_the_ranks_wrote(root / "learning"
                                                                                                    / "logs"))
    assert assert_the_monitor_reads_what_the_ranks_wrote(root / "still" / "logs")["early_stop"]["patience"] == 2
