"""The dashboard's loss-by-timestep chart in a real headless Chromium: one line per rank over the timestep bins,
the monitor's averages, carried on by the page as new steps arrive exactly as the monitor computes them."""

from __future__ import annotations

import json
import time

import pytest

import monitor_fixtures as F
from diffsynth_mbc.monitor.history import HistoryFile
from test_dashboard_browser import (RANK_COLOURS, browser, chart, pixels_of_colour, pytestmark,  # noqa: F401
                                    served_dashboard, wait_for)

STEPS = 200


def step_record(step, rank):
    """Two samples a step; rank 1 trains only the noisier half of the schedule (--min_timestep_boundary 0.5)."""
    timesteps = [round((step * 53.7 + k * 401.3) % 1000, 2) for k in range(2)]
    if rank == 1:
        timesteps = [t / 2 + 500 for t in timesteps]
    losses = [round(0.2 + t / 4000 + 0.05 * rank - step / 10_000, 6) for t in timesteps]
    return json.dumps({"step": step, "epoch": 0, "loss": sum(losses) / 2, "lr": 1e-4, "step_time_s": 2.0,
                       "samples": 2, "time": F.NOW + step, "timesteps": timesteps, "timestep_losses": losses}) + "\n"


def write_histories(log_dir, steps, mode="w"):
    for rank in (0, 1):
        with open(log_dir / f"training_gpu{rank}.jsonl", mode, encoding="utf-8") as handle:
            handle.write("".join(step_record(s, rank) for s in steps))


def monitor_bins(log_dir, rank):
    history = HistoryFile(log_dir / f"training_gpu{rank}.jsonl")
    history.poll()
    return history.by_timestep.as_dict()


def same(page, monitor):
    """The page's averages are the monitor's (sent with 6 significant digits; the page carries them on)."""
    return [v is None for v in page] == [v is None for v in monitor] and all(
        a == pytest.approx(b, rel=1e-5) for a, b in zip(page, monitor) if a is not None)


def drawn(driver):
    box = chart(driver, "loss_by_timestep")["box"]
    return json.loads(box.get_attribute("data-values"))


@pytest.fixture
def timestep_page(browser, tmp_path):
    log_dir = tmp_path / "training_logs"
    log_dir.mkdir()
    write_histories(log_dir, range(1, STEPS + 1))
    for rank in (0, 1):
        F.write_status(log_dir, rank, world_size=2, step=STEPS, total_steps=1000, now=time.time())
    with served_dashboard(browser, log_dir):
        yield browser, log_dir


def test_each_rank_is_a_line_over_the_timestep_bins_with_the_monitors_averages(timestep_page):
    driver, log_dir = timestep_page
    c = chart(driver, "loss_by_timestep")
    assert c["series"] == ["rank 0", "rank 1"]
    assert c["points"] == [20, 10]    # rank 1 drew only from [500, 1000): half the bins
    assert c["epoch_marks"] == 0
    for rank, values in enumerate(drawn(driver)):
        assert same(values, monitor_bins(log_dir, rank)["ema"]), (rank, values)
    for rank, rgb in RANK_COLOURS.items():
        assert pixels_of_colour(driver, "loss_by_timestep", rgb) > 50, rank
    assert c["box"].find_element("css selector", ".u-legend").text.count("rank") == 2
    assert json.loads(c["box"].get_attribute("data-x-ticks"))   # the axis has ticks ...
    assert "timestep" in c["box"].text                           # ... and says what they are
    # a history from before training modes: no chart per mode, no split by mode (test_dashboard_modes.py has them)
    assert not driver.find_element("css selector", '.chartbox[data-chart="loss_by_mode"]').is_displayed()
    assert not c["box"].find_element("css selector", 'select[data-control="split"]').is_displayed()
    assert [e for e in driver.get_log("browser") if e["level"] == "SEVERE"] == []


def test_new_steps_move_the_averages_as_the_monitor_would(timestep_page):
    driver, log_dir = timestep_page
    before = drawn(driver)
    write_histories(log_dir, range(STEPS + 1, STEPS + 41), mode="a")
    wait_for(driver, lambda d: drawn(d) != before)
    wait_for(driver, lambda d: all(same(values, monitor_bins(log_dir, r)["ema"]) for r, values in enumerate(drawn(d))))
