"""Never lose a run: SIGKILL then --resume latest equals an uninterrupted run; SIGTERM stops cleanly;
bad media is survived or stops the run; validation loss is comparable over time. 2 CPU ranks (gloo)."""

import json
import os
import signal
from pathlib import Path

import psutil
import pytest
import torch
from safetensors.torch import load_file

from diffsynth_mbc.data.demo import prepare
from diffsynth_mbc.run_layout import checkpoint_folder_name
from diffsynth_mbc.training.checkpoints.folder import complete_checkpoints, read_manifest
from e2e_helpers import demo_flags, kill_tree, launch, read_history, read_status, run, wait_for

pytestmark = pytest.mark.slow


def train_flags(data_root, run_dir, **overrides):
    return demo_flags(data_root, run_dir, **{"checkpoint_steps": 5, **overrides})


def train_steps(log_dir, rank):
    return [line["step"] for line in read_history(log_dir, rank) if line.get("kind") != "val"]


def last_logged_step(log_dir):
    try:
        return max(train_steps(log_dir, 0))
    except (FileNotFoundError, ValueError, json.JSONDecodeError):
        return 0


def validation_flags(val_metadata):
    return {"val_metadata_path": val_metadata, "val_base_path": Path(val_metadata).parents[1] / "catalog",
            "val_steps": 3, "val_samples": 4}


EMA = {"ema_decay": 0.9, "validate_with": "both"}   # the EMA is in the checkpoints and resumes exactly too


def validation_lines(log_dir, rank):
    return [line for line in read_history(log_dir, rank) if line.get("kind") == "val"]


CAPTIONS = {"caption_dropout": 0.5, "caption_prefix": "mbcstyle",   # dropped captions are the same after a resume
            "i2v_probability": 0.5}                                  # and so are the videos' i2v / t2v modes


def test_sigkill_then_resume_latest_equals_an_uninterrupted_run(tmp_path, demo_data):
    """Also: validation loss uses fixed samples, seeds and timesteps, so both runs log the same values."""
    data_root, val_metadata = demo_data
    straight = tmp_path / "straight"
    code, output = run(tmp_path, train_flags(data_root, straight, **CAPTIONS, **validation_flags(val_metadata), **EMA))
    assert code == 0, output[-3000:]

    killed = tmp_path / "killed"
    process = launch(tmp_path, train_flags(data_root, killed, report_to="tensorboard", **CAPTIONS,
                                           **validation_flags(val_metadata), **EMA))
    checkpoints = killed / "lora" / "checkpoints"
    wait_for(lambda: complete_checkpoints(checkpoints) and last_logged_step(killed / "logs") >= 7, process,
             what="step 7 after the first checkpoint")
    rank_pids = [read_status(killed / "logs", rank)["pid"] for rank in (0, 1)]
    first_run_id = read_status(killed / "logs", 0)["run_id"]
    kill_tree(process.pid)
    process.wait(timeout=30)
    psutil.wait_procs([psutil.Process(pid) for pid in rank_pids if psutil.pid_exists(pid)], timeout=30)
    assert not any(psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
                   for pid in rank_pids)
    resumed_from = complete_checkpoints(checkpoints)[-1][0]
    logged_before_kill = last_logged_step(killed / "logs")
    assert logged_before_kill > resumed_from, "the kill must fall between checkpoints for this test to mean anything"
    assert not (killed / "lora" / "lora.safetensors").exists()
    checkpoint_elapsed = read_manifest(checkpoints / checkpoint_folder_name(resumed_from))["elapsed_s"]

    code, output = run(tmp_path, train_flags(data_root, killed, resume="latest", report_to="tensorboard", **CAPTIONS,
                                             **validation_flags(val_metadata), **EMA))
    assert code == 0, output[-3000:]
    # The resumed run is the same run: its id, its clock and its tracker run go on.
    assert checkpoint_elapsed > 0
    for rank in (0, 1):
        state = read_status(killed / "logs", rank)
        assert state["run_id"] == first_run_id
        assert state["resumed_from"] == {"checkpoint": checkpoint_folder_name(resumed_from), "step": resumed_from,
                                         "run_id": first_run_id}
        assert state["elapsed_s"] > checkpoint_elapsed
    assert [p.name for p in (killed / "lora" / "tracking").iterdir()] == [first_run_id]

    for name in ("lora.safetensors", "lora_ema.safetensors"):
        expected = load_file(str(straight / "lora" / name))
        actual = load_file(str(killed / "lora" / name))
        assert expected.keys() == actual.keys()
        for key in expected:
            torch.testing.assert_close(actual[key], expected[key], rtol=1e-5, atol=1e-6, msg=f"{name}: {key}")
    for rank in (0, 1):
        assert train_steps(killed / "logs", rank) == list(range(1, 13)), "each step exactly once"
        state = read_status(killed / "logs", rank)
        assert state["status"] == "finished" and state["step"] == 12
        assert state["samples_seen"] == read_status(straight / "logs", rank)["samples_seen"]
        assert 0 < read_status(straight / "logs", rank)["captions_dropped"] < state["samples_seen"]
        straight_modes = [line["modes"] for line in read_history(straight / "logs", rank) if "modes" in line]
        assert [line["modes"] for line in read_history(killed / "logs", rank) if "modes" in line][-len(
            straight_modes):] == straight_modes
        assert {mode for modes in straight_modes for mode in modes} == {"t2i", "i2v", "t2v"}
        expected_val, actual_val = validation_lines(straight / "logs", rank), validation_lines(killed / "logs", rank)
        assert [line["step"] for line in actual_val] == [line["step"] for line in expected_val] == [3, 6, 9, 12]
        assert all(line["val_samples"] == 4 for line in actual_val)
        assert [line["val_loss"] for line in actual_val] == pytest.approx([line["val_loss"] for line in expected_val],
                                                                          rel=1e-5)
        for actual, expected in zip(actual_val, expected_val):
            assert actual["val_loss_by_mode"] == pytest.approx(expected["val_loss_by_mode"], rel=1e-5)
        assert set(actual_val[-1]["val_loss_by_mode"]) <= {"t2i", "i2v", "t2v"} and "t2i" in actual_val[-1][
            "val_loss_by_mode"]
        assert [line["val_loss_ema"] for line in actual_val] == pytest.approx(
            [line["val_loss_ema"] for line in expected_val], rel=1e-5)
        assert len({line["val_loss"] for line in expected_val}) > 1   # the model changed between evaluations
        assert state["val_loss"] == actual_val[-1]["val_loss"] and state["val_step"] == 12


def test_sigterm_on_one_rank_stops_all_ranks_with_a_resumable_checkpoint(tmp_path, demo_data):
    data_root, _ = demo_data
    run_dir = tmp_path / "run"
    process = launch(tmp_path, train_flags(data_root, run_dir, checkpoint_steps=100))
    wait_for(lambda: last_logged_step(run_dir / "logs") >= 3, process, what="step 3")
    os.kill(read_status(run_dir / "logs", 1)["pid"], signal.SIGTERM)   # only rank 1 gets the signal
    output, _ = process.communicate(timeout=180)
    assert process.returncode == 0, output[-3000:]
    states = [read_status(run_dir / "logs", rank) for rank in (0, 1)]
    assert all(s["status"] == "stopped" for s in states), [(s["status"], s["phase"]) for s in states]
    stopped_at = states[0]["step"]
    assert states[1]["step"] == stopped_at and 3 <= stopped_at < 12
    assert [step for step, _ in complete_checkpoints(run_dir / "lora" / "checkpoints")] == [stopped_at]

    # A different configuration is refused, naming what differs, before anything is written: the stopped run's
    # status files stay as they were.
    statuses = [(run_dir / "logs" / f"training_gpu{rank}.json").read_bytes() for rank in (0, 1)]
    code, output = run(tmp_path, train_flags(data_root, run_dir, checkpoint_steps=100, lora_rank=8, resume="latest"))
    assert code != 0   # each rank exits 2; accelerate launch reports any failed rank as 1
    assert "lora_rank: checkpoint 4, this run 8" in output
    assert [(run_dir / "logs" / f"training_gpu{rank}.json").read_bytes() for rank in (0, 1)] == statuses

    code, output = run(tmp_path, train_flags(data_root, run_dir, checkpoint_steps=100, resume="latest"))
    assert code == 0, output[-3000:]
    for rank in (0, 1):
        assert train_steps(run_dir / "logs", rank) == list(range(1, 13))
        assert read_status(run_dir / "logs", rank)["status"] == "finished"


def test_a_corrupt_clip_and_a_deleted_photo_are_skipped_counted_and_named(tmp_path, demo_data):
    """Also: the summary counts and names what was replaced (it said nothing of it)."""
    data_root, _ = demo_data
    broken_root = tmp_path / "broken"
    prepare(broken_root, num_videos=6, num_images=5)
    (broken_root / "catalog" / "media" / "video_003.mp4").write_bytes(b"\x00\x00\x00\x18ftypmp42 not a video" * 10)
    next((broken_root / "catalog" / "media").glob("image_002.*")).unlink()   # metadata row 9
    run_dir = tmp_path / "run"
    code, output = run(tmp_path, train_flags(broken_root, run_dir, checkpoint_steps=100, dataset_repeat=1,
                                             num_epochs=1))
    assert code == 0, output[-3000:]
    states = [read_status(run_dir / "logs", rank) for rank in (0, 1)]
    assert all(s["status"] == "finished" for s in states)
    assert sum(s["skipped_samples"] for s in states) == 2
    reasons = sorted((r for s in states for r in s["skip_reasons"]), key=lambda reason: reason["row"])
    assert [reason["file"] for reason in reasons] == ["media/video_003.mp4", "media/image_002.png"]
    assert "cannot decode" in reasons[0]["reason"] and "No such file" in reasons[1]["reason"]
    seen = sum(s["samples_seen"] for s in states)
    assert (f"replaced as bad media: 2 of {seen} samples ({100 * 2 / seen:.1f}%), from 2 rows: row 4 "
            "(media/video_003.mp4) 1 time, row 9 (media/image_002.png) 1 time") in output, output[-3000:]


def test_mostly_corrupt_media_stops_with_a_clear_error(tmp_path):
    root = tmp_path / "mostly_broken"
    prepare(root, num_videos=6, num_images=5)
    for index in range(6):
        (root / "catalog" / "media" / f"video_{index:03d}.mp4").write_bytes(b"garbage" * 50)
    for image in (root / "catalog" / "media").glob("image_00[0-2].*"):
        image.write_bytes(b"not an image")
    run_dir = tmp_path / "run"
    code, output = run(tmp_path, train_flags(root, run_dir, checkpoint_steps=100, dataset_repeat=3))
    assert code == 1
    states = [read_status(run_dir / "logs", rank) for rank in (0, 1)]
    failed = [s for s in states if s["status"] == "failed"]
    assert failed, [(s["status"], s["phase"]) for s in states]
    assert failed[0]["error"]["type"] == "TooMuchBadMedia"
    assert "could not be decoded" in failed[0]["error"]["message"]
    assert not (run_dir / "lora" / "lora.safetensors").exists()


def test_a_damaged_newest_checkpoint_is_named_and_the_previous_one_resumes_exactly(tmp_path, demo_data):
    """Truncating rank 1's RNG state in the newest checkpoint once resumed 'successfully' with rank 1's noise
    silently different; now --resume latest names the file, falls back, and the result is exact."""
    data_root, _ = demo_data
    run_dir = tmp_path / "run"
    code, output = run(tmp_path, train_flags(data_root, run_dir))
    assert code == 0, output[-3000:]
    checkpoints = run_dir / "lora" / "checkpoints"
    (newest_step, newest), (previous_step, _) = complete_checkpoints(checkpoints)[-1], complete_checkpoints(checkpoints)[-2]
    assert (newest_step, previous_step) == (12, 10)
    expected = load_file(str(run_dir / "lora" / "lora.safetensors"))
    damaged = newest / "random_states_1.pkl"
    damaged.write_bytes(damaged.read_bytes()[:20])

    finished = [(run_dir / "logs" / f"training_gpu{rank}.json").read_bytes() for rank in (0, 1)]
    code, output = run(tmp_path, train_flags(data_root, run_dir, resume=str(newest)))
    assert code != 0 and f"{damaged}: 20 bytes" in output and "damaged" in output   # explicit: refused, file named
    assert [(run_dir / "logs" / f"training_gpu{rank}.json").read_bytes() for rank in (0, 1)] == finished

    code, output = run(tmp_path, train_flags(data_root, run_dir, resume="latest"))
    assert code == 0, output[-3000:]
    assert f"skipping damaged checkpoint step-00000012: {damaged}" in output
    actual = load_file(str(run_dir / "lora" / "lora.safetensors"))
    for key in expected:
        torch.testing.assert_close(actual[key], expected[key], rtol=1e-5, atol=1e-6, msg=key)
    for rank in (0, 1):
        assert train_steps(run_dir / "logs", rank) == list(range(1, 13)), "each step exactly once"
