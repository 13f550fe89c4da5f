"""A checkpoint written by the training before it had components (``fixtures/before_components``: validation, early
stop, resolution stages and an EMA on, killed after step 7) resumes under the components to what the run gave
uninterrupted: the same LoRA, the same ``lora-best``, the same best step and early stop.

The fixture was computed on another machine: its first 6 steps' float results may differ from this one's in the
last bits, so the tensors are compared to a tolerance far below what a training step changes."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from e2e_helpers import demo_flags, read_status
from forked_ranks import run_training

pytestmark = pytest.mark.slow
FIXTURE = Path(__file__).parent / "fixtures" / "before_components"
WRITTEN_UNDER = "/tmp/mbc-old-checkpoint"


def moved_fixture(target: Path) -> Path:
    """The fixture copied to ``target``, the paths its files name moved with it."""
    shutil.copytree(FIXTURE, target)
    for path in target.rglob("*.json*"):
        text = path.read_text(encoding="utf-8")
        path.write_text(text.replace(f"{WRITTEN_UNDER}/killed", str(target / "run"))
                        .replace(WRITTEN_UNDER, str(target)), encoding="utf-8")
    return target


def assert_close_tensors(path_a: Path, path_b: Path) -> None:
    a, b = load_file(str(path_a)), load_file(str(path_b))
    assert a.keys() == b.keys()
    for key in a:
        assert torch.allclose(a[key], b[key], rtol=1e-4, atol=1e-7), key


def test_a_checkpoint_before_components_resumes_to_the_uninterrupted_run(tmp_path):
    root = moved_fixture(tmp_path / "moved")
    run = root / "run"
    manifest = json.loads((run / "lora" / "checkpoints" / "step-00000006" / "checkpoint.json").read_text())
    assert "components" not in manifest and manifest["best_so_far"]["without"] == 2   # the layout before
    flags = demo_flags(root / "data" / "demo", run, num_epochs=4,
                       val_metadata_path=root / "data" / "val" / "metadata" / "metadata.csv",
                       val_base_path=root / "data" / "val" / "catalog", val_steps=2, val_samples=4,
                       checkpoint_steps=2, keep_checkpoints=10, early_stop=3, early_stop_min_delta=0.05,
                       resolution_stages="32x32:0.1", ema_decay=0.9, resume="latest")
    resumed = run_training(tmp_path, flags, timeout=400, OMP_NUM_THREADS=1)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    expected = json.loads((FIXTURE / "expected" / "summary.json").read_text())
    assert_close_tensors(run / "lora" / "lora.safetensors", FIXTURE / "expected" / "lora.safetensors")
    assert_close_tensors(run / "lora" / "lora-best.safetensors", FIXTURE / "expected" / "lora-best.safetensors")
    for rank in (0, 1):
        state = read_status(run / "logs", rank)
        assert state["resumed_from"]["step"] == 6 and state["step"] == expected["steps"]
        assert state["best"]["step"] == expected["best_step"]
        assert state["best"]["val_loss"] == pytest.approx(expected["best_val_loss"], rel=1e-6)
        assert {key: state["early_stop"][key] for key in ("step", "best_step", "since_step", "patience")} == \
            {key: expected["early_stop"][key] for key in ("step", "best_step", "since_step", "patience")}
