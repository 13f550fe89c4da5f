"""Whether the LoRA is learning, on a real 2-rank demo run (gloo) of two catalogues with validation and an EMA:
every validation record carries the base model's loss (the LoRA off, on the same samples, noise and timesteps),
measured once and reused; the status file carries the run's recipe and each catalogue's samples this epoch; rank 0
prints the recipe once and ends with the LoRA's gain over the base and every file the run wrote."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from diffsynth_mbc.data.demo import prepare
from e2e_helpers import REPO, assert_the_monitor_reads_what_the_ranks_wrote, read_history, read_status
from forked_ranks import run_training

pytestmark = pytest.mark.slow
QUANTILES = ["0.1", "0.3", "0.5", "0.7", "0.9"]


@pytest.fixture(scope="module")
def base_run(tmp_path_factory):
    """One run every test here reads: news (3 clips, 2 images) and drama (2 clips, 1 image, repeat 2), validation
    every 3 steps on 4 samples and at the end, EMA with --validate_with both: (log dir, output dir, output)."""
    work = tmp_path_factory.mktemp("base_run")
    prepare(work / "news", num_videos=3, num_images=2, seed=1)
    prepare(work / "drama", num_videos=2, num_images=1, seed=2)
    val = prepare(work / "val", num_videos=3, num_images=2, seed=3)
    # the first validation row does not decode: the next row takes its place, said in every record
    first = next(line.split(",")[0] for line in val.read_text(encoding="utf-8").splitlines()[1:2])
    (val.parents[1] / "catalog" / first).write_bytes(b"\x00\x00\x00\x18ftypmp42 not a video" * 4)
    listing = [{"base_path": str(work / "news" / "catalog"), "metadata_path": str(work / "news" / "metadata" /
                                                                                  "metadata.csv"), "name": "news"},
               {"base_path": str(work / "drama" / "catalog"), "metadata_path": str(work / "drama" / "metadata" /
                                                                                   "metadata.csv"), "name": "drama",
                "repeat": 2, "caption_prefix": "mbc drama, "}]
    (work / "datasets.yaml").write_text(json.dumps(listing))
    flags = {"config": REPO / "configs" / "train_demo.yaml", "datasets": work / "datasets.yaml",
             "output_path": work / "run" / "lora", "log_dir": work / "run" / "logs", "val_metadata_path": val,
             "val_base_path": val.parents[1] / "catalog", "val_steps": 3, "val_samples": 4, "ema_decay": 0.9,
             "validate_with": "both"}
    result = run_training(work, [item for key, value in flags.items() for item in (f"--{key}", str(value))],
                          timeout=400, OMP_NUM_THREADS=1)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-4000:]
    return work / "run" / "logs", work / "run" / "lora", output


def validations(log_dir: Path, rank: int) -> list[dict]:
    return [line for line in read_history(log_dir, rank) if line.get("kind") == "val"]


def test_every_validation_carries_the_base_model_s_loss_measured_once(base_run):
    log_dir, _, output = base_run
    bases = []
    for rank in (0, 1):
        records = validations(log_dir, rank)
        assert [record["step"] for record in records] == [3, 6, 9, 12, 14]
        for record in records:
            assert math.isfinite(record["val_loss_base"]) and list(record["val_loss_base_by_quantile"]) == QUANTILES
            assert record["val_loss_base"] == pytest.approx(sum(record["val_loss_base_by_quantile"].values()) / 5)
            assert set(record["val_loss_base_by_mode"]) <= {"t2i", "i2v", "t2v"}
            assert record["val_loss_base_step"] == 3   # measured at the first validation, reused by every later one
        # one measurement: the very same numbers in every record (and on every rank: split and all-reduced)
        assert len({json.dumps([record[key] for key in ("val_loss_base", "val_loss_base_by_quantile",
                                                         "val_loss_base_by_mode")]) for record in records}) == 1
        bases.append(records[0]["val_loss_base"])
        # the LoRA moved: its loss is not the base's, and the EMA's is a third number
        assert all(record["val_loss"] != record["val_loss_base"] for record in records)
        assert records[-1]["val_loss_ema"] not in (records[-1]["val_loss"], records[-1]["val_loss_base"])
        state = read_status(log_dir, rank)
        assert state["val_loss_base"] == records[-1]["val_loss_base"] and state["val_step"] == 14
        assert state["val_loss_base_by_quantile"] == records[-1]["val_loss_base_by_quantile"]
    assert bases[0] == bases[1]
    assert output.count("(measured now, once for the run)") == 1   # rank 0's validation line at step 3 only
    assert "validation at step 6: val_loss" in output and "; base model " in output


def test_the_status_file_carries_the_recipe_and_each_catalogue_s_samples_this_epoch(base_run):
    log_dir, _, output = base_run
    for rank in (0, 1):
        state = read_status(log_dir, rank)
        recipe = state["recipe"]
        assert [(item["name"], item["repeat"]) for item in recipe["catalogues"]] == [("news", 3), ("drama", 6)]
        assert recipe["catalogues"][1]["caption_prefix"] == "mbc drama, "
        assert recipe["ema"] == {"decay": 0.9, "warmup": True, "validate_with": "both"}
        assert recipe["lora"]["rank"] == 4 and recipe["timestep_sampling"] == {"method": "diffsynth"}
        progress = state["catalogue_progress"]
        assert [item["name"] for item in progress] == ["news", "drama"]
        # per_epoch: about this rank's share (news 5 rows x 3 = 15, drama 3 x 6 = 18, over 2 ranks)
        assert [item["per_epoch"] for item in progress] == [8, 9]
        last_epoch = [line["samples"] for line in read_history(log_dir, rank)
                      if "kind" not in line and line["epoch"] == 1]
        assert sum(item["seen"] for item in progress) == sum(last_epoch) > 0   # counted from the epoch's start
        assert all(item["seen"] > 0 for item in progress)
    assert output.count("recipe: objective modes") == 1   # rank 0, once
    assert "catalogues news x3, drama x6" in " ".join(line.strip() for line in output.splitlines())
    assert "seen: news " in output and ", drama " in output   # the epoch-end progress lines


def test_the_summary_says_the_gain_over_the_base_and_every_file_written(base_run):
    log_dir, lora_dir, output = base_run
    state = read_status(log_dir, 0)
    gain = state["val_loss_base"] - state["val_loss"]
    assert (f"  validation: loss {state['val_loss']:.4f} vs the base model's {state['val_loss_base']:.4f} "
            f"(LoRA gain {gain:.4f}, ") in output
    assert f"  validation: EMA loss {state['val_loss_ema']:.4f} vs the base model's" in output
    assert f"  EMA LoRA: {lora_dir}/lora_ema.safetensors" in output and (lora_dir / "lora_ema.safetensors").exists()
    assert f"  also in {lora_dir}: 2 epoch file(s) (epoch-001 .. epoch-002) (each with its _ema twin)" in output


def test_a_validation_sample_that_does_not_decode_is_counted_and_named(base_run):
    """It was replaced by the next row without a word (``val_samples: 4`` stayed)."""
    log_dir, _, _ = base_run
    named = []
    for rank in (0, 1):
        records = validations(log_dir, rank)
        assert all(record["val_substituted"] == 1 and record["val_samples"] == 4 for record in records)
        named += records[-1]["val_substituted_rows"]
        state = read_status(log_dir, rank)
        assert state["val_substituted"] == 1
    row, = named
    assert (row["row"], row["val_sample"]) == (1, 0) and row["file"].endswith(".mp4") and row["reason"]


def test_every_status_field_the_run_wrote_is_declared_and_read_back_as_written(base_run):
    written = assert_the_monitor_reads_what_the_ranks_wrote(base_run[0])
    assert {"val_loss", "val_loss_ema_by_mode", "val_loss_base_by_quantile", "val_substituted_rows", "best",
            "catalogue_progress", "recipe"} <= set(written)
