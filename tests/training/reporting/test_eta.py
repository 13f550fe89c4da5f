import pytest

from diffsynth_mbc.training.reporting.eta import OverheadSchedule, StepRateWindow, eta_seconds


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


# -- the overheads still ahead (OverheadSchedule) and the ETA that adds them ---------------------------------


def test_upcoming_counts_what_follows_the_step_just_reported_and_the_end_of_the_run():
    schedule = OverheadSchedule(checkpoint_steps=10)
    # After step 10's report its own checkpoint is still to come: 10, 20, ..., 100.
    assert schedule.upcoming(10, 100, steps_per_epoch=100) == {"checkpoint": 10, "lora": 2}   # epoch-0 + final
    assert schedule.upcoming(11, 100, steps_per_epoch=100)["checkpoint"] == 9
    # 95 steps: 10..90 by the cadence, and one more at the end (the last step had none).
    assert schedule.upcoming(1, 95, steps_per_epoch=95)["checkpoint"] == 10
    assert schedule.upcoming(95, 95, steps_per_epoch=95) == {"checkpoint": 1, "lora": 2}


def test_upcoming_lora_files_validation_and_samples_follow_their_flags():
    schedule = OverheadSchedule(save_steps=25, validation=True, val_steps=30, samples=True, sample_steps=40)
    counts = schedule.upcoming(1, 100, steps_per_epoch=50)
    assert counts["lora"] == 2 + 4 + 1              # epoch-0/1, step-25/50/75/100, lora.safetensors
    assert counts["validation"] == 3 + 1            # 30, 60, 90, and the end (100 is no multiple of 30)
    assert counts["samples"] == 2 + 1               # 40, 80, and the end
    assert "checkpoint" not in counts               # no checkpoint flags: none
    assert OverheadSchedule(validation=True).upcoming(5, 10, 10)["validation"] == 1   # only at the end
    assert "validation" not in OverheadSchedule(val_steps=30).upcoming(1, 100, 50)    # no validation set


def test_upcoming_checkpoints_by_minutes_use_the_step_rate():
    schedule = OverheadSchedule(checkpoint_minutes=1)
    # 100 steps of 2 s left: 200 s of training, a save every 60 s, plus the last one.
    assert schedule.upcoming(100, 200, steps_per_epoch=200, seconds_per_step=2.0)["checkpoint"] == 3 + 1
    assert schedule.upcoming(100, 200, steps_per_epoch=200)["checkpoint"] == 1   # rate unknown: the last one
    both = OverheadSchedule(checkpoint_steps=10, checkpoint_minutes=1)
    assert both.upcoming(1, 100, 100, seconds_per_step=1.0)["checkpoint"] == 10  # the steps come first


def test_eta_is_steps_at_their_rate_plus_overheads_at_their_mean():
    eta, overheads = eta_seconds(1.0, 90, {"checkpoint": 9, "lora": 2}, {"checkpoint": 5.0})
    assert overheads == pytest.approx(45.0)         # LoRA files not measured yet: nothing for them
    assert eta == pytest.approx(90 + 45)
    assert eta_seconds(None, 90, {"checkpoint": 9}, {"checkpoint": 5.0}) == (None, pytest.approx(45.0))


def test_schedule_from_the_training_flags():
    class Options:
        checkpoint_steps, checkpoint_minutes, save_steps, val_steps, sample_steps = 500, 0, None, 250, 0

    schedule = OverheadSchedule.from_options(Options, validation=True, samples=False)
    assert schedule == OverheadSchedule(checkpoint_steps=500, val_steps=250, validation=True)
