"""A resume is exact or it does not happen: damaged checkpoints are named and skipped (or refused)."""

from __future__ import annotations

import json

import pytest

from diffsynth_mbc.run_layout import checkpoint_folder_name
from diffsynth_mbc.training.checkpoints.folder import resolve_resume
from diffsynth_mbc.training.checkpoints.integrity import damage, inventory


def make_checkpoint(root, step, world_size=2, listed=True):
    folder = root / checkpoint_folder_name(step)
    folder.mkdir(parents=True)
    for name, size in (("optimizer.bin", 4000), ("lora.safetensors", 800), ("model.safetensors", 800)):
        (folder / name).write_bytes(bytes([step % 251]) * size)
    for rank in range(world_size):
        (folder / f"random_states_{rank}.pkl").write_bytes(b"rng-%d-%d" % (step, rank))
    manifest = {"step": step, "epoch": 0, "batches_in_epoch": 0, "world_size": world_size}
    if listed:
        manifest["files"] = inventory(folder)
    (folder / "checkpoint.json").write_text(json.dumps(manifest))
    return folder


@pytest.mark.parametrize("broken,expected", [
    (lambda f: (f / "random_states_1.pkl").write_bytes(b"rng"), "random_states_1.pkl: 3 bytes"),
    (lambda f: (f / "optimizer.bin").write_bytes(b"x" * 10), "optimizer.bin: 10 bytes"),
    (lambda f: (f / "lora.safetensors").write_bytes(b"y" * 800), "lora.safetensors: content differs"),
    (lambda f: (f / "random_states_1.pkl").unlink(), "random_states_1.pkl: missing"),
])
def test_latest_falls_back_to_the_newest_intact_checkpoint_naming_the_damaged_file(tmp_path, broken, expected):
    make_checkpoint(tmp_path, 4)
    newest = make_checkpoint(tmp_path, 8)
    broken(newest)
    reports = []
    assert resolve_resume("latest", tmp_path, report=reports.append).name == checkpoint_folder_name(4)
    assert len(reports) == 1 and expected in reports[0] and checkpoint_folder_name(8) in reports[0]


def test_an_explicit_damaged_checkpoint_is_refused_naming_the_file(tmp_path):
    folder = make_checkpoint(tmp_path, 8)
    (folder / "optimizer.bin").write_bytes(b"")
    with pytest.raises(ValueError, match=r"damaged: .*optimizer.bin: 0 bytes, 4000 when it was saved"):
        resolve_resume(str(folder), tmp_path)


def test_a_checkpoint_missing_a_ranks_state_is_damaged_and_one_of_fewer_ranks_is_not(tmp_path):
    """What several nodes without a shared checkpoint folder used to publish: rank 0's state only, of 2 ranks. A
    checkpoint of 1 rank resumed on 2 is whole: a resume on another number of ranks (training/plan/elastic.py)."""
    folder = make_checkpoint(tmp_path, 4, world_size=1)
    manifest = json.loads((folder / "checkpoint.json").read_text())
    assert damage(folder, manifest) is None
    problem = damage(folder, {**manifest, "world_size": 2})
    assert "random_states_1.pkl: missing (the state of rank 1" in problem


def test_every_checkpoint_damaged_is_an_error_not_a_silent_fresh_start(tmp_path):
    folder = make_checkpoint(tmp_path, 4)
    (folder / "lora.safetensors").unlink()
    with pytest.raises(ValueError, match="every checkpoint .* is damaged"):
        resolve_resume("latest", tmp_path)


def test_checkpoints_saved_before_file_lists_still_resume(tmp_path):
    make_checkpoint(tmp_path, 4, listed=False)
    assert resolve_resume("latest", tmp_path).name == checkpoint_folder_name(4)


@pytest.mark.parametrize("broken, why", [
    (lambda f: (f / "checkpoint.json").unlink(), "is missing"),
    (lambda f: (f / "checkpoint.json").write_text('{"step": 8, "epo'), "cannot be read"),
])
def test_a_newest_checkpoint_without_a_readable_manifest_is_named_skipped_and_moved_aside(tmp_path, broken, why):
    """It used to be skipped without a word; the resumed run then failed at that step, unable to publish over a
    folder 'not written by' its own run."""
    from diffsynth_mbc.training.checkpoints.folder import set_aside_unreadable

    make_checkpoint(tmp_path, 4)
    newest = make_checkpoint(tmp_path, 8)
    (newest / "notes.txt").write_text("kept")
    broken(newest)
    reports = []
    assert resolve_resume("latest", tmp_path, report=reports.append).name == checkpoint_folder_name(4)
    assert reports == [f"skipping {checkpoint_folder_name(8)}: its checkpoint.json {why}" + (
        " (damaged or cut off)" if why == "cannot be read" else "")]
    moved = set_aside_unreadable(tmp_path, after_step=4)
    assert [p.name for p in moved] == [f"damaged-{checkpoint_folder_name(8)}"]
    assert (moved[0] / "notes.txt").read_text() == "kept" and not newest.exists()
    assert set_aside_unreadable(tmp_path, after_step=4) == []
