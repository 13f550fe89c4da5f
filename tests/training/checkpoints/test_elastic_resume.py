"""A checkpoint made on N processes resumes on M (training/plan/elastic.py): 2 CPU ranks killed mid-epoch go on
on 1 and on 3, 1 rank on 2. Each epoch's rows are trained exactly once over all ranks (from the step records), the
run ends at the recomputed total, the learning rate goes on by samples seen, the optimizer state carries over, the
ranks a run no longer has are closed at the checkpoint, and the monitor shows the run on its new ranks. The 2-rank
run trains from a latent cache built on 2 ranks (item 5); the 1-rank one from the media, in bf16, resumed in fp32.

12 clips, batch 1, no accumulation, 2 epochs: nothing is padded on 1, 2 or 3 ranks, so every row is trained once an
epoch, not "at least once"."""

from __future__ import annotations

import shutil
from collections import Counter

import psutil
import pytest
import torch

from catalog_helpers import clip, write_media_catalogue
from diffsynth_mbc.monitor.state import MonitorState
from diffsynth_mbc.run_layout import checkpoint_folder_name
from diffsynth_mbc.training.checkpoints.folder import complete_checkpoints
from diffsynth_mbc.training.plan.step_plan import lr_factor
from e2e_helpers import (assert_the_monitor_reads_what_the_ranks_wrote, demo_flags, kill_tree, read_history,
                         read_status, wait_for)
from forked_ranks import CACHE_BUILD, run_training, start_training

pytestmark = pytest.mark.slow
ROWS = 12
LEARNING_RATE = 1e-3   # the demo preset's, with 2 warm-up steps and the cosine schedule
STAGES = "32x32:0.5"   # the 1-rank run: half its steps at 32x32, then the demo's 64x64


def flags(root, run_dir, *extra, **overrides) -> list[str]:
    return [*demo_flags(root, run_dir, **{"dataset_repeat": 1, "gradient_accumulation_steps": 1,
                                          "checkpoint_steps": 3, "keep_checkpoints": 10, **overrides}), *extra]


def steps_logged(log_dir, rank=0) -> list[int]:
    try:
        return [line["step"] for line in read_history(log_dir, rank) if "loss" in line]
    except (FileNotFoundError, ValueError):
        return []


def killed_after_checkpoint(work, name, run_flags, world_size, step):
    """A run of ``world_size`` ranks killed (SIGKILL, as a lost node) once its checkpoint at ``step`` is complete
    and a later step is logged: mid-epoch, between checkpoints."""
    run_dir = work / name
    process = start_training(work, run_flags, world_size=world_size, combined=True, OMP_NUM_THREADS=1)
    wait_for(lambda: step in [saved for saved, _ in complete_checkpoints(run_dir / "lora" / "checkpoints")]
             and max(steps_logged(run_dir / "logs"), default=0) > step, process, timeout=300,
             what=f"the checkpoint at step {step} and a step after it")
    pids = [read_status(run_dir / "logs", rank)["pid"] for rank in range(world_size)]
    kill_tree(process.pid)
    process.wait(timeout=30)
    psutil.wait_procs([psutil.Process(pid) for pid in pids if psutil.pid_exists(pid)], timeout=30)
    return run_dir


def resumed_on(work, killed, name, world_size, step, run_flags):
    """The killed run's folder copied to ``name`` (as if it had been there), resumed from its checkpoint at
    ``step`` on ``world_size`` ranks; returns (the run folder, the terminal's output)."""
    run_dir = work / name
    shutil.copytree(killed, run_dir)
    resume = run_dir / "lora" / "checkpoints" / checkpoint_folder_name(step)
    result = run_training(work, [*run_flags(run_dir), "--resume", str(resume)], world_size=world_size,
                          timeout=300, OMP_NUM_THREADS=1)
    assert result.returncode == 0, result.stderr[-4000:]
    return run_dir, result.stderr


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    work = tmp_path_factory.mktemp("elastic")
    root = work / "data"
    write_media_catalogue(root, [clip(f"clips/{index:02d}.mp4", seed=index, caption=f"clip {index}")
                                 for index in range(ROWS)])
    cache = work / "cache"   # built by 2 ranks
    built = run_training(work, ["--demo", "--seed", "42", "--dataset_base_path", str(root / "catalog"),
                                "--dataset_metadata_path", str(root / "metadata" / "metadata.csv"), "--height", "64",
                                "--width", "64", "--num_frames", "9", "--cache_dir", str(cache),
                                "--dataset_num_workers", "0", "--dtype", "fp32", "--log_dir", str(work / "cache-logs")],
                         world_size=2, timeout=300, entry=CACHE_BUILD, ACCELERATE_USE_CPU=1, OMP_NUM_THREADS=1)
    assert built.returncode == 0, built.stderr[-4000:]

    def cached(run_dir):
        return flags(root, run_dir, "--cache", str(cache))

    two = killed_after_checkpoint(work, "two", cached(work / "two"), 2, 3)

    def in_fp32(run_dir):
        return flags(root, run_dir, checkpoint_steps=4, resolution_stages=STAGES)

    one = killed_after_checkpoint(work, "one", flags(root, work / "one", checkpoint_steps=4, mixed_precision="bf16",
                                                     resolution_stages=STAGES), 1, 4)
    return {"killed": two, "killed flags": cached(two),
            "2->1": resumed_on(work, two, "two-on-one", 1, 3, cached),
            "2->3": resumed_on(work, two, "two-on-three", 3, 3, cached),
            "1->2": resumed_on(work, one, "one-on-two", 2, 4, in_fp32)}


# scenario: (ranks now, ranks before, checkpoint step, the recomputed end: the checkpoint, the rest of its epoch
# over the ranks now, the second epoch at their length)
SCENARIOS = {"2->1": (1, 2, 3, 3 + 6 + 12), "2->3": (3, 2, 3, 3 + 2 + 4), "1->2": (2, 1, 4, 4 + 4 + 6)}


def step_records(log_dir, ranks) -> list[dict]:
    return [line for rank in ranks for line in read_history(log_dir, rank) if "loss" in line]


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_each_epoch_trains_every_row_exactly_once_over_all_ranks_and_ends_at_the_recomputed_total(runs, scenario):
    now, before, checkpoint, end = SCENARIOS[scenario]
    run_dir, _ = runs[scenario]
    logs = run_dir / "logs"
    records = step_records(logs, range(max(now, before)))
    for epoch in (0, 1):
        rows = Counter(row for line in records if line["epoch"] == epoch for row in line["rows"])
        assert rows == Counter(range(ROWS)), f"epoch {epoch + 1}"
    for rank in range(now):   # every step once, on every rank the run has now (a new one from the checkpoint on)
        assert steps_logged(logs, rank) == list(range(1 if rank < before else checkpoint + 1, end + 1))
        state = read_status(logs, rank)
        assert (state["status"], state["step"], state["total_steps"], state["world_size"]) == (
            "finished", end, end, now)
    for rank in range(now, before):   # gone: its records end at the checkpoint, its status file says so
        assert max(steps_logged(logs, rank)) == checkpoint
        state = read_status(logs, rank)
        assert (state["status"], state["step"]) == ("retired", checkpoint)
        assert state["phase"] == f"retired at step {checkpoint}: the run went on from there on {now} GPU" + (
            "s" if now > 1 else "")
    assert_the_monitor_reads_what_the_ranks_wrote(logs, range(now))


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_the_resume_says_what_changed_once_and_the_monitor_shows_the_run_on_its_new_ranks(runs, scenario):
    now, before, checkpoint, end = SCENARIOS[scenario]
    run_dir, output = runs[scenario]
    gpus = f"{now} GPU{'s' if now > 1 else ''}"
    left_before = {"2->1": 3, "2->3": 3, "1->2": 8}[scenario]
    left_now = {"2->1": 6, "2->3": 2, "1->2": 4}[scenario]
    said = (f"resumed on {gpus} from a {before}-GPU checkpoint: {left_now} steps left in epoch 1, was {left_before} "
            f"per GPU; the later epochs take {ROWS // now} steps each (were {ROWS // before}); from step {checkpoint} "
            f"the run ends at step {end}; the learning-rate schedule goes on by samples seen")
    assert output.count(said) == 1, output[-3000:]
    assert output.count(f"world_size: checkpoint {before}, this run {now}") == 1
    assert read_status(run_dir / "logs", 0)["resumed_elsewhere"] == {
        "step": checkpoint, "from_world_size": before, "world_size": now, "end_step": end, "said": said}
    snapshot = MonitorState(run_dir / "logs").refresh()
    assert (snapshot["status"], snapshot["world_size"], [rank["rank"] for rank in snapshot["ranks"]]) == (
        "finished", now, list(range(now)))
    retired = list(range(now, before))
    note = f"resumed on {gpus} at step {checkpoint} (from {before})" + (
        f"; rank {retired[0]} retired there (records up to that step)" if retired else "")
    assert [line for line in snapshot["notes"] if "resumed on" in line or "outside world_size" in line] == [note]
    assert snapshot["step"] == snapshot["total_steps"] == end


def test_the_learning_rate_goes_on_by_samples_seen_and_the_optimizer_state_carries_over(runs):
    """2 -> 1 at step 3: each step after it trains half a step of the checkpoint's plan (12 steps), so the schedule's
    9 steps left spread over 18; the step after the checkpoint takes the rate the killed run took there."""
    run_dir, _ = runs["2->1"]
    rates = {line["step"]: line["lr"] for line in read_history(run_dir / "logs", 0) if "loss" in line}
    killed = {line["step"]: line["lr"] for line in read_history(runs["killed"] / "logs", 0) if "loss" in line}
    assert rates[4] == pytest.approx(killed[4], rel=1e-6)
    for step in range(4, 22):
        schedule_step = 3 + (step - 1 - 3) * 9 / 18
        assert rates[step] == pytest.approx(LEARNING_RATE * lr_factor(schedule_step, 12, 2, "cosine"), rel=1e-5)
    # AdamW's count of steps taken goes on from the checkpoint's (a fresh optimizer would count 18)
    optimizer = torch.load(run_dir / "lora" / "checkpoints" / checkpoint_folder_name(21) / "optimizer.bin",
                           weights_only=False)
    assert {int(state["step"]) for state in optimizer["state"].values()} == {21}


def test_a_precision_change_is_said_and_the_run_goes_on(runs):
    """The 1-rank run trained in bf16; its resume on 2 in fp32 (the CPU's auto) says so and trains on from it. (On a
    GPU fp16 <-> bf16 is the same path: the LoRA and AdamW state are fp32 under every precision; a checkpoint without
    a loss scaler gives an fp16 run a fresh one, test_saving.py.)"""
    run_dir, output = runs["1->2"]
    assert output.count("mixed_precision: checkpoint 'bf16', this run 'no'") == 1
    assert read_status(run_dir / "logs", 0)["mixed_precision"] == "no"


def test_the_resolution_stages_go_on_by_samples_seen(runs):
    """1 -> 2 at step 4: the first stage was half the checkpoint's plan (12 of 24 steps); from step 4 the schedule's
    20 steps left spread over 10, so the first stage ends after step 8 (4 + 8 x 10 / 20), not after half of this
    plan's 12 steps."""
    run_dir, output = runs["1->2"]
    logs = run_dir / "logs"
    assert [(row["from_step"], row["to_step"]) for row in read_status(logs, 0)["stages"]] == [(1, 8), (9, 14)]
    for line in step_records(logs, (0, 1)):
        size = 32 if line["step"] <= 8 else 64
        assert line["shapes"] == [[9, size, size]] * len(line["rows"]), line["step"]
    assert output.count("stage 1/2 from step 1: 32x32x9") == 1   # said at the resume
    assert output.count("stage 2/2 from step 9: 64x64x9 (the final size)") == 1


def test_the_launchers_plan_says_what_a_resume_on_other_gpus_does(runs, capsys):
    from diffsynth_mbc.training.plan import command

    checkpoint = runs["killed"] / "lora" / "checkpoints" / checkpoint_folder_name(3)
    capsys.readouterr()
    assert command.main([*runs["killed flags"], "--gpus", "1", "--resume", str(checkpoint)]) == 0
    assert ("resume on 1 GPU from a 2-GPU checkpoint (step-00000003, step 3): the rest of its epoch is shared out "
            "over 1, every sample of it once, and the steps are counted again") in capsys.readouterr().err
    assert command.main([*runs["killed flags"], "--gpus", "2", "--resume", str(checkpoint)]) == 0
    assert "from a 2-GPU checkpoint" not in capsys.readouterr().err
