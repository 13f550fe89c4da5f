"""The best validation so far and --early_stop's count: new bests, the relative improvement, the warm-up and the
first validation counting for nothing, a non-finite validation never the best, the count running in the final stage
only and the best saying its stage, a checkpoint's state carried into a resume; the component around it: a new best
marks the validation and keeps its LoRA, the early stop's decision, its state round trip, a resumed run that had
stopped."""

from types import SimpleNamespace

from diffsynth_mbc.training.components.best_lora import (BestLora, BestSoFar, best_file_note, early_stop_line,
                                                         standing_text)
from diffsynth_mbc.training.components.protocol import Stop, StepContext
from diffsynth_mbc.training.evaluation.validation import Validation
from diffsynth_mbc.training.reporting.run_summary import validation_event
from diffsynth_mbc.training.reporting.status_writer import RankStatusWriter

NAN, INF = float("nan"), float("inf")


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
                      "since_val_loss": 0.98, "patience": 2, "min_delta": 0.01}
    assert early_stop_line(record, 100, "out/lora-best.safetensors") == (
        "stopped early at step 50 of 100: 2 validations in a row since step 30 (val_loss 0.9800) without the 1.00% "
        "improvement that resets the count (--early_stop 2); best: out/lora-best.safetensors (step 30)")


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


def test_a_non_finite_validation_is_never_the_best_nor_stops_an_improving_run():
    tracker = BestSoFar.from_options(options(early_stop=3, early_stop_min_delta=0.001))
    assert not tracker.observe(10, NAN) and tracker.best_record("f") is None
    for step, loss in ((20, 1.5), (30, 1.2), (40, 1.0)):   # improving: each a new best, the count never moves
        assert tracker.observe(step, loss) and tracker.without == 0
    assert not tracker.stop_due and tracker.best_record("f")["val_loss"] == 1.0
    # once the count runs, a non-finite validation is one without an improvement, and never the best
    assert not tracker.observe(50, INF) and tracker.without == 1 and tracker.best_step == 40
    assert not tracker.observe(60, NAN) and tracker.without == 2 and tracker.reference == 1.0


def test_a_checkpoint_that_saved_a_nan_best_is_read_without_it():
    saved = {"best_step": 2, "best_loss": NAN, "best_base": 1.6, "reference": NAN, "reference_step": 2, "without": 0}
    resumed = BestSoFar.from_options(options(), saved)
    assert resumed.best_record("f") is None and resumed.reference is None
    assert resumed.observe(4, 1.4) and resumed.best_record("f")["step"] == 4 and resumed.reference == 1.4


def test_a_broken_runs_message_says_what_became_of_the_best_file():
    tracker = BestSoFar.from_options(options())
    tracker.observe(2, NAN)
    assert best_file_note(tracker, "out/lora-best.safetensors") == (
        "no lora-best.safetensors was written: no validation of this run had a finite val_loss")
    tracker.observe(4, 1.25)
    tracker.observe(6, NAN)
    assert best_file_note(tracker, "out/lora-best.safetensors") == (
        "out/lora-best.safetensors holds the LoRA of step 4 (val_loss 1.2500, the lowest finite validation), kept")


def test_each_validation_line_says_where_the_count_stands_and_the_summary_agrees():
    tracker = BestSoFar.from_options(options(early_stop=3, early_stop_min_delta=0.001, warmup_steps=100))
    lines = []
    for step, loss in ((100, 1.3), (189, 1.2010), (196, 1.2006), (203, 1.2), (210, 1.1996), (217, 1.1995),
                       (224, 1.1994)):
        new_best = tracker.observe(step, loss)
        lines.append(validation_event({"val_step": step, "val_loss": loss, "new_best": new_best,
                                       "early_stop_count": tracker.standing}))
    assert lines == [
        "validation at step 100: val_loss 1.3000, new best; early stop: in the warm-up, not counted (the count runs "
        "from step 101)",
        "validation at step 189: val_loss 1.2010, new best; early stop: 7.6% below step 100's, at least the 0.10% "
        "that resets the count: 0 of 3",
        "validation at step 196: val_loss 1.2006, new best; early stop: 0.033% below step 189's (under the 0.10% that "
        "resets the count): 1 of 3",
        "validation at step 203: val_loss 1.2000, new best; early stop: 0.083% below step 189's (under the 0.10% that "
        "resets the count): 2 of 3",
        "validation at step 210: val_loss 1.1996, new best; early stop: 0.12% below step 189's, at least the 0.10% "
        "that resets the count: 0 of 3",
        "validation at step 217: val_loss 1.1995, new best; early stop: 0.0083% below step 210's (under the 0.10% "
        "that resets the count): 1 of 3",
        "validation at step 224: val_loss 1.1994, new best; early stop: 0.017% below step 210's (under the 0.10% "
        "that resets the count): 2 of 3"]
    # a new best again, by less than 0.1%: the third in a row; the run stops, and its summary says why in those words
    assert validation_event({"val_step": 231, "val_loss": 1.1993, "new_best": tracker.observe(231, 1.1993),
                             "early_stop_count": tracker.standing}) == (
        "validation at step 231: val_loss 1.1993, new best; early stop: 0.025% below step 210's (under the 0.10% that "
        "resets the count): 3 of 3, the run stops here")
    assert tracker.stop_due
    assert early_stop_line(tracker.early_stop_record(231), 280, "lora-best.safetensors") == (
        "stopped early at step 231 of 280: 3 validations in a row since step 210 (val_loss 1.1996) without the 0.10% "
        "improvement that resets the count (--early_stop 3); best: lora-best.safetensors (step 231)")


def test_the_count_says_a_first_a_higher_and_a_non_finite_validation():
    tracker = BestSoFar.from_options(options(early_stop=2, early_stop_min_delta=0.001))
    tracker.observe(10, NAN)
    assert standing_text(tracker.standing) == (
        "early stop: not finite, not counted (the count starts from the first finite validation)")
    tracker.observe(20, 1.0)
    assert standing_text(tracker.standing) == "early stop: the count starts from this one: 0 of 2"
    tracker.observe(30, 1.0)
    assert standing_text(tracker.standing) == "early stop: the same as step 20's: 1 of 2"
    tracker.observe(40, NAN)
    assert standing_text(tracker.standing) == "early stop: not finite, no improvement: 2 of 2, the run stops here"
    tracker = BestSoFar.from_options(options(early_stop=2))
    tracker.observe(10, 1.0)
    tracker.observe(20, 1.25)
    assert standing_text(tracker.standing) == "early stop: 25% above step 10's: 1 of 2"
    assert BestSoFar.from_options(options(early_stop=None)).standing is None


STAGES = {"stage_ends": (9, 18), "stage_sizes": ("64x64x9", "96x96x9")}   # stage 1: steps 1-9, the final: 10-18


def test_in_stages_the_count_runs_in_the_final_stage_only_and_the_best_says_its_stage():
    tracker = BestSoFar.from_options(options(early_stop=2, early_stop_min_delta=0.001, warmup_steps=2), **STAGES)
    for step in (2, 4, 6, 8):   # a flat validation in stage 1: counted for nothing, and no loss to count from
        assert tracker.observe(step, 1.0) == (step == 2)
        assert tracker.without == 0 and tracker.reference is None and not tracker.stop_due
        assert tracker.standing["not_counted"] == "earlier stage"
    assert standing_text(tracker.standing) == (
        "early stop: before the final stage, not counted (the count runs from step 10)")
    tracker.observe(10, 1.0)   # the final stage's first: the count starts from it
    assert standing_text(tracker.standing) == "early stop: the count starts from this one: 0 of 2"
    tracker.observe(12, 1.0)
    assert not tracker.stop_due
    tracker.observe(14, 1.0)
    assert tracker.stop_due and tracker.early_stop_record(14)["since_step"] == 10
    best = tracker.best_record("lora-best.safetensors")
    assert best["step"] == 2 and best["stage"] == {"stage": 1, "of": 2, "size": "64x64x9", "final": False}
    assert early_stop_line(tracker.early_stop_record(14), 18, "lora-best.safetensors", best["stage"]).endswith(
        "; best: lora-best.safetensors (step 2, stage 1/2 64x64x9, not the final size)")
    tracker.observe(16, 0.9)
    assert tracker.best_record("f")["stage"] == {"stage": 2, "of": 2, "size": "96x96x9", "final": True}


def test_a_checkpoint_counting_from_an_earlier_stage_starts_again_in_the_final_one():
    saved = {"best_step": 4, "best_loss": 1.0, "reference": 1.0, "reference_step": 4, "without": 1}   # earlier rule
    tracker = BestSoFar.from_options(options(early_stop=2, early_stop_min_delta=0.001), saved, **STAGES)
    tracker.observe(8, 1.0)
    assert tracker.without == 1 and not tracker.stop_due   # stage 1: nothing counted
    tracker.observe(10, 1.0)
    assert tracker.standing["not_counted"] == "first" and tracker.without == 0 and tracker.reference_step == 10


def test_without_stages_the_best_has_no_stage():
    tracker = BestSoFar.from_options(options())
    tracker.observe(2, 1.0)
    assert "stage" not in tracker.best_record("f") and tracker.standing["counts_from_step"] == 1


def validation(step, loss, base=2.0):
    return Validation(step, loss, {"kind": "val", "step": step, "val_loss": loss},
                      {"val_loss": loss, "val_loss_base": base, "new_best": False})


def test_the_component_keeps_each_new_best_and_stops_the_run_at_the_patience(tmp_path):
    status = RankStatusWriter(tmp_path, "run", 0, 0, 1, min_interval_s=0)
    written = []
    component = BestLora(options(), status, lambda name, step: written.append((name, step)), True)
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
    first = BestLora(options(), status, lambda name, step: None, True)
    for step, loss in ((2, 1.0), (4, 0.999), (6, 0.998)):
        first.after_validation(StepContext(step=step, epoch=0, total_steps=10, validation=validation(step, loss)))
    resumed = BestLora(options(), status, lambda name, step: None, True)
    resumed.load_state_dict(first.state_dict())
    assert resumed.best.as_dict() == first.best.as_dict()
    decision = resumed.at_start(StepContext(step=6, epoch=0, total_steps=10))
    assert decision.stop is Stop.EARLY
    assert "this run stopped early at step 6: 2 validations in a row since step 2" in capsys.readouterr().err
    fresh = BestLora(options(), status, lambda name, step: None, True)
    assert fresh.at_start(StepContext(step=0, epoch=0, total_steps=10)) is None
    status.close()
