"""A run deletes or replaces only its own checkpoints: a fresh run in a folder holding another run's is refused
(or sets them aside with --start_over), publishing never replaces another run's folder, pruning spares them."""

from __future__ import annotations

import hashlib
import json

import pytest

from diffsynth_mbc.data.demo import prepare
from diffsynth_mbc.run_layout import checkpoint_folder_name
from diffsynth_mbc.training.checkpoints.folder import complete_checkpoints, temp_path
from diffsynth_mbc.training.checkpoints.owner import (check_claim, check_replaceable, foreign_checkpoints,
                                                      foreign_outputs, lora_file_owner, refusal, set_aside)
from diffsynth_mbc.training.checkpoints.state import prune, publish
from e2e_helpers import REPO
from forked_ranks import run_training


def make_checkpoint(root, step, run_id, notes=None):
    temporary = temp_path(root, step, run_id)
    temporary.mkdir(parents=True)
    (temporary / "model.safetensors").write_bytes(b"x")
    if notes:
        (temporary / "notes.txt").write_text(notes)
    return publish(temporary, {"step": step, "epoch": 0, "batches_in_epoch": 0, "run_id": run_id})


def test_another_runs_checkpoints_are_found_named_and_set_aside_not_deleted(tmp_path):
    make_checkpoint(tmp_path, 4, "run-a")
    kept = make_checkpoint(tmp_path, 8, "run-a", notes="the good one")
    (kept / "KEEP").touch()
    make_checkpoint(tmp_path, 2, "run-b")
    foreign = foreign_checkpoints(tmp_path, "run-b")
    assert [(f.name, other) for f, other in foreign] == [("step-00000004", "run-a"), ("step-00000008", "run-a")]
    message = refusal(tmp_path, foreign)
    assert "2 checkpoint(s) or LoRA file(s) of run-a (step-00000004, step-00000008)" in message
    assert "--resume latest" in message and "--start_over true" in message
    # the advice names every folder of the run, and that the others follow an --output_path given alone
    named = refusal(tmp_path, foreign, "runs/demo/lora", "runs/demo/training_logs")
    assert "--output_path (its checkpoint and log folders follow it unless --checkpoint_dir or --log_dir is " \
           "given" in named
    assert f"--output_path is now runs/demo/lora; --checkpoint_dir is now {tmp_path}; --log_dir is now " \
           "runs/demo/training_logs" in named
    moved = set_aside(foreign)
    assert [p.relative_to(tmp_path).as_posix() for p in moved] == ["replaced-run-a/step-00000004",
                                                                   "replaced-run-a/step-00000008"]
    assert (tmp_path / "replaced-run-a" / "step-00000008" / "notes.txt").read_text() == "the good one"
    assert [f.name for _s, f in complete_checkpoints(tmp_path)] == ["step-00000002"]


def test_publishing_never_replaces_a_folder_another_run_wrote(tmp_path):
    theirs = make_checkpoint(tmp_path, 8, "run-a", notes="theirs")
    with pytest.raises(FileExistsError, match="not written by run run-b"):
        make_checkpoint(tmp_path, 8, "run-b")
    assert (theirs / "notes.txt").read_text() == "theirs"
    check_replaceable(theirs, "run-a")           # its own run may replace it
    mine = make_checkpoint(tmp_path, 8, "run-a", notes="again")
    assert (mine / "notes.txt").read_text() == "again"


def test_pruning_removes_only_the_runs_own_checkpoints(tmp_path):
    theirs = make_checkpoint(tmp_path, 1, "run-a")
    for step in (2, 3, 4):
        make_checkpoint(tmp_path, step, "run-b")
    removed = prune(tmp_path, keep_last=1, run_id="run-b")
    assert sorted(p.name for p in removed) == ["step-00000002", "step-00000003"]
    assert theirs.exists()


@pytest.mark.slow
def test_a_fresh_run_refuses_another_runs_checkpoints_and_start_over_moves_them_aside(tmp_path):
    data = tmp_path / "data"
    prepare(data, num_videos=2, num_images=2)
    run_dir = tmp_path / "run"

    def train(*extra):
        flags = ["--config", str(REPO / "configs" / "train_demo.yaml"),
                                     "--dataset_base_path", str(data / "catalog"),
                                     "--dataset_metadata_path", str(data / "metadata" / "metadata.csv"),
                                     "--output_path", str(run_dir / "lora"), "--log_dir", str(run_dir / "logs"),
                                     "--num_epochs", "1", "--checkpoint_steps", "2", "--val_metadata_path",
                                     str(data / "metadata" / "metadata.csv"), "--val_steps", "2", "--val_samples", "2",
                                     *extra]
        return run_training(tmp_path, flags, timeout=300, OMP_NUM_THREADS=1)

    first = train("--run_id", "first-run")
    assert first.returncode == 0, first.stderr[-3000:]
    checkpoints = run_dir / "lora" / "checkpoints"
    newest = complete_checkpoints(checkpoints)[-1][1]
    (newest / "KEEP").touch()
    (newest / "notes.txt").write_text("a user's notes")
    finished = snapshot(run_dir)
    lora_files = {name: (run_dir / "lora" / name).read_bytes()
                  for name in ("lora.safetensors", "epoch-001.safetensors", "lora-best.safetensors")}

    # Refusals that need only files come before anything loads or is written: the finished run's files, status
    # files included, stay byte for byte (a refused resume used to mark the finished run FAILED).
    other_settings = train("--resume", "latest", "--learning_rate", "0.002")
    assert other_settings.returncode != 0 and "was made with a different configuration" in other_settings.stderr
    assert "learning_rate: checkpoint 0.001, this run 0.002" in other_settings.stderr, other_settings.stderr[-3000:]
    assert snapshot(run_dir) == finished
    again = train("--run_id", "second-run")
    assert again.returncode != 0          # each rank exits 2; accelerate reports a failed rank as 1
    assert "checkpoint(s) or LoRA file(s) of first-run" in again.stderr and "--start_over true" in again.stderr
    assert snapshot(run_dir) == finished

    over = train("--run_id", "second-run", "--start_over", "true")
    assert over.returncode == 0, over.stderr[-3000:]
    aside = checkpoints / "replaced-first-run" / newest.name
    assert (aside / "notes.txt").read_text() == "a user's notes" and (aside / "KEEP").exists()
    for name, content in lora_files.items():   # the earlier run's LoRA files are kept beside its checkpoints
        assert (checkpoints / "replaced-first-run" / name).read_bytes() == content, name
    assert lora_file_owner(run_dir / "lora" / "lora.safetensors") == "second-run"
    owners = {json.loads((f / "checkpoint.json").read_text())["run_id"] for _s, f in complete_checkpoints(checkpoints)}
    assert owners == {"second-run"} and checkpoint_folder_name(2) in {f.name for _s, f in complete_checkpoints(checkpoints)}


def snapshot(folder) -> dict:
    """Every file under ``folder``: its bytes' digest."""
    return {path.relative_to(folder).as_posix(): hashlib.sha256(path.read_bytes()).hexdigest()
            for path in sorted(folder.rglob("*")) if path.is_file()}


def test_another_runs_lora_files_are_found_by_their_metadata_and_set_aside_beside_its_checkpoints(tmp_path):
    import torch

    from diffsynth_mbc.atomic import atomic_save_safetensors

    output, root = tmp_path / "lora", tmp_path / "lora" / "checkpoints"
    output.mkdir()
    for name, run_id in (("lora.safetensors", "run-a"), ("epoch-001.safetensors", "run-a"),
                         ("step-5_ema.safetensors", None), ("mine.safetensors", "run-a"),
                         ("step-2.safetensors", "run-b")):
        atomic_save_safetensors(output / name, {"w": torch.zeros(2)}, {"run_id": run_id} if run_id else {})
    make_checkpoint(root, 4, "run-a")
    foreign = foreign_outputs(root, output, "run-b")
    assert [(path.name, other) for path, other in foreign] == [
        ("step-00000004", "run-a"), ("epoch-001.safetensors", "run-a"), ("lora.safetensors", "run-a"),
        ("step-5_ema.safetensors", None)]   # not mine.safetensors: the run never writes that name
    with pytest.raises(ValueError, match=r"4 checkpoint\(s\) or LoRA file\(s\) of an unknown run, run-a"):
        check_claim(root, output, "run-b", start_over=False)
    check_claim(root, output, "run-b", start_over=True)
    moved = set_aside(foreign, root)
    assert sorted(p.relative_to(root).as_posix() for p in moved) == [
        "replaced-run-a/epoch-001.safetensors", "replaced-run-a/lora.safetensors", "replaced-run-a/step-00000004",
        "replaced-unknown-run/step-5_ema.safetensors"]
    assert sorted(p.name for p in output.iterdir()) == ["checkpoints", "mine.safetensors", "step-2.safetensors"]
