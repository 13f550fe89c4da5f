"""--buckets on 2 CPU ranks (gloo): landscape and portrait clips and square and 4:3 images each train at their own
bucket, every rank on the same bucket at every step, to the total the plan printed before the run; a SIGKILL and
--resume latest equals the uninterrupted run; ZeRO-2 trains with buckets; --buckets off trains everything at
--height x --width."""

from __future__ import annotations

import re
from pathlib import Path

import psutil
import pytest
import torch
from safetensors.torch import load_file

from catalog_helpers import street_clips, studio_pictures, write_media_catalogue
from diffsynth_mbc.training.checkpoints.folder import complete_checkpoints
from diffsynth_mbc.training.plan import command as plan_command
from e2e_helpers import REPO, demo_flags, kill_tree, launch, read_history, read_status, run, wait_for

pytestmark = pytest.mark.slow

SIZE = {"height": 64, "width": 128}   # buckets 64x160, 64x128, 96x96, 128x64, 160x64 (width x height)
# [frames, height, width] each row trains at under --buckets aspect, by the file's name
AT_ITS_BUCKET = {"land": [9, 64, 128], "port": [9, 128, 64], "square": [1, 96, 96], "four_three": [1, 96, 96]}
# 3 landscape (128x72) and 3 portrait (72x128) clips, 2 square (64x64) and 2 4:3 (80x60) images
MIXED = (*(row for index in range(3) for row in street_clips(index, seed=index, portrait_seed=10 + index)),
         *(row for index in range(2) for row in studio_pictures(index, seed=20 + index)))


@pytest.fixture(scope="module")
def mixed_catalogue(tmp_path_factory):
    root = tmp_path_factory.mktemp("mixed")
    write_media_catalogue(root, MIXED)
    return root


def bucket_flags(root, run_dir, buckets="aspect", **overrides):
    return demo_flags(root, run_dir, buckets=buckets, **SIZE, **overrides)


def step_records(log_dir, rank):
    return [line for line in read_history(log_dir, rank) if line.get("kind") is None and "step" in line]


def planned_total(flags, capsys) -> int:
    """The total the launcher's plan (python -m diffsynth_mbc.plan) prints before anything starts."""
    capsys.readouterr()
    assert plan_command.main(["--gpus", "2", *flags]) == 0
    printed = capsys.readouterr()
    return int(re.search(r"epochs \d+ -> ([\d,]+) steps in total", printed.out + printed.err).group(1))


@pytest.fixture(scope="module")
def aspect_run(mixed_catalogue, tmp_path_factory):
    work = tmp_path_factory.mktemp("aspect")
    code, output = run(work, bucket_flags(mixed_catalogue, work / "straight"))
    assert code == 0, output[-3000:]
    return work / "straight", output


def test_each_sample_trains_at_its_bucket_on_every_rank_to_the_planned_total(aspect_run, mixed_catalogue, capsys):
    run_dir, output = aspect_run
    assert "buckets (aspect): 3 in use" in output
    total = planned_total(bucket_flags(mixed_catalogue, run_dir), capsys)
    logs = run_dir / "logs"
    by_rank = [step_records(logs, rank) for rank in (0, 1)]
    for rank, records in enumerate(by_rank):
        state = read_status(logs, rank)
        assert state["status"] == "finished" and state["step"] == state["total_steps"] == total
        assert [record["step"] for record in records] == list(range(1, total + 1))
        assert {key["key"] for key in state["plan"]["bucket_samples"]} == {
            "video@128x64", "video@64x128", "image@96x96"}
    shapes_seen = set()
    for first, second in zip(*by_rank):
        assert len(first["shapes"]) == len(first["timesteps"])
        # equal load: at every step both ranks trained the same bucket, the same number of samples
        assert first["shapes"] == second["shapes"], (first["step"], first["shapes"], second["shapes"])
        shapes_seen |= {tuple(shape) for shape in first["shapes"]}
    assert shapes_seen == {tuple(shape) for shape in AT_ITS_BUCKET.values()}


def test_off_trains_everything_at_height_by_width(mixed_catalogue, tmp_path, capsys):
    flags = bucket_flags(mixed_catalogue, tmp_path, buckets="off", num_epochs=1)
    code, output = run(tmp_path, flags)
    assert code == 0, output[-3000:]
    assert "buckets (aspect)" not in output
    total = planned_total(flags, capsys)
    for rank in (0, 1):
        records = step_records(tmp_path / "logs", rank)
        assert [record["step"] for record in records] == list(range(1, total + 1))
        assert {tuple(shape) for record in records for shape in record["shapes"]} == {(9, 64, 128), (1, 64, 128)}


def test_sigkill_then_resume_latest_with_buckets_equals_the_uninterrupted_run(aspect_run, mixed_catalogue, tmp_path):
    straight, _ = aspect_run
    killed = tmp_path / "killed"
    process = launch(tmp_path, bucket_flags(mixed_catalogue, killed))
    checkpoints = killed / "lora" / "checkpoints"

    def logged():
        try:
            return max(record["step"] for record in step_records(killed / "logs", 0))
        except (FileNotFoundError, ValueError):
            return 0

    wait_for(lambda: complete_checkpoints(checkpoints) and logged() >= 6, process, what="step 6 after a checkpoint")
    rank_pids = [read_status(killed / "logs", rank)["pid"] for rank in (0, 1)]
    kill_tree(process.pid)
    process.wait(timeout=30)
    psutil.wait_procs([psutil.Process(pid) for pid in rank_pids if psutil.pid_exists(pid)], timeout=30)
    assert logged() > complete_checkpoints(checkpoints)[-1][0], "the kill must fall between checkpoints"

    code, output = run(tmp_path, bucket_flags(mixed_catalogue, killed, resume="latest"))
    assert code == 0, output[-3000:]
    for rank in (0, 1):
        resumed = {record["step"]: record["shapes"] for record in step_records(killed / "logs", rank)}
        assert resumed == {record["step"]: record["shapes"] for record in step_records(straight / "logs", rank)}
    expected = load_file(str(straight / "lora" / "lora.safetensors"))
    actual = load_file(str(killed / "lora" / "lora.safetensors"))
    assert expected.keys() == actual.keys()
    for key in expected:
        torch.testing.assert_close(actual[key], expected[key], rtol=1e-5, atol=1e-6, msg=key)


def test_zero2_trains_with_buckets(mixed_catalogue, tmp_path):
    from forked_ranks import run_training

    result = run_training(tmp_path, bucket_flags(mixed_catalogue, tmp_path, num_epochs=1), timeout=540,
                          OMP_NUM_THREADS=1, config_file=str(REPO / "configs" / "accelerate" / "deepspeed_zero2.yaml"))
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    by_rank = [step_records(tmp_path / "logs", rank) for rank in (0, 1)]
    assert by_rank[0] and [r["shapes"] for r in by_rank[0]] == [r["shapes"] for r in by_rank[1]]
    assert {tuple(shape) for record in by_rank[0] for shape in record["shapes"]} == {
        tuple(shape) for shape in AT_ITS_BUCKET.values()}
    assert read_status(tmp_path / "logs", 0)["status"] == "finished"
    assert Path(tmp_path / "lora" / "lora.safetensors").stat().st_size > 0
