"""Keep the best LoRA and stop when validation stops improving, on real 2-rank demo runs validating every 2 steps:
``lora-best.safetensors`` is the LoRA of the lowest validation (the tensors of that step's checkpoint) and the status
files name it; at a learning rate of 1e-12 ``--early_stop 2`` ends the run before its planned total on every rank, with
a checkpoint of that step, and ``--resume latest`` trains nothing more; ZeRO-2 and two nodes stop at the same step;
a SIGKILL and a resume keep the best; at a learning rate of 1e30 no validation is finite: none is the best, no
lora-best is written and the failed run's message says so; in resolution stages the early stop counts in the final
stage only, and the best LoRA says the stage that trained it."""

from __future__ import annotations

import re
import shutil

import psutil
import pytest
import torch
from safetensors.torch import load_file

from diffsynth_mbc.data.demo import prepare
from diffsynth_mbc.training.checkpoints.folder import complete_checkpoints
from diffsynth_mbc.training.lora.read import file_metadata_of
from e2e_helpers import (REPO, assert_the_monitor_reads_what_the_ranks_wrote, demo_flags, free_port, kill_tree, launch,
                         read_history, read_status, wait_for)
from forked_ranks import run_training
from multinode_helpers import finish, start_nodes

pytestmark = pytest.mark.slow
TOTAL = 12   # the demo's catalogue below: 3 steps an epoch on 2 ranks, 4 epochs
STOPS_AT = 6  # 1e-12: no change; the warm-up's validation (step 2) sets the loss, steps 4 and 6 count: 2 of 2
# In stages (64x64 for steps 1-6, then 96x96 for 7-12), validating every step at 1e-12: the count starts from step 7's
# validation, step 8's ends the run (it ended at step 3, in stage 1, when stage 1's validations counted)
STAGED = {"learning_rate": 1e-12, "early_stop": 1, "val_steps": 1, "val_samples": 2, "height": 96, "width": 96,
          "resolution_stages": "64x64:0.5"}


def flags(root, run, **more):
    return demo_flags(root / "demo", run, **{"num_epochs": 4, "val_metadata_path": root / "val" / "metadata" /
                                             "metadata.csv", "val_base_path": root / "val" / "catalog", "val_steps": 2,
                                             "val_samples": 4, "checkpoint_steps": 2, "keep_checkpoints": 10, **more})


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("best")
    prepare(root / "demo", num_videos=3, num_images=2)
    prepare(root / "val", num_videos=2, num_images=2)
    outputs = {}
    for name, more, code in (("learning", {}, 0), ("still", {"learning_rate": 1e-12, "early_stop": 2}, 0),
                             ("exploding", {"learning_rate": 1e30, "num_epochs": 1}, 1), ("staged", STAGED, 0)):
        result = run_training(root, flags(root, root / name, **more), timeout=400, OMP_NUM_THREADS=1)
        assert result.returncode == code, result.stderr[-3000:]
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


def test_a_validation_that_is_not_finite_is_never_the_best_and_the_failure_says_so(runs):
    root, outputs = runs
    run = root / "exploding"
    records = validations(run / "logs")
    assert [record["step"] for record in records] == [2, 3] and not any(record.get("new_best") for record in records)
    assert not (run / "lora" / "lora-best.safetensors").exists()
    said = outputs["exploding"]
    assert "validation at step 2: val_loss nan" in said and ", new best" not in said
    assert "not finite: never the best LoRA (no lora-best.safetensors yet)" in said
    for rank in (0, 1):
        state = read_status(run / "logs", rank)
        assert state["status"] == "failed" and state["best"] is None and state["new_best"] is False
        assert state["error"]["message"].startswith("the run ended with a broken LoRA")
        assert state["error"]["message"].endswith(
            "Best LoRA: no lora-best.safetensors was written: no validation of this run had a finite val_loss")


def test_early_stop_ends_every_rank_before_the_total_with_a_checkpoint(runs):
    root, outputs = runs
    run = root / "still"
    for rank in (0, 1):
        state = read_status(run / "logs", rank)
        assert state["status"] == "finished" and state["step"] == STOPS_AT and state["total_steps"] == TOTAL
        first = validations(run / "logs")[0]["val_loss"]
        assert state["early_stop"] == {"step": STOPS_AT, "best_step": 2, "validations_without_improvement": 2,
                                       "since_step": 2, "since_val_loss": first, "patience": 2, "min_delta": 0.001}
    assert max(line["step"] for line in read_history(run / "logs", 0) if "step" in line) == STOPS_AT
    assert complete_checkpoints(run / "lora" / "checkpoints")[-1][0] == STOPS_AT
    last = outputs["still"].rstrip().splitlines()[-1]
    assert last == (f"stopped early at step {STOPS_AT} of {TOTAL}: 2 validations in a row since step 2 (val_loss "
                    f"{first:.4f}) without the 0.10% improvement that resets the count (--early_stop 2); best: "
                    f"{run / 'lora' / 'lora-best.safetensors'} (step 2)")


def test_an_early_stop_at_the_end_of_an_epoch_writes_that_epochs_file_and_the_counts_agree(runs):
    root, outputs = runs
    run = root / "still"   # 3 steps an epoch: step 6 ends epoch 2
    lora = run / "lora"
    assert sorted(path.name for path in lora.glob("epoch-*.safetensors")) == ["epoch-001.safetensors",
                                                                               "epoch-002.safetensors"]
    assert_same_tensors(lora / "epoch-002.safetensors", lora / "lora.safetensors")
    assert file_metadata_of(lora / "epoch-002.safetensors")["step"] == str(STOPS_AT)
    for rank in (0, 1):
        state = read_status(run / "logs", rank)
        assert (state["epoch"], state["num_epochs"], state["step"]) == (1, 4, STOPS_AT)   # epoch 2 (from 0: 1)
    said = outputs["still"]
    assert "epoch 2/4 done" in said and "epoch 3/4" not in said
    assert f"also in {lora}: 2 epoch file(s) (epoch-001 .. epoch-002)" in said


def test_in_stages_the_early_stop_counts_in_the_final_stage_only_and_the_best_says_its_stage(runs):
    root, outputs = runs
    run = root / "staged"
    stage_1 = {"stage": 1, "of": 2, "size": "64x64x9", "final": False}
    for rank in (0, 1):
        state = read_status(run / "logs", rank)
        assert state["stages"][1]["from_step"] == 7 and state["total_steps"] == TOTAL
        assert state["early_stop"]["step"] == 8 and state["early_stop"]["since_step"] == 7
        assert state["best"]["step"] == 1 and state["best"]["stage"] == stage_1
    trained = [record for record in read_history(run / "logs", 0) if record.get("kind") is None and "step" in record]
    assert [record["step"] for record in trained] == list(range(1, 9))   # steps 7 and 8 at the final size
    said = outputs["staged"]
    lines = [line for line in said.splitlines() if line.startswith("validation at step")]
    assert all("early stop: before the final stage, not counted (the count runs from step 7)" in line
               for line in lines[:6])
    assert "early stop: the count starts from this one: 0 of 1" in lines[6]
    best = run / "lora" / "lora-best.safetensors"
    assert f"  best LoRA: {best} (step 1, val_loss " in said
    assert said.rstrip().endswith(f"; best: {best} (step 1, stage 1/2 64x64x9, not the final size)")


def test_each_validation_line_says_where_the_early_stop_count_stands(runs):
    root, outputs = runs
    lines = [line for line in outputs["still"].splitlines() if line.startswith("validation at step")]
    assert len(lines) == 3
    assert "early stop: in the warm-up, not counted (the count runs from step 3)" in lines[0]   # --warmup_steps 2
    assert re.search(r"validation at step 4: .*; early stop: .*: 1 of 2(;|$)", lines[1]), lines[1]
    assert re.search(r"validation at step 6: .*; early stop: .*: 2 of 2, the run stops here(;|$)", lines[2]), lines[2]
    standing = read_status(root / "still" / "logs", 0)["early_stop_count"]
    assert (standing["step"], standing["count"], standing["patience"], standing["since_step"]) == (6, 2, 2, 2)
    learning = read_status(root / "learning" / "logs", 0)
    assert learning["early_stop_count"] is None and "early stop:" not in outputs["learning"]   # off: nothing said


def files_of(run) -> dict:
    """Every file under ``run``: its bytes and modification time (a file written again with the same bytes counts)."""
    return {path: (path.read_bytes(), path.stat().st_mtime_ns) for path in sorted(run.rglob("*")) if path.is_file()}


def test_a_resume_of_an_early_stopped_run_trains_nothing_writes_nothing_and_says_how_to_go_on(runs):
    root, _ = runs
    run = root / "still"
    before = files_of(run)
    resumed = run_training(root, flags(root, run, learning_rate=1e-12, early_stop=2, resume="latest"), timeout=400,
                           OMP_NUM_THREADS=1)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    after = files_of(run)
    assert [path for path in before if after.get(path) != before[path]] == []   # status, history, LoRA files: as left
    assert after.keys() == before.keys()
    said = resumed.stdout + resumed.stderr
    assert (f"this run stopped early at step {STOPS_AT}: 2 validations in a row since step 2 (val_loss "
            f"{validations(run / 'logs')[0]['val_loss']:.4f}) without the 0.10% improvement that resets the count "
            "(--early_stop 2); nothing more to train") in said
    assert "To go on: a larger --early_stop N, or --early_stop off; nothing was written" in said


def test_a_resume_of_a_finished_run_trains_nothing_and_writes_nothing(runs):
    root, _ = runs
    run = root / "learning"   # a checkpoint at its last step (--checkpoint_steps 2)
    before = files_of(run)
    resumed = run_training(root, flags(root, run, resume="latest"), timeout=400, OMP_NUM_THREADS=1)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    after = files_of(run)
    assert [path for path in before if after.get(path) != before[path]] == [] and after.keys() == before.keys()
    assert (f"this run finished at step {TOTAL} (4 of 4 epochs): nothing more to train; nothing was written (its "
            f"files are as it left them). To train on from its LoRA: a new run with --init_lora "
            f"{run / 'lora' / 'lora.safetensors'}") in resumed.stdout + resumed.stderr


def test_a_resume_of_an_early_stopped_run_that_had_not_written_its_lora_writes_it(runs, tmp_path):
    root, _ = runs
    run = tmp_path / "cut"   # the early-stopped run as a kill before its lora.safetensors leaves it
    shutil.copytree(root / "still", run)
    (run / "lora" / "lora.safetensors").unlink()
    resumed = run_training(root, flags(root, run, learning_rate=1e-12, early_stop=2, resume="latest"), timeout=400,
                           OMP_NUM_THREADS=1)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"this run stopped early at step {STOPS_AT}" in resumed.stdout + resumed.stderr
    assert_same_tensors(run / "lora" / "lora.safetensors", root / "still" / "lora" / "lora.safetensors")
    for rank in (0, 1):
        state = read_status(run / "logs", rank)
        assert (state["status"], state["step"], state["epoch"]) == ("finished", STOPS_AT, 1)   # epoch 2 of 4, as run
        assert state["early_stop"]["step"] == STOPS_AT
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
