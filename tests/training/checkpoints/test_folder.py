import json

import pytest

from diffsynth_mbc.run_layout import checkpoint_folder_name
from diffsynth_mbc.training.checkpoints.folder import complete_checkpoints, find_latest, resolve_resume, temp_path
from diffsynth_mbc.training.checkpoints.state import fingerprint_differences, prune, publish, truncate_history
from diffsynth_mbc.training.components.schedules import CheckpointSchedule


def make_checkpoint(root, step, complete=True):
    folder = temp_path(root, step, "run-1")
    folder.mkdir(parents=True)
    (folder / "lora.safetensors").write_bytes(b"x")
    return publish(folder, {"step": step}) if complete else folder


def test_latest_is_the_highest_complete_step(tmp_path):
    for step in (4, 12, 8):
        make_checkpoint(tmp_path, step)
    assert find_latest(tmp_path).name == checkpoint_folder_name(12)
    assert not any(p.name.startswith(".tmp-") for p in tmp_path.iterdir())


def test_a_checkpoint_killed_mid_save_is_never_latest(tmp_path):
    make_checkpoint(tmp_path, 4)
    make_checkpoint(tmp_path, 8, complete=False)            # temp folder left by a crash
    manifestless = tmp_path / checkpoint_folder_name(9)             # a renamed folder without its manifest
    manifestless.mkdir()
    torn = tmp_path / checkpoint_folder_name(10)
    torn.mkdir()
    (torn / "checkpoint.json").write_text('{"step": 1')     # torn manifest
    assert find_latest(tmp_path).name == checkpoint_folder_name(4)
    assert resolve_resume("latest", tmp_path).name == checkpoint_folder_name(4)
    with pytest.raises(ValueError, match="not a complete checkpoint"):
        resolve_resume(str(manifestless), tmp_path)


def test_resume_latest_without_checkpoints_says_where_it_looked(tmp_path):
    with pytest.raises(ValueError, match=str(tmp_path)):
        resolve_resume("latest", tmp_path)


def test_prune_keeps_the_last_k_and_kept_ones_and_removes_temp_folders(tmp_path):
    for step in (1, 2, 3, 4, 5):
        make_checkpoint(tmp_path, step)
    (tmp_path / checkpoint_folder_name(1) / "KEEP").touch()
    make_checkpoint(tmp_path, 6, complete=False)
    prune(tmp_path, keep_last=2)
    assert [step for step, _ in complete_checkpoints(tmp_path)] == [1, 4, 5]
    assert not any(p.name.startswith(".tmp-") for p in tmp_path.iterdir())


def test_fingerprint_differences_name_each_setting_but_not_the_hardware():
    """The processes and the precision may change at a resume (training/plan/elastic.py): not differences."""
    saved = {"world_size": 2, "lora_rank": 32, "metadata_sha256": "a", "mixed_precision": "fp16", "seed": 1}
    current = {"world_size": 4, "lora_rank": 32, "metadata_sha256": "b", "mixed_precision": "bf16", "seed": 2}
    lines = fingerprint_differences(saved, current)
    assert lines == ["seed: checkpoint 1, this run 2", "metadata_sha256: checkpoint 'a', this run 'b'"]


def test_schedule_by_steps_and_by_time():
    now = [0.0]
    schedule = CheckpointSchedule(every_steps=5, every_minutes=1, monotonic=lambda: now[0])
    assert schedule.due_by_steps(10) and not schedule.due_by_steps(11)
    assert not schedule.due_by_time()
    now[0] = 61.0
    assert schedule.due_by_time()
    schedule.saved()
    assert not schedule.due_by_time()
    assert not CheckpointSchedule(None, None).enabled


def test_truncate_history_drops_steps_after_the_checkpoint_and_torn_lines(tmp_path):
    path = tmp_path / "training_gpu0.jsonl"
    lines = [json.dumps({"step": s, "loss": 0.1}) for s in range(1, 8)] + [json.dumps({"kind": "val", "step": 4})]
    path.write_text("\n".join(lines) + "\n" + '{"step": 8, "lo')
    assert truncate_history(path, 4) == 5
    assert [json.loads(line)["step"] for line in path.read_text().splitlines()] == [1, 2, 3, 4, 4]


def test_settings_a_checkpoint_did_not_record_are_not_compared():
    """Checkpoints saved before the optimisation settings were recorded still resume; recorded ones are compared."""
    assert fingerprint_differences({"world_size": 2}, {"world_size": 2, "learning_rate": 1e-4}) == []
    assert fingerprint_differences({"learning_rate": 1e-4}, {"learning_rate": 1e-2}) == [
        "learning_rate: checkpoint 0.0001, this run 0.01"]
