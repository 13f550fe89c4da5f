"""The components' protocol (pure): decisions merge with a stop request beating an early stop, hooks run in the
components' order and the ones after a stop see it; the schedules' decisions; each component's saved state read
back from a checkpoint's manifest, in the layout before components too."""

from __future__ import annotations

import threading
from types import SimpleNamespace

from diffsynth_mbc.training.checkpoints.state import component_states
from diffsynth_mbc.training.components.protocol import (CONTINUE, Component, Decision, Stop, StepContext, StepResult,
                                                        run_hook)
from diffsynth_mbc.training.components.schedules import CheckpointSchedule, StepLoraFiles, StopRequests


def test_decisions_merge_and_a_stop_request_beats_an_early_stop():
    assert (CONTINUE | None) == CONTINUE
    assert Decision(checkpoint=True) | Decision(lora_file="step-4.safetensors") == Decision(
        checkpoint=True, lora_file="step-4.safetensors")
    assert (Decision(stop=Stop.EARLY) | Decision(stop=Stop.REQUESTED)).stop is Stop.REQUESTED
    assert (Decision(stop=Stop.REQUESTED) | Decision(stop=Stop.EARLY)).stop is Stop.REQUESTED
    assert (CONTINUE | Decision(stop=Stop.EARLY)).stop is Stop.EARLY


class Recorder(Component):
    def __init__(self, name, calls, decision=None):
        self.name, self.calls, self.decision = name, calls, decision

    def after_step(self, context):
        self.calls.append((self.name, context.stop))
        return self.decision


def test_hooks_run_in_order_and_the_components_after_a_stop_see_it():
    calls = []
    components = [Recorder("a", calls), Recorder("b", calls, Decision(stop=Stop.EARLY)), Recorder("c", calls),
                  Recorder("d", calls, Decision(checkpoint=True))]
    context = StepContext(step=3, epoch=0, total_steps=10)
    decision = run_hook(components, "after_step", context)
    assert calls == [("a", None), ("b", None), ("c", Stop.EARLY), ("d", Stop.EARLY)]
    assert decision == Decision(checkpoint=True, stop=Stop.EARLY)


def context(step, **agreed):
    return StepContext(step=step, epoch=0, total_steps=100, agreed=agreed,
                       result=StepResult(loss=0.5, lr=1e-4, grad_norm=1.0, skipped=False, samples=1, tokens=1))


def test_the_schedules_decide_checkpoints_lora_files_and_stops():
    now = [0.0]
    schedule = CheckpointSchedule(every_steps=4, every_minutes=1, monotonic=lambda: now[0])
    assert schedule.votes(context(1).result) == {"checkpoint_time": 0}
    assert schedule.after_step(context(1, checkpoint_time=0)) is None
    assert schedule.after_step(context(4, checkpoint_time=0)) == Decision(checkpoint=True)
    now[0] = 61.0
    assert schedule.votes(context(5).result) == {"checkpoint_time": 1}
    assert schedule.after_step(context(5, checkpoint_time=0)) is None   # no rank's clock was due
    assert schedule.after_step(context(6, checkpoint_time=2)) == Decision(checkpoint=True)
    assert schedule.votes(context(7).result) == {"checkpoint_time": 0}   # the clock starts again at the save
    assert StepLoraFiles(3).after_step(context(6)) == Decision(lora_file="step-6.safetensors")
    assert StepLoraFiles(None).after_step(context(6)) is None
    signals = SimpleNamespace(requested=threading.Event(), preempted=False, describe=lambda: "SIGTERM")
    stops = StopRequests(signals)
    assert stops.votes(context(1).result) == {"stop": 0, "preempted": 0}
    assert stops.after_step(context(1, stop=0, preempted=0)) is None
    signals.requested.set()
    assert stops.votes(context(1).result) == {"stop": 1, "preempted": 0}
    assert stops.after_step(context(2, stop=1, preempted=0)) == Decision(stop=Stop.REQUESTED)
    assert stops.outcome(2) == ("stopped", "stopped at step 2 after a stop request (SIGTERM); resume with --resume "
                                           "latest")


def test_a_preemption_on_any_rank_ends_every_rank_preempted():
    """The scheduler's signal reached rank 0 only (or first): rank 1, which saw a stop made on another rank, ends
    preempted too, so the run is one status everywhere."""
    warned = SimpleNamespace(requested=threading.Event(), preempted=True,
                             describe=lambda: "SIGUSR1: the scheduler's warning before the job's end")
    warned.requested.set()
    others = SimpleNamespace(requested=threading.Event(), preempted=False, describe=lambda: "made on another rank")
    ranks = [StopRequests(warned), StopRequests(others)]
    votes = [rank.votes(context(5).result) for rank in ranks]
    assert votes == [{"stop": 1, "preempted": 1}, {"stop": 0, "preempted": 0}]
    agreed = {key: sum(vote[key] for vote in votes) for key in votes[0]}
    assert all(rank.after_step(context(5, **agreed)) == Decision(stop=Stop.REQUESTED) for rank in ranks)
    assert [rank.outcome(5) for rank in ranks] == [
        ("preempted", "preempted at step 5 (SIGUSR1: the scheduler's warning before the job's end); a checkpoint was "
                      "saved: the requeued job goes on from it with --resume latest"),
        ("preempted", "preempted at step 5 (made on another rank); a checkpoint was saved: the requeued job goes on "
                      "from it with --resume latest")]


def test_component_states_of_a_manifest_and_of_one_written_before_components():
    manifest = {"components": {"best_lora": {"best_step": 4}},
                "per_rank": [{"samples_seen": 9, "components": {"bad_media": {"skipped_samples": 1}}},
                             {"samples_seen": 8, "components": {"bad_media": {"skipped_samples": 2}}}]}
    assert component_states(manifest, 1) == {"best_lora": {"best_step": 4}, "bad_media": {"skipped_samples": 2}}
    before = {"best_so_far": {"best_step": 6, "without": 1},
              "per_rank": [{"samples_seen": 9, "skipped_samples": 3, "recent_skips": [{"row": 2}]}]}
    assert component_states(before, 0) == {"best_lora": {"best_step": 6, "without": 1},
                                           "bad_media": {"skipped_samples": 3, "recent_skips": [{"row": 2}],
                                                         "replaced": {}}}
    assert component_states({"per_rank": []}, 0) == {"bad_media": {"skipped_samples": 0, "recent_skips": [],
                                                                   "replaced": {}}}
