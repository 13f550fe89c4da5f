import pytest

from diffsynth_mbc.training.eta import StepRateWindow


def test_no_rate_during_warmup():
    window = StepRateWindow(window=10, warmup_steps=2)
    window.record(1, now=100.0)   # slow first step (compilation, loader fill)
    window.record(2, now=160.0)
    assert window.seconds_per_step is None
    assert window.eta_seconds(10) is None


def test_warmup_steps_are_left_out_of_the_rate():
    window = StepRateWindow(window=10, warmup_steps=2)
    window.record(1, now=0.0)
    window.record(2, now=60.0)    # 60 s warm-up step
    for step, now in ((3, 62.0), (4, 64.0), (5, 66.0)):
        window.record(step, now)
    assert window.seconds_per_step == pytest.approx(2.0)
    assert window.eta_seconds(100) == pytest.approx(200.0)


def test_window_follows_a_change_of_speed():
    window = StepRateWindow(window=4, warmup_steps=0)
    now = 0.0
    for step in range(1, 21):
        now += 1.0 if step <= 10 else 3.0
        window.record(step, now)
    assert window.seconds_per_step == pytest.approx(3.0)


def test_resumed_run_counts_only_steps_it_timed():
    window = StepRateWindow(window=10, warmup_steps=1)
    # A run resumed at step 5000: the first step it sees is 5001.
    for offset, now in enumerate((10.0, 11.5, 13.0, 14.5)):
        window.record(5001 + offset, now)
    assert window.seconds_per_step == pytest.approx(1.5)


def test_eta_is_zero_when_nothing_remains_and_never_negative():
    window = StepRateWindow(window=5, warmup_steps=0)
    window.record(1, 0.0)
    window.record(2, 1.0)
    assert window.eta_seconds(0) == 0.0
    assert window.eta_seconds(-3) == 0.0


def test_window_must_be_positive():
    with pytest.raises(ValueError):
        StepRateWindow(window=0)
