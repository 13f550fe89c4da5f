"""launchers/train.sbatch on a real SLURM cluster of two nodes on this machine (tests/slurm_cluster.py): the demo
trains to its end; warned before its time limit (`scancel --signal=USR1 --batch`, what `--signal=B:USR1@N` sends) the
job checkpoints, requeues itself and goes on by itself to the LoRA of the same training never interrupted (its ranks
started as the job's launcher starts them, tests/forked_ranks.py), every step once, one run id, one run in the monitor
with a gap; `scancel` (SIGTERM) of a two-node job leaves a complete checkpoint and `preempted` on every rank. The two
jobs run at once, read by the tests below."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from collections import Counter

import pytest
import torch
from safetensors.torch import load_file

from diffsynth_mbc.data.demo import prepare
from diffsynth_mbc.training.checkpoints.folder import complete_checkpoints
from diffsynth_mbc.training.plan.batches import epoch_batches
from e2e_helpers import REPO, free_port, isolated_env, read_history, read_status
from forked_ranks import start_training
from slurm_cluster import needs_slurm, start_cluster

SCRIPT = str(REPO / "launchers" / "train.sbatch")
# No GPUs here (the header asks for 2 per node), the nodes shared by the jobs (the header asks for whole ones).
CLUSTER_OPTIONS = ("--gpus-per-node=0", "--exclusive=user")
FLAGS = ("--demo", "--skip_doctor", "--num_epochs", "4")   # 24 steps on 2 ranks (configs/train_demo.yaml)
STEPS = list(range(1, 25))
DEMO_KEYS, DEMO_REPEAT, DEMO_SEED = ["video"] * 6 + ["image"] * 5, 3, 42   # the demo catalogue's rows, the preset's
RUN_ID = re.compile(r"\brun-\d{8}-\d{6}-[0-9a-f]+\b")


def monitor(log_dir) -> tuple[int, dict]:
    result = subprocess.run([sys.executable, "-m", "diffsynth_mbc.monitor", str(log_dir), "--json"],
                            capture_output=True, text=True, timeout=60)
    return result.returncode, json.loads(result.stdout)


def training_at(log_dir, step: int):
    def reached() -> bool:
        try:
            return all(read_status(log_dir, rank)["status"] == "training" and read_status(log_dir, rank)["step"] >= step
                       for rank in (0, 1))
        except (FileNotFoundError, ValueError, KeyError):
            return False
    return reached


def wait_until(condition, timeout: float, what: str, output=None) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}" + (
            f": {output.read_text()[-3000:]}" if output is not None and output.exists() else "")
        time.sleep(0.2)


@pytest.fixture(scope="module")
def jobs(tmp_path_factory):
    cluster = start_cluster(nodes=2)
    try:
        works = {name: tmp_path_factory.mktemp(name) for name in ("warned", "cancelled", "uninterrupted")}
        # The same training never interrupted: the demo's catalogue where the launcher writes it, the flags it gives
        # the ranks (the rest is the preset's), 2 ranks. Started first: the first forked run of a test session waits
        # for the process its ranks are forked from to start (most of a minute on a busy machine), and the jobs must
        # be watched from their start (the warned job had ended, never warned, by the time the watch began).
        prepare(works["uninterrupted"] / "runs" / "demo")
        uninterrupted = start_training(works["uninterrupted"], ["--config", REPO / "configs" / "train_demo.yaml",
                                                                *FLAGS[2:]], OMP_NUM_THREADS=1)
        ids = {"warned": cluster.submit(works["warned"], SCRIPT, *FLAGS, options=CLUSTER_OPTIONS,
                                        env=isolated_env(works["warned"], OMP_NUM_THREADS=1)),
               "cancelled": cluster.submit(works["cancelled"], SCRIPT, *FLAGS, "--dataset_num_workers", "1",
                                           options=(*CLUSTER_OPTIONS, "--nodes=2"),
                                           env=isolated_env(works["cancelled"], OMP_NUM_THREADS=1,
                                                            MASTER_PORT=free_port()))}
        logs = {name: work / "runs" / "demo" / "training_logs" for name, work in works.items()}
        outputs = {name: works[name] / f"slurm-mbc-train-{ids[name]}.out" for name in ids}
        seen = {}

        # The warning before the time limit, as SLURM sends it: to the batch script alone.
        wait_until(training_at(logs["warned"], 3), 240, "the warned job at step 3", outputs["warned"])
        cluster.run("scancel", "--signal=USR1", "--batch", ids["warned"])
        # The user's scancel: SIGTERM to every process of the job, on both nodes.
        wait_until(training_at(logs["cancelled"], 3), 240, "the cancelled job at step 3", outputs["cancelled"])
        cluster.run("scancel", ids["cancelled"])

        # Requeued, the job waits: SLURM holds a requeued job two minutes before it may start; the test lets it start
        # two seconds from now. Not at once: the node revoked the job's credential when it requeued, and a launch in
        # the same second as the revocation is refused with it ("Job credential revoked": the job ends FAILED).
        # Meanwhile the monitor shows the run as the preemption left it.
        seen["requeued"] = cluster.wait_for_job(ids["warned"], lambda job: job.get("Restarts") == "1"
                                                and job.get("JobState") == "PENDING", 180, "requeued")
        seen["gap"] = monitor(logs["warned"])
        seen["gap_states"] = [read_status(logs["warned"], rank) for rank in (0, 1)]
        seen["gap_checkpoints"] = complete_checkpoints(works["warned"] / "runs/demo/lora/checkpoints")
        cluster.run("scontrol", "update", f"JobId={ids['warned']}", "StartTime=now+2")

        ended = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL")
        uninterrupted.communicate(timeout=300)
        assert uninterrupted.returncode == 0, uninterrupted.stderr.read()[-3000:]
        for name in ("warned", "cancelled"):
            seen[name] = cluster.wait_for_job(ids[name], lambda job: job.get("JobState") in ended, 300, "to end")
        seen["after"] = monitor(logs["warned"])
        seen["cluster_logs"] = cluster.logs()   # what SLURM said of the jobs, for a failed assertion to show
        yield {"works": works, "ids": ids, "logs": logs, "outputs": outputs, "seen": seen,
               "text": {name: path.read_text() for name, path in outputs.items()}}
    finally:
        cluster.stop()


def test_outside_slurm_the_script_says_to_submit_it(tmp_path):
    result = subprocess.run(["bash", SCRIPT, "--demo"], cwd=tmp_path, capture_output=True, text=True, timeout=30,
                            env={key: value for key, value in isolated_env(tmp_path).items()
                                 if not key.startswith("SLURM_")})
    assert result.returncode == 2 and "submit this with sbatch" in result.stderr, result.stderr


@needs_slurm
@pytest.mark.slow
def test_a_one_node_job_trains_the_demo_to_its_end(jobs):
    job, text = jobs["seen"]["warned"], jobs["text"]["warned"]
    assert job["JobState"] == "COMPLETED" and job["ExitCode"] == "0:0", \
        f"{text[-3000:]}\n{job}\n{jobs['seen']['cluster_logs']}"
    assert re.search(rf"^job {jobs['ids']['warned']} on 1 node\(s\) \(n\d\): MASTER_ADDR=127\.0\.0\.1 "
                     rf"MASTER_PORT=\d+$", text, re.M), text[:2000]   # as it started first
    assert "2 process(es) here" in text and "finished: 24/24 steps" in text
    for rank in (0, 1):
        assert read_status(jobs["logs"]["warned"], rank)["status"] == "finished"


@needs_slurm
@pytest.mark.slow
def test_the_warning_checkpoints_requeues_and_the_job_goes_on_by_itself_to_the_same_lora(jobs):
    seen, text, work = jobs["seen"], jobs["text"]["warned"], jobs["works"]["warned"]
    # At the warning every rank finished its step and saved a complete checkpoint there; `preempted`, not failed.
    states = seen["gap_states"]
    assert [state["status"] for state in states] == ["preempted", "preempted"], [s["phase"] for s in states]
    stopped_at = states[0]["step"]
    assert states[1]["step"] == stopped_at and 3 <= stopped_at < 24
    assert seen["gap_checkpoints"][-1][0] == stopped_at
    assert "the scheduler's warning" in states[0]["phase"] or "the scheduler's warning" in states[1]["phase"]
    code, gap = seen["gap"]
    assert code == 0 and gap["status"] == "preempted" and gap["step"] == stopped_at
    # Requeued by itself, it started again and went on from that checkpoint, under the same run id.
    assert seen["requeued"]["Restarts"] == "1"
    assert seen["warned"]["JobState"] == "COMPLETED" and seen["warned"]["Restarts"] == "1", \
        f"{text[-3000:]}\n{seen['warned']}\n{seen['cluster_logs']}"
    job_id = jobs["ids"]["warned"]
    assert f"requeueing job {job_id}: when it starts again it goes on from the checkpoint" in text
    assert f"job {job_id} (requeued 1 time(s)) on 1 node(s)" in text and "; goes on with --resume latest" in text
    run_id = gap["run_id"]
    assert set(RUN_ID.findall(text)) == {run_id} and f"run {run_id} (resumed): " in text
    # One run in the monitor, finished, every step once on every rank.
    code, after = seen["after"]
    assert code == 0 and after["status"] == "finished" and after["run_id"] == run_id
    assert [rank["rank"] for rank in after["ranks"]] == [0, 1]
    assert not any("ignored files of run" in note for note in after["notes"]), after["notes"]
    for rank in (0, 1):
        assert [line["step"] for line in read_history(jobs["logs"]["warned"], rank)] == STEPS
        assert read_status(jobs["logs"]["warned"], rank)["run_id"] == run_id
    # Nothing trained twice, nothing skipped: every epoch's rows over both ranks are that epoch's batches.
    for epoch in range(4):
        trained = Counter(row for rank in (0, 1) for line in read_history(jobs["logs"]["warned"], rank)
                          if line["epoch"] == epoch for row in line["rows"])
        planned = Counter(index % len(DEMO_KEYS) for batch in epoch_batches(
            DEMO_KEYS, DEMO_REPEAT, {"video": 1, "image": 3}, 2, DEMO_SEED, epoch) for index in batch)
        assert trained == planned, epoch
    # The same LoRA as the training never interrupted.
    expected = load_file(str(jobs["works"]["uninterrupted"] / "runs/demo/lora/lora.safetensors"))
    actual = load_file(str(work / "runs/demo/lora/lora.safetensors"))
    assert expected.keys() == actual.keys()
    for key in expected:
        torch.testing.assert_close(actual[key], expected[key], rtol=1e-5, atol=1e-5, msg=key)


@needs_slurm
@pytest.mark.slow
def test_scancel_of_a_two_node_job_leaves_a_complete_checkpoint_and_preempted_on_every_rank(jobs):
    """SIGTERM reaches every process of both nodes (the launchers, accelerate, the ranks, their data-loader
    workers): each rank finishes its step, the checkpoint holds both ranks' states, nothing is requeued."""
    job, text, log_dir = jobs["seen"]["cancelled"], jobs["text"]["cancelled"], jobs["logs"]["cancelled"]
    assert job["JobState"] == "CANCELLED" and job["Restarts"] == "0", text[-3000:]
    assert re.search(rf"^job {jobs['ids']['cancelled']} on 2 node\(s\) \(n\[0-1\]\): MASTER_ADDR=127\.0\.0\.1 ", text,
                     re.M), text[:2000]
    states = [read_status(log_dir, rank) for rank in (0, 1)]
    assert [state["status"] for state in states] == ["preempted", "preempted"], [s["phase"] for s in states]
    assert {state["hostname"] for state in states} and states[0]["world_size"] == 2
    stopped_at = states[0]["step"]
    assert states[1]["step"] == stopped_at and 3 <= stopped_at < 24
    assert all("SIGTERM from the scheduler" in state["phase"] or "made on another rank" in state["phase"]
               for state in states), [state["phase"] for state in states]
    (step, folder), *_ = reversed(complete_checkpoints(jobs["works"]["cancelled"] / "runs/demo/lora/checkpoints"))
    assert step == stopped_at
    assert {"random_states_0.pkl", "random_states_1.pkl"} <= {path.name for path in folder.iterdir()}
    assert "Traceback" not in text and "requeueing" not in text, text[-3000:]
    assert f"preempted at step {stopped_at}/24; resume from" in text
    assert monitor(log_dir)[1]["status"] == "preempted"
