"""The best validation so far and --early_stop's count: new bests, the relative improvement, the warm-up and the
first validation counting for nothing, a checkpoint's state carried into a resume; the component around it: a new
best marks the validation and keeps its LoRA, the early stop's decision, its state round trip, a resumed run that had
stopped."""

from types import SimpleNamespace

from diffsynth_mbc.training.components.best_lora import BestLora, BestSoFar, early_stop_line
from diffsynth_mbc.training.components.protocol import Stop, StepContext
from diffsynth_mbc.training.evaluation.validation import Validation
from diffsynth_mbc.training.reporting.status_writer import RankStatusWriter


def options(**given):
    return SimpleNamespace(**{"early_stop": 2, "early_stop_min_delta": 0.01, "warmup_steps": 0,
                              "output_path": "out", **given})


def test_a_new_best_is_any_lower_loss_and_only_a_real_improvement_resets_the_count():
    tracker = BestSoFar.from_options(options())
    assert tracker.observe(10, 1.0) and tracker.without == 0             # the first: the best, counts for nothing
    assert tracker.observe(20, 0.995) and tracker.without == 1           # lower, but by less than 1%: a best, counted
    assert not tracker.stop_due
    assert tracker.observe(30, 0.98) and tracker.without == 0            # 2% below 1.0: an improvement
    assert not tracker.observe(40, 0.99) and tracker.without == 1
    assert not tracker.observe(50, 0.985) and tracker.without == 2 and tracker.stop_due
    assert tracker.best_record("out/lora-best.safetensors") == {
        "step": 30, "val_loss": 0.98, "val_loss_base": None, "gain": None, "file": "out/lora-best.safetensors"}
    record = tracker.early_stop_record(50)
    assert record == {"step": 50, "best_step": 30, "validations_without_improvement": 2, "since_step": 30,
                      "patience": 2, "min_delta": 0.01}
    assert early_stop_line(record, 100, "out/lora-best.safetensors") == (
        "stopped early at step 50 of 100: no better validation in 2 evaluations since step 30; best: "
        "out/lora-best.safetensors (step 30)")


def test_the_warm_up_never_counts_and_off_never_stops():
    tracker = BestSoFar.from_options(options(warmup_steps=25))
    for step in (10, 20):
        tracker.observe(step, 1.0)
    assert tracker.without == 0
    tracker.observe(30, 1.0)
    assert tracker.without == 1
    off = BestSoFar.from_options(options(early_stop=None))
    for step in range(1, 50):
        off.observe(step, 1.0)
    assert off.without == 48 and not off.stop_due


def test_a_resume_goes_on_from_the_checkpoints_state_with_this_runs_patience():
    tracker = BestSoFar.from_options(options())
    tracker.observe(10, 1.0, 1.2)
    tracker.observe(20, 1.0, 1.2)
    tracker.observe(30, 1.0, 1.2)
    assert tracker.stop_due
    resumed = BestSoFar.from_options(options(early_stop=3), tracker.as_dict())
    assert resumed.best_step == 10 and resumed.without == 2 and not resumed.stop_due
    assert resumed.best_record("f")["gain"] == (1.2 - 1.0) / 1.2
    assert BestSoFar.from_options(options(), tracker.as_dict()).stop_due


class Printer:
    def __init__(self):
        self.lines = []

    def event(self, text):
        self.lines.append(text)


def validation(step, loss, base=2.0):
    return Validation(step, loss, {"kind": "val", "step": step, "val_loss": loss},
                      {"val_loss": loss, "val_loss_base": base, "new_best": False})


def test_the_component_keeps_each_new_best_and_stops_the_run_at_the_patience(tmp_path):
    status = RankStatusWriter(tmp_path, "run", 0, 0, 1, min_interval_s=0)
    written = []
    component = BestLora(options(), status, lambda name, step: written.append((name, step)), Printer(), True)
    decisions = []
    for step, loss in ((2, 1.0), (4, 0.9), (6, 0.899), (8, 0.95)):
        context = StepContext(step=step, epoch=0, total_steps=10, validation=validation(step, loss))
        decisions.append(component.after_validation(context))
        assert context.validation.record.get("new_best", False) == (step in (2, 4, 6))
        assert context.validation.fields["new_best"] == (step in (2, 4, 6))
    assert written == [("lora-best.safetensors", 2), ("lora-best.safetensors", 4), ("lora-best.safetensors", 6)]
    assert [decision and decision.stop for decision in decisions] == [None, None, None, Stop.EARLY]
    assert status.state["best"] == {"step": 6, "val_loss": 0.899, "val_loss_base": 2.0,
                                    "gain": (2.0 - 0.899) / 2.0, "file": "out/lora-best.safetensors"}
    component.at_end(StepContext(step=8, epoch=0, total_steps=10, stop=Stop.EARLY))
    assert status.state["early_stop"]["step"] == 8 and status.state["early_stop"]["since_step"] == 4
    status.close()


def test_its_state_round_trips_and_a_resume_that_had_stopped_trains_nothing(tmp_path, capsys):
    status = RankStatusWriter(tmp_path, "run", 0, 0, 1, min_interval_s=0)
    first = BestLora(options(), status, lambda name, step: None, Printer(), True)
    for step, loss in ((2, 1.0), (4, 0.999), (6, 0.998)):
        first.after_validation(StepContext(step=step, epoch=0, total_steps=10, validation=validation(step, loss)))
    resumed = BestLora(options(), status, lambda name, step: None, Printer(), True)
    resumed.load_state_dict(first.state_dict())
    assert resumed.best == first.best
    decision = resumed.at_start(StepContext(step=6, epoch=0, total_steps=10))
    assert decision.stop is Stop.EARLY
    assert "this run stopped early at step 6: no better validation in 2 evaluations since step 2" in \
        capsys.readouterr().err
    fresh = BestLora(options(), status, lambda name, step: None, Printer(), True)
    assert fresh.at_start(StepContext(step=0, epoch=0, total_steps=10)) is None
    status.close()
