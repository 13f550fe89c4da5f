"""--resolution_stages on 2 CPU ranks (gloo), at 96x96 with --resolution_stages 64x64:0.5 over landscape and portrait
clips and images under --buckets aspect: the first half of the steps at the 64x64 area (each bucket scaled to it),
the rest at 96x96, both ranks the same shapes at every step, to the total the plan printed; from the latent cache the
same shapes (a cache without the stage is refused naming it); a SIGKILL past the boundary and --resume latest equals
the uninterrupted run; ZeRO-2 trains in stages."""

from __future__ import annotations

import re

import psutil
import pytest
import torch
from safetensors.torch import load_file

from catalog_helpers import SQUARE, STUDIO, image, street_clips, write_media_catalogue
from diffsynth_mbc.data.cache.cli import main as cache_main
from diffsynth_mbc.training.checkpoints.folder import complete_checkpoints
from diffsynth_mbc.training.plan import command as plan_command
from e2e_helpers import REPO, demo_flags, kill_tree, launch, read_history, read_status, run, run_main, wait_for
from forked_ranks import run_training

pytestmark = pytest.mark.slow
STAGES = "64x64:0.5"
SIZE = {"height": 96, "width": 96, "buckets": "aspect", "resolution_stages": STAGES, "num_epochs": 4}   # 16 steps


@pytest.fixture(scope="module")
def catalogue(tmp_path_factory):
    """A landscape and a portrait clip and a square image, twice."""
    root = tmp_path_factory.mktemp("stages")
    write_media_catalogue(root, [row for index in range(2) for row in (
        *street_clips(index, seed=index),
        image(f"media/square_{index}.png", *SQUARE, seed=20 + index, caption=STUDIO))])
    return root


def flags(root, run_dir, **more):
    return demo_flags(root, run_dir, **{**SIZE, **more})


def steps_of(log_dir, rank):
    return [line for line in read_history(log_dir, rank) if line.get("kind") is None and "step" in line]


def planned(flags_, capsys) -> tuple[int, int]:
    """(the total, the last step of stage 1) the launcher's plan prints before anything starts."""
    capsys.readouterr()
    assert plan_command.main(["--gpus", "2", *flags_]) == 0
    printed = capsys.readouterr()
    text = printed.out + printed.err
    total = int(re.search(r"epochs \d+ -> ([\d,]+) steps in total", text).group(1))
    boundary = int(re.search(r"stage 1/2: 64x64x9, steps 1-(\d+)", text).group(1))
    return total, boundary


@pytest.fixture(scope="module")
def straight(catalogue, tmp_path_factory):
    work = tmp_path_factory.mktemp("straight")
    code, output = run(work, flags(catalogue, work / "run", checkpoint_steps=2))
    assert code == 0, output[-3000:]
    return work / "run", output


def test_the_first_half_trains_at_the_low_area_on_both_ranks_to_the_printed_total(straight, catalogue, capsys):
    run_dir, output = straight
    total, boundary = planned(flags(catalogue, run_dir), capsys)
    assert boundary == round(0.5 * total) and "stage 2/2 from step" in output
    by_rank = [steps_of(run_dir / "logs", rank) for rank in (0, 1)]
    assert [record["step"] for record in by_rank[0]] == list(range(1, total + 1))
    assert [r["shapes"] for r in by_rank[0]] == [r["shapes"] for r in by_rank[1]]   # the same shapes every step
    for record in by_rank[0]:
        areas = {height * width for _, height, width in record["shapes"]}
        if record["step"] <= boundary:   # each bucket scaled to 64x64's area (sides multiples of 32)
            assert max(areas) <= 64 * 96, (record["step"], record["shapes"])
        else:
            assert min(areas) >= 96 * 64, (record["step"], record["shapes"])
    state = read_status(run_dir / "logs", 0)
    assert state["stage"]["final"] and [row["size"] for row in state["stages"]] == ["64x64x9", "96x96x9"]
    assert state["stages"][0]["to_step"] == boundary


def test_from_the_latent_cache_every_step_has_the_same_shapes(straight, catalogue, tmp_path):
    cache = tmp_path / "cache"
    built = run_main(cache_main, ["--demo", "--dataset_base_path", catalogue / "catalog", "--dataset_metadata_path",
                                  catalogue / "metadata" / "metadata.csv", "--height", "96", "--width", "96",
                                  "--num_frames", "9", "--buckets", "aspect", "--resolution_stages", STAGES,
                                  "--cache_dir", cache, "--dataset_num_workers", "0"], tmp_path)
    assert built.returncode == 0, built.stderr[-3000:]
    result = run_training(tmp_path, flags(catalogue, tmp_path / "run", cache=cache), timeout=400, OMP_NUM_THREADS=1)
    assert result.returncode == 0, result.stderr[-3000:]
    straight_run, _ = straight
    for rank in (0, 1):
        assert [r["shapes"] for r in steps_of(tmp_path / "run" / "logs", rank)] == \
            [r["shapes"] for r in steps_of(straight_run / "logs", rank)]
    other = run_training(tmp_path, flags(catalogue, tmp_path / "other", cache=cache, resolution_stages="32x32:0.5"),
                         timeout=400, OMP_NUM_THREADS=1)
    assert other.returncode != 0
    assert ("it holds no latents for the stage(s) 32x32 of --resolution_stages 32x32:0.5 (built for: 64x64)"
            in other.stdout + other.stderr)


def test_a_sigkill_past_the_boundary_and_a_resume_equal_the_uninterrupted_run(straight, catalogue, capsys, tmp_path):
    straight_run, _ = straight
    total, boundary = planned(flags(catalogue, straight_run), capsys)
    killed = tmp_path / "killed"
    process = launch(tmp_path, flags(catalogue, killed, checkpoint_steps=2))

    def logged():
        try:
            return max(record["step"] for record in steps_of(killed / "logs", 0))
        except (FileNotFoundError, ValueError):
            return 0

    checkpoints = killed / "lora" / "checkpoints"
    def past_the_boundary():   # a checkpoint after the boundary, and a step after that checkpoint
        past = [step for step, _ in complete_checkpoints(checkpoints) if step > boundary]
        return past and logged() > past[0]

    wait_for(past_the_boundary, process, what="a checkpoint past the boundary and a step after it")
    assert logged() < total, "the kill must come before the end"
    rank_pids = [read_status(killed / "logs", rank)["pid"] for rank in (0, 1)]
    kill_tree(process.pid)
    process.wait(timeout=30)
    psutil.wait_procs([psutil.Process(pid) for pid in rank_pids if psutil.pid_exists(pid)], timeout=30)
    code, output = run(tmp_path, flags(catalogue, killed, checkpoint_steps=2, resume="latest"))
    assert code == 0, output[-3000:]
    for rank in (0, 1):
        assert {r["step"]: r["shapes"] for r in steps_of(killed / "logs", rank)} == \
            {r["step"]: r["shapes"] for r in steps_of(straight_run / "logs", rank)}
    expected, actual = load_file(str(straight_run / "lora" / "lora.safetensors")), \
        load_file(str(killed / "lora" / "lora.safetensors"))
    assert expected.keys() == actual.keys()
    for key in expected:
        torch.testing.assert_close(actual[key], expected[key], rtol=1e-5, atol=1e-6, msg=key)


def test_zero2_trains_in_stages(straight, catalogue, tmp_path):
    result = run_training(tmp_path, flags(catalogue, tmp_path), timeout=540, OMP_NUM_THREADS=1,
                          config_file=str(REPO / "configs" / "accelerate" / "deepspeed_zero2.yaml"))
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    straight_run, _ = straight
    assert [r["shapes"] for r in steps_of(tmp_path / "logs", 0)] == [r["shapes"] for r in steps_of(straight_run / "logs", 0)]
    assert read_status(tmp_path / "logs", 1)["status"] == "finished"
