"""A stop request on an epoch's last step keeps that epoch's LoRA file, and one on the run's last step leaves a run
that a resume finishes. 2 forked CPU ranks (gloo) of the demo preset: 6 optimizer steps an epoch, 2 epochs. The stop
is a real one: rank 0 sends itself SIGTERM while its step computes, as stop.sh does, and the step goes on once the
rank's signal thread has it, so every rank stops after that step."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from diffsynth_mbc.run_layout import checkpoint_folder_name
from e2e_helpers import demo_flags, read_history, read_status
from forked_ranks import run_training

pytestmark = pytest.mark.slow

STEPS_PER_EPOCH, TOTAL_STEPS = 6, 12

STOP_AT = """
import os
import signal

from diffsynth_mbc.training import recipe
from diffsynth_mbc.training.components.protocol import Component

STOP_AT_STEP = int(os.environ["STOP_AT_STEP"])


class StopRequestAt(Component):
    name = "stop_request_at"

    def __init__(self, rank, signals):
        self.rank, self.signals = rank, signals

    def on_gradients(self, step, grad_norm, max_norm):
        if step == STOP_AT_STEP and self.rank == 0:
            os.kill(os.getpid(), signal.SIGTERM)
            # received by the rank's signal thread: the step goes on once it is, as a stop that came during it
            assert self.signals.requested.wait(60)


built = recipe.TrainingRecipe._components


def with_a_stop(self):
    return built(self) + [StopRequestAt(self.parts.accelerator.process_index, self.signals)]


recipe.TrainingRecipe._components = with_a_stop
"""


def checkpoint_lora(run, step: int) -> dict:
    return load_file(str(run / "lora" / "checkpoints" / checkpoint_folder_name(step) / "lora.safetensors"))


def assert_equal_tensors(actual: dict, expected: dict) -> None:
    assert actual.keys() == expected.keys()
    for key in expected:
        assert torch.equal(actual[key], expected[key]), key


def test_a_stop_on_an_epochs_last_step_keeps_its_file_and_one_on_the_runs_last_step_is_finished_by_a_resume(
        demo_data, tmp_path):
    root, _ = demo_data
    run = tmp_path / "run"
    flags = demo_flags(root, run, checkpoint_steps=100)   # no scheduled checkpoint: the stop's is the only one
    epoch_file = run / "lora" / "epoch-001.safetensors"

    stopped = run_training(tmp_path, flags, prelude=STOP_AT, timeout=400, OMP_NUM_THREADS=1,
                           STOP_AT_STEP=STEPS_PER_EPOCH)
    assert stopped.returncode == 0, stopped.stderr[-3000:]
    assert [read_status(run / "logs", rank)["status"] for rank in (0, 1)] == ["stopped", "stopped"]
    # the epoch ended with the stop's step: its file is written as at any epoch's end, the LoRA of that step
    assert epoch_file.is_file(), sorted(path.name for path in (run / "lora").iterdir())
    assert_equal_tensors(load_file(str(epoch_file)), checkpoint_lora(run, STEPS_PER_EPOCH))
    assert "epoch 1/2 done" in stopped.stdout + stopped.stderr
    # ... before the status says how the run stopped (the file's saving was the phase it kept)
    assert read_status(run / "logs", 0)["phase"].startswith(f"stopped at step {STEPS_PER_EPOCH} after a stop request")

    # the resume stops again, on the run's last step: the stop's checkpoint, no final LoRA yet
    resumed = run_training(tmp_path, flags + ["--resume", "latest"], prelude=STOP_AT, timeout=400,
                           OMP_NUM_THREADS=1, STOP_AT_STEP=TOTAL_STEPS)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert [read_status(run / "logs", rank)["status"] for rank in (0, 1)] == ["stopped", "stopped"]
    assert (run / "lora" / "epoch-002.safetensors").is_file()
    assert_equal_tensors(load_file(str(epoch_file)), checkpoint_lora(run, STEPS_PER_EPOCH))   # kept as it was

    # a stopped run is not a finished one: its resume trains nothing more and writes what the end writes
    finished = run_training(tmp_path, flags + ["--resume", "latest"], timeout=400, OMP_NUM_THREADS=1)
    assert finished.returncode == 0, finished.stderr[-3000:]
    assert [read_status(run / "logs", rank)["status"] for rank in (0, 1)] == ["finished", "finished"]
    assert_equal_tensors(load_file(str(run / "lora" / "lora.safetensors")), checkpoint_lora(run, TOTAL_STEPS))
    for rank in (0, 1):
        assert [line["step"] for line in read_history(run / "logs", rank)] == list(range(1, TOTAL_STEPS + 1))
