"""The recipe's glue on a real 2-rank demo run with one more component, a recorder: its hooks are called in the
recipe's order on every rank alike (``at_start`` once, then each step's gradients, votes and ``after_step``, a
validation's ``after_validation``, ``at_end`` once), its decisions are obeyed (a checkpoint, a LoRA file, an early
stop ending the run with a checkpoint), and its state goes into the checkpoint under its name and comes back on a
resume."""

from __future__ import annotations

import json

import pytest

from e2e_helpers import demo_flags, read_status
from forked_ranks import run_training

pytestmark = pytest.mark.slow

RECORDER = """
import json
from diffsynth_mbc.training import recipe
from diffsynth_mbc.training.components.protocol import Component, Decision, Stop


class Recorder(Component):
    name = "recorder"

    def __init__(self, path):
        self.path, self.state = path, {"steps_seen": 0, "loaded": None}

    def say(self, *what):
        with open(self.path, "a") as handle:
            handle.write(json.dumps(what) + "\\n")

    def votes(self, result):
        self.say("votes")
        return {"recorder": 1}

    def at_start(self, context):
        self.say("at_start", context.step)

    def on_gradients(self, step, grad_norm, max_norm):
        self.say("on_gradients", step)

    def after_step(self, context):
        self.state["steps_seen"] += 1
        self.say("after_step", context.step, context.agreed["recorder"])
        if context.step == 5:
            return Decision(checkpoint=True, lora_file="recorded.safetensors")
        if context.step == 7:
            return Decision(stop=Stop.EARLY)
        return None

    def after_validation(self, context):
        self.say("after_validation", context.step, context.validation.val_loss > 0)

    def at_end(self, context):
        self.say("at_end", context.step, context.stop.name if context.stop else None)

    def state_dict(self):
        return dict(self.state)

    def load_state_dict(self, state):
        self.state["loaded"] = state


built = recipe.TrainingRecipe._components


def with_recorder(self):
    rank = self.parts.accelerator.process_index
    return built(self) + [Recorder(f"{self.options.output_path}/recorder-{rank}.jsonl")]


recipe.TrainingRecipe._components = with_recorder
"""


def calls(run, rank):
    return [json.loads(line) for line in (run / "lora" / f"recorder-{rank}.jsonl").read_text().splitlines()]


def test_hooks_in_order_decisions_obeyed_and_state_kept(demo_data, tmp_path):
    root, val = demo_data
    run = tmp_path / "run"
    flags = demo_flags(root, run, val_metadata_path=val, val_base_path=root / "val" / "catalog", val_steps=4,
                       val_samples=2)
    result = run_training(tmp_path, flags, prelude=RECORDER, timeout=400, OMP_NUM_THREADS=1)
    assert result.returncode == 0, result.stderr[-3000:]
    expected = [["at_start", 0]]
    for step in range(1, 8):
        expected += [["on_gradients", step], ["votes"], ["after_step", step, 2]]
        if step == 4:
            expected.append(["after_validation", 4, True])
    expected += [["after_validation", 7, True], ["at_end", 7, "EARLY"]]   # the end validates its step
    assert calls(run, 0) == expected
    assert calls(run, 1) == expected
    for rank in (0, 1):
        state = read_status(run / "logs", rank)
        assert state["status"] == "finished" and state["step"] == 7 and state["total_steps"] == 12
    checkpoints = run / "lora" / "checkpoints"
    assert sorted(f.name for f in checkpoints.glob("step-*")) == ["step-00000005", "step-00000007"]   # keep 2
    manifest = json.loads((checkpoints / "step-00000005" / "checkpoint.json").read_text())
    assert manifest["components"]["recorder"] == {"steps_seen": 5, "loaded": None}
    assert (checkpoints / "step-00000007").is_dir()   # the early stop's checkpoint
    assert (run / "lora" / "recorded.safetensors").is_file() and (run / "lora" / "lora.safetensors").is_file()

    resumed = run_training(tmp_path, flags + ["--resume", str(checkpoints / "step-00000005")], prelude=RECORDER,
                           timeout=400, OMP_NUM_THREADS=1)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    again = calls(run, 0)[len(expected):]
    assert again[0] == ["at_start", 5]
    assert [call for call in again if call[0] == "after_step"] == [["after_step", 6, 2], ["after_step", 7, 2]]
    manifest = json.loads((checkpoints / "step-00000007" / "checkpoint.json").read_text())
    assert manifest["components"]["recorder"] == {"steps_seen": 2, "loaded": {"steps_seen": 5, "loaded": None}}
