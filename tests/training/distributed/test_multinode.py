"""Two nodes, one run, on one machine: two launchers with --demo --multinode started seconds apart (one CPU
process each, gloo), as a several-node run would be started by hand on each node, each node with its own log folder.
With --buckets aspect, as the presets train: both nodes plan and deal the same bucket batches, and a resume of both
nodes after a kill deals them again the same way, to the LoRA of the same training never interrupted."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time

import pytest
import torch
from safetensors.torch import load_file

from diffsynth_mbc.data.demo import prepare
from diffsynth_mbc.training.checkpoints.folder import complete_checkpoints
from e2e_helpers import REPO, free_port, kill_tree, read_history, read_status
from forked_ranks import start_training
from multinode_helpers import finish, start_nodes

pytestmark = pytest.mark.slow
STEPS = list(range(1, 13))       # configs/train_demo.yaml on 2 ranks, its one bucket (64x64) dealt in pairs


def monitor_json(*sources) -> dict:
    result = subprocess.run([sys.executable, "-m", "diffsynth_mbc.monitor", *map(str, sources), "--json"],
                            capture_output=True, text=True, timeout=60)
    return json.loads(result.stdout)


def wait_until(condition, nodes, timeout=240, what="condition"):
    deadline = time.monotonic() + timeout
    while not condition():
        for node in nodes:
            assert node.poll() is None, f"a node ended before {what}: {node.stdout.read()[-3000:]}"
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)


def both_training(log_dirs):
    def check():
        try:
            return all(read_status(log_dirs[r], r)["status"] == "training" for r in (0, 1))
        except (FileNotFoundError, ValueError, KeyError):
            return False
    return check


def assert_whole_run_seen(snap):
    assert [r["rank"] for r in snap["ranks"]] == [0, 1] and snap["missing_ranks"] == []
    assert not any("ignored files of run" in note for note in snap["notes"]), snap["notes"]


@pytest.fixture(scope="module")
def nodes(tmp_path_factory):
    """One run of two nodes with node-local log folders, watched by one monitor over two sources (a folder and
    another monitor's URL); both nodes killed once a checkpoint is complete and step 5 trained, then resumed with
    --resume latest to the end. Beside it the same training never interrupted: 2 ranks as one node's launcher starts
    them (tests/forked_ranks.py), started first (the first forked run of a session waits for its zygote)."""
    reference = tmp_path_factory.mktemp("uninterrupted")
    prepare(reference / "runs" / "demo")   # the demo's catalogue where the launcher writes it, and its flags
    uninterrupted = start_training(reference, ["--config", REPO / "configs" / "train_demo.yaml", "--buckets", "aspect"],
                                   OMP_NUM_THREADS=1)
    work = tmp_path_factory.mktemp("nodes-local-logs")
    logs = (work / "node0-logs", work / "node1-logs")
    for folder in logs:   # the monitor refuses a folder that does not exist; the launchers would make them
        folder.mkdir()
    checkpoints = work / "runs/demo/lora/checkpoints"
    nodes = start_nodes(work, free_port(), log_dirs=logs)
    server = subprocess.Popen([sys.executable, "-m", "diffsynth_mbc.monitor", str(logs[0]), "--serve", "127.0.0.1:0",
                               "--no-view"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        url = re.search(r"http://127\.0\.0\.1:\d+/", server.stdout.readline()).group(0)
        wait_until(both_training(logs), nodes, what="both nodes training")
        during = monitor_json(logs[1], url)
        alone = monitor_json(logs[1])
        wait_until(lambda: complete_checkpoints(checkpoints) and both_training(logs)()
                   and max((line["step"] for line in read_history(logs[0], 0)), default=0) >= 5, nodes,
                   what="a checkpoint and step 5")
        first_ids = {read_status(logs[r], r)["run_id"] for r in (0, 1)}
        for node in nodes:
            kill_tree(node.pid)
        for node in nodes:
            node.wait(timeout=60)
        nodes = start_nodes(work, free_port(), "--resume", "latest", log_dirs=logs)
        outputs = finish(nodes)
        after = monitor_json(logs[1], url)
        unanswered = monitor_json(logs[1], "http://127.0.0.1:9/")   # nothing listens on the discard port
        _, stderr = uninterrupted.communicate(timeout=300)
        assert uninterrupted.returncode == 0, stderr[-3000:]
    finally:
        server.kill()
        server.wait()
        for node in nodes:
            if node.poll() is None:
                kill_tree(node.pid)
    return {"work": work, "logs": logs, "during": during, "after": after, "alone": alone, "unanswered": unanswered,
            "first_ids": first_ids, "outputs": outputs, "reference": reference}


def test_a_monitor_over_two_sources_sees_every_node(nodes):
    assert_whole_run_seen(nodes["during"])
    assert nodes["during"]["status"] == "training"
    assert_whole_run_seen(nodes["after"])
    assert nodes["after"]["status"] == "finished"
    assert nodes["alone"]["missing_ranks"] == [0]      # one node's folder alone shows half the run
    unanswered = nodes["unanswered"]
    assert unanswered["missing_ranks"] == [0] and any("did not answer" in n for n in unanswered["notes"])


def test_one_run_id_and_complete_checkpoints_with_node_local_logs(nodes):
    assert len(nodes["first_ids"]) == 1, "both nodes must agree on one run id"
    run_ids = {read_status(nodes["logs"][r], r)["run_id"] for r in (0, 1)}
    assert run_ids == nodes["first_ids"]   # the resume goes on under it
    for rank in (0, 1):   # both nodes planned the same buckets and trained them at the same steps
        plan = read_status(nodes["logs"][rank], rank)["plan"]
        assert [row["key"] for row in plan["bucket_samples"]] == ["image@64x64", "video@64x64"]
    shapes = [[record["shapes"] for record in read_history(nodes["logs"][rank], rank)
               if record.get("kind") is None] for rank in (0, 1)]
    assert shapes[0] == shapes[1] and len(shapes[0]) == len(STEPS)
    checkpoints = complete_checkpoints(nodes["work"] / "runs/demo/lora/checkpoints")
    assert checkpoints
    for _step, folder in checkpoints:
        assert {"random_states_0.pkl", "random_states_1.pkl"} <= {p.name for p in folder.iterdir()}
        assert json.loads((folder / "checkpoint.json").read_text())["run_id"] in run_ids


def test_killing_both_nodes_and_resuming_both_equals_the_uninterrupted_run(nodes):
    first_ids = nodes["first_ids"]
    # one run id on the screen: the launch is named by the run it resumes, not by a new id first
    for output in nodes["outputs"]:
        assert set(re.findall(r"\brun-\d{8}-\d{6}-[0-9a-f]+\b", output)) == first_ids, output[-3000:]
        assert f"run {next(iter(first_ids))} (resumed): " in output
    for rank in (0, 1):   # every step once, in each node's own log folder
        assert [line["step"] for line in read_history(nodes["logs"][rank], rank)
                if line.get("kind") != "val"] == STEPS
    expected = load_file(str(nodes["reference"] / "runs/demo/lora/lora.safetensors"))
    actual = load_file(str(nodes["work"] / "runs/demo/lora/lora.safetensors"))
    assert expected.keys() == actual.keys()
    for key in expected:
        torch.testing.assert_close(actual[key], expected[key], rtol=1e-5, atol=1e-5, msg=key)
