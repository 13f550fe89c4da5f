"""Step times without the work between steps, and the ETA that adds that work back: pure, on a simulated clock."""

import pytest

from diffsynth_mbc.training.reporting.eta import OverheadSchedule
from diffsynth_mbc.training.reporting.step_timing import StepClock, StepTiming


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def test_the_step_clock_stands_still_inside_a_section_and_tallies_it():
    clock = Clock()
    steps = StepClock(clock)
    start = steps.now()
    clock.now += 1.0
    steps.begin("checkpoint")
    clock.now += 5.0
    assert steps.now() - start == pytest.approx(1.0)     # inside: the step clock waits
    assert steps.end() == ("checkpoint", pytest.approx(5.0))
    clock.now += 1.0
    assert steps.now() - start == pytest.approx(2.0)
    steps.begin("checkpoint")
    clock.now += 3.0
    steps.end()
    assert steps.as_dict() == {"checkpoint": {"count": 2, "total_s": 8.0, "last_s": 3.0, "mean_s": 4.0}}
    assert steps.means() == {"checkpoint": 4.0}


def test_nested_sections_stop_the_clock_once_and_each_kind_gets_its_own_time():
    clock = Clock()
    steps = StepClock(clock)
    start = steps.now()
    steps.begin("checkpoint")
    clock.now += 2.0
    steps.begin("lora")
    clock.now += 1.0
    assert steps.end() == ("lora", pytest.approx(1.0))
    clock.now += 2.0
    assert steps.end() == ("checkpoint", pytest.approx(4.0))   # 5 s in it, 1 of them the LoRA file's
    assert steps.now() == pytest.approx(start)
    clock.now += 1.0
    assert steps.now() - start == pytest.approx(1.0)


def test_a_failed_section_is_left_out_of_the_steps_but_not_tallied():
    clock = Clock()
    steps = StepClock(clock)
    start = steps.now()
    steps.begin("validation")
    clock.now += 7.0
    steps.end(tally=False)
    assert steps.now() == pytest.approx(start) and steps.as_dict() == {}
    with pytest.raises(RuntimeError):
        steps.end()


def test_a_5_s_checkpoint_every_10_steps_of_1_s():
    """The case of the speed issue: step_time_s stays 1 s after each checkpoint, and the ETA is
    steps x 1 s + checkpoints still ahead x 5 s."""
    clock = Clock()
    timing = StepTiming(total_steps=100, steps_per_epoch=100, schedule=OverheadSchedule(checkpoint_steps=10),
                        rate_window=20, warmup_steps=2, monotonic=clock)
    timing.start()
    reports = {}
    for step in range(1, 101):
        clock.now += 1.0
        reports[step] = timing.step_done(step)
        if step % 10 == 0:
            timing.clock.begin("checkpoint")
            clock.now += 5.0
            timing.clock.end()
    assert {round(r.step_time_s, 9) for r in reports.values()} == {1.0}
    assert reports[11].step_time_s == pytest.approx(1.0)            # the step right after a checkpoint
    assert reports[25].step_time_avg_s == pytest.approx(1.0)
    # After step 25: 75 steps and the checkpoints of steps 30..100 (8 of them) at their measured 5 s.
    assert reports[25].eta_overheads_s == pytest.approx(8 * 5.0)
    assert reports[25].eta_s == pytest.approx(75 * 1.0 + 8 * 5.0)
    # After step 30's report its own checkpoint is still ahead; the ETA is the time the run really took after it.
    assert reports[30].eta_s == pytest.approx(70 + 8 * 5.0)
    assert reports[30].eta_s == pytest.approx(clock.now - (100.0 + 30 * 1.0 + 2 * 5.0))
    assert timing.clock.as_dict()["checkpoint"]["count"] == 10


def test_no_eta_during_warm_up_and_overheads_before_the_start_are_not_in_the_first_step():
    clock = Clock()
    timing = StepTiming(total_steps=10, steps_per_epoch=10, monotonic=clock)
    timing.clock.begin("samples")          # the baseline samples, before the first step
    clock.now += 30.0
    timing.clock.end()
    clock.now += 4.0                       # the loop starting up: not the first step's either
    timing.start()
    clock.now += 2.0
    first = timing.step_done(1)
    assert first.step_time_s == pytest.approx(2.0) and first.eta_s is None
