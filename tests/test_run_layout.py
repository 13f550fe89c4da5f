"""The run's layout: what a writer names, its reader finds (every name is made and parsed in run_layout.py)."""

from __future__ import annotations

import pytest

from diffsynth_mbc import run_layout as layout


def test_every_lora_file_a_run_writes_is_one_its_readers_find():
    written = [layout.FINAL_LORA, layout.BEST_LORA, layout.epoch_file_name(0, 12), layout.epoch_file_name(11, 1000),
               layout.step_file_name(40)]
    for name in written + [layout.ema_twin_name(name) for name in written]:
        found = layout.LORA_FILE.match(name)
        assert found and bool(found["ema"]) == name.endswith(f"{layout.EMA_TWIN_SUFFIX}{layout.LORA_SUFFIX}"), name
    assert layout.epoch_file_name(0, 12) == "epoch-001.safetensors"
    assert layout.ema_twin_name(layout.step_file_name(4)) == "step-4_ema.safetensors"
    for other in ("mine.safetensors", "lora.safetensors.tmp", "step-.safetensors", "epoch-1.pt", "lora_ema"):
        assert layout.LORA_FILE.match(other) is None, other


@pytest.mark.parametrize("step", [0, 7, 1234, 99_999_999])
def test_a_step_folder_gives_back_its_step(step):
    assert layout.step_of_folder(layout.checkpoint_folder_name(step)) == step
    assert layout.step_of_folder(layout.sample_set_name(step)) == step
    assert layout.published_name(layout.checkpoint_temp_name(step, "run-1")) == layout.checkpoint_folder_name(step)


@pytest.mark.parametrize("name", ["step-40", "step-000000400", "step-00000040\n", "damaged-step-00000040",
                                  ".tmp-step-00000040.run", "step-0000004x", "step-٠٠٠٠٠٠٤٠"])
def test_other_folders_are_no_step_folder(name):
    assert layout.step_of_folder(name) is None


def test_status_and_history_names_give_back_their_rank():
    for rank in (0, 3, 65_536):
        assert layout.rank_of_status_file(layout.status_file_name(rank)) == rank
        assert layout.rank_of_status_file(layout.history_file_name(rank)) is None   # the history is no status file
        assert layout.history_file_name(rank) == layout.status_file_name(rank) + "l"
    assert layout.status_file_name(2) == "training_gpu2.json" and layout.STATUS_FILE_GLOB == "training_gpu*.json"
    for other in ("training_gpu.json", "training_gpuX.json", ".training_gpu0.json.abc.tmp", "training_gpu0.json.d"):
        assert layout.rank_of_status_file(other) is None, other


def test_old_histories_and_locks_are_named_per_rank_and_node(tmp_path):
    for name in (layout.old_history_name(1, "20250101-120000"), layout.old_history_name(1, "20250101-120000-2"),
                 layout.old_history_name(10, "20250101-120000"), layout.history_file_name(1)):
        (tmp_path / name).touch()
    assert sorted(path.name for path in tmp_path.glob(layout.old_histories_glob(1))) == [
        "training_gpu1.20250101-120000-2.jsonl.old", "training_gpu1.20250101-120000.jsonl.old"]
    assert [layout.lock_name(node) for node in (0, 2)] == [".train.lock", ".train.node2.lock"]
    assert layout.lock_record_name(layout.lock_name(2)) == ".train.node2.pid"
