"""One size table per run, on 2 CPU ranks (gloo): rank 0 reads the media sizes and every rank trains its buckets,
even where a rank's copy of a file is another shape (each rank read its own files: the ranks planned different
buckets and trained different shapes at the same step); a resume after a file changed shape is refused naming the
row (it was accepted and the plan shifted: "finished: 7/6 steps")."""

from __future__ import annotations

import json
import shutil
from dataclasses import replace

import pytest

from catalog_helpers import LANDSCAPE, PORTRAIT, SQUARE, STUDIO, clip, image, street_clips, write_media_catalogue
from diffsynth_mbc.run_layout import SIZE_TABLE
from e2e_helpers import REPO, read_history, read_status

pytestmark = pytest.mark.slow

# rank 1 works in another folder (another node's copy of the catalogue), where land_0.mp4 is a portrait clip
OTHER_NODE = """import os
if os.environ["RANK"] == "1":
    os.chdir(os.environ["OTHER_NODE_FOLDER"])
"""

RANK_0_LATE = """import os, time
if os.environ["RANK"] == "0":
    time.sleep(3)
"""


def write_catalogue(folder, portrait_land_0=False):
    """2 landscape and 2 portrait clips and a square image; land_0.mp4 portrait too if told. Returns the metadata."""
    rows = [*street_clips(0, seed=0), *street_clips(1, seed=1),
            image("media/square.png", *SQUARE, seed=3, caption=STUDIO)]
    if portrait_land_0:
        rows[0] = replace(rows[0], width=rows[0].height, height=rows[0].width)
    return write_media_catalogue(folder, rows)


def flags(node_0, run_dir, **more):
    """The dataset's base folder is relative: each rank reads the catalogue of the folder it works in."""
    values = {"config": REPO / "configs" / "train_demo.yaml", "dataset_base_path": "catalog",
              "dataset_metadata_path": node_0 / "metadata" / "metadata.csv", "output_path": run_dir / "lora",
              "log_dir": run_dir / "logs", "buckets": "aspect", "height": 64, "width": 128, "num_epochs": 1,
              "dataset_repeat": 1, "checkpoint_steps": 1, **more}
    return [item for key, value in values.items() for item in (f"--{key}", str(value))]


def step_records(log_dir, rank):
    return [line for line in read_history(log_dir, rank) if line.get("kind") is None and "step" in line]


def test_every_rank_trains_rank_0s_buckets_and_a_resume_on_resized_media_is_refused(tmp_path):
    from forked_ranks import run_training

    node_0, node_1, run_dir = tmp_path / "node0", tmp_path / "node1", tmp_path / "run"
    write_catalogue(node_0)
    write_catalogue(node_1, portrait_land_0=True)
    result = run_training(node_0, flags(node_0, run_dir), timeout=300, prelude=OTHER_NODE,
                          OMP_NUM_THREADS=1, OTHER_NODE_FOLDER=str(node_1))
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    logs = run_dir / "logs"
    states = [read_status(logs, rank) for rank in (0, 1)]
    assert [state["status"] for state in states] == ["finished", "finished"]
    assert states[0]["total_steps"] == states[1]["total_steps"] == states[0]["step"]
    assert states[0]["plan"]["bucket_samples"] == states[1]["plan"]["bucket_samples"]
    by_rank = [step_records(logs, rank) for rank in (0, 1)]
    assert [record["shapes"] for record in by_rank[0]] == [record["shapes"] for record in by_rank[1]]
    # the sizes rank 0 read, kept beside the run: one entry per file of rank 0's catalogue
    table = json.loads((run_dir / "lora" / SIZE_TABLE).read_text())["sizes"]
    assert sorted(key.rsplit("/", 1)[1] for key in table) == [
        "land_0.mp4", "land_1.mp4", "port_0.mp4", "port_1.mp4", "square.png"]

    # land_1.mp4 turns portrait: a resume from the last checkpoint would plan other buckets. Every rank refuses;
    # rank 0, which says why, comes to it last here: rank 1 ending first had the launcher stop rank 0 unheard.
    shutil.copy(node_0 / "catalog" / "media" / "port_1.mp4", node_0 / "catalog" / "media" / "land_1.mp4")
    resumed = run_training(node_0, flags(node_0, run_dir, resume="latest"), timeout=300, OMP_NUM_THREADS=1,
                           prelude=RANK_0_LATE)
    assert resumed.returncode != 0
    said = resumed.stdout + resumed.stderr
    assert said.count("trained on other media") == 1, said[-3000:]
    assert ("trained on other media: since it was saved,\n  1 file changed size: metadata row 3 (media/land_1.mp4): "
            "128x72 then, 72x128 now\nResuming would train other rows, in other buckets") in said, said[-3000:]
    assert read_status(logs, 0)["step"] == states[0]["step"]


def test_a_forced_resume_on_resized_media_says_what_changed_and_ends_where_its_plan_does(tmp_path):
    """``--force_resume true`` after sizes changed ended ``finished: 5/4 steps``, with no line saying what changed
    and what the run now used (and its last steps trained past the end of the learning-rate schedule, at rate 0)."""
    from forked_ranks import run_training

    node, run_dir = tmp_path / "node", tmp_path / "run"
    write_media_catalogue(node, [clip("media/land.mp4", *LANDSCAPE, seed=1, caption="a street"),
                                 clip("media/port.mp4", *PORTRAIT, seed=2, caption="a tower"),
                                 image("media/square.png", *SQUARE, seed=3, caption="a desk")])
    media = node / "catalog" / "media"
    more = {"num_epochs": 3, "keep_checkpoints": 100}
    first = run_training(node, flags(node, run_dir, **more), timeout=300, OMP_NUM_THREADS=1)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    assert read_status(run_dir / "logs", 0)["total_steps"] == 6   # one bucket each: 3 batches, 2 steps an epoch

    # the landscape clip turns portrait: both clips share a bucket, an epoch is 1 step now
    shutil.copy(media / "port.mp4", media / "land.mp4")
    forced = run_training(node, flags(node, run_dir, resume=str(run_dir / "lora" / "checkpoints" / "step-00000002"),
                                      force_resume="true", **more), timeout=300, OMP_NUM_THREADS=1)
    said = forced.stdout + forced.stderr
    assert forced.returncode == 0, said[-3000:]
    assert ("with --force_resume true despite:\n  1 file changed size: metadata row 1 (media/land.mp4): 128x72 then, "
            "72x128 now\n") in said, said[-3000:]
    assert ("the run now uses this run's settings and media: 1 step per epoch (2 batches per GPU) x 3 epochs; from "
            "the checkpoint's step 2 (epoch 2, batch 0) it goes on to step 4, not this plan's 3: the checkpoint's 2 "
            "steps were counted under its own plan (the learning-rate schedule ends at step 4 too)") in said
    assert "finished: 4/4 steps" in said
    state = read_status(run_dir / "logs", 0)
    assert state["resumed_with_changes"] == [
        "1 file changed size: metadata row 1 (media/land.mp4): 128x72 then, 72x128 now"]
    assert (state["step"], state["total_steps"], state["progress"]) == (4, 4, 100.0)
    steps = step_records(run_dir / "logs", 0)
    assert [record["step"] for record in steps][-2:] == [3, 4] and steps[-1]["lr"] > 0
