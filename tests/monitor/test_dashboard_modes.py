"""The dashboard's charts per training mode in a real headless Chromium: "Loss by mode" (a line per mode and rank,
the mode's colour, the rank's style) and the loss-by-timestep chart split by mode, both from the first load and
carried on by the page as new steps arrive, as the monitor computes them. One page serves every test here."""

from __future__ import annotations

import json
import time

import pytest
from selenium.webdriver.support.ui import Select

import monitor_fixtures as F
from diffsynth_mbc.monitor.history import HistoryFile
from test_dashboard_browser import (browser, chart, pixels_of_colour, pytestmark, served_dashboard,  # noqa: F401
                                    wait_for)
from test_dashboard_timesteps import same

STEPS = 120
MODE_COLOURS = {"t2i": (0xf2, 0xc9, 0x4c), "i2v": (0xff, 0x6b, 0x6b), "t2v": (0x56, 0xd4, 0xe0)}  # the page's


def step_record(step, rank):
    """Rank 0 trains an image (t2i) and a video (i2v) each step, and a t2v video every fourth; rank 1 two i2v videos,
    and after the first STEPS steps an i2v and a t2v."""
    if rank == 1:
        modes = ["i2v", "i2v" if step <= STEPS else "t2v"]
    else:
        modes = ["t2i", "i2v"] + (["t2v"] if step % 4 == 0 else [])
    timesteps = [round((step * 53.7 + k * 401.3) % 1000, 2) for k in range(len(modes))]
    base = {"t2i": 0.15, "i2v": 0.3, "t2v": 0.45}
    losses = [round(base[m] + t / 5000 - step / 20_000, 6) for m, t in zip(modes, timesteps)]
    return json.dumps({"step": step, "epoch": 0, "loss": sum(losses) / len(losses), "lr": 1e-4, "step_time_s": 2.0,
                       "samples": len(modes), "time": F.NOW + step, "timesteps": timesteps,
                       "timestep_losses": losses, "modes": modes}) + "\n"


def validation(step):
    return json.dumps({"step": step, "kind": "val", "val_loss": 0.3,
                       "val_loss_by_mode": {"t2i": 0.2 - step / 10_000, "i2v": 0.35 - step / 10_000}}) + "\n"


def append(log_dir, steps):
    for rank in (0, 1):
        with open(log_dir / f"training_gpu{rank}.jsonl", "a", encoding="utf-8") as handle:
            handle.write("".join(step_record(s, rank) for s in steps))
            handle.write("".join(validation(s) for s in steps if s % 60 == 0))


def monitor_modes(log_dir, rank):
    history = HistoryFile(log_dir / f"training_gpu{rank}.jsonl")
    history.poll()
    return history.modes


def expected_lines(log_dir):
    """{label: points} of the loss-by-mode chart from the histories as they are now: mode after mode, rank 0 first."""
    counts = {rank: {m: s.count for m, s in monitor_modes(log_dir, rank).series.items()} for rank in (0, 1)}
    return {f"{mode} · rank {rank}": counts[rank][mode] for mode in ("t2i", "i2v", "t2v") for rank in (0, 1)
            if mode in counts[rank]}


@pytest.fixture(scope="module")
def mode_page(browser, tmp_path_factory):
    log_dir = tmp_path_factory.mktemp("modes") / "training_logs"
    log_dir.mkdir()
    append(log_dir, list(range(1, STEPS + 1)))
    for rank in (0, 1):
        F.write_status(log_dir, rank, world_size=2, step=STEPS, total_steps=1000, now=time.time())
    with served_dashboard(browser, log_dir):
        yield browser, log_dir


def drawn_lines(driver, chart_id):
    c = chart(driver, chart_id)
    return dict(zip(c["series"], c["points"]))


def test_loss_by_mode_is_a_line_per_mode_and_rank_in_the_modes_colour_and_the_ranks_style(mode_page):
    driver, log_dir = mode_page
    wait_for(driver, lambda d: drawn_lines(d, "loss_by_mode") == expected_lines(log_dir))
    c = chart(driver, "loss_by_mode")
    assert c["series"][:3] == ["t2i · rank 0", "i2v · rank 0", "i2v · rank 1"] and c["series"][3] == "t2v · rank 0"
    styles = dict(zip(c["series"], json.loads(c["box"].get_attribute("data-styles"))))
    assert styles["i2v · rank 0"] == [3, None] and styles["i2v · rank 1"] == [1.5, [6, 6]]   # rank 0 solid, wider
    for mode, rgb in MODE_COLOURS.items():
        assert pixels_of_colour(driver, "loss_by_mode", rgb) > 50, mode
    legend = c["box"].find_element("css selector", ".u-legend").text
    assert all(mode in legend for mode in MODE_COLOURS) and "Loss by mode" in c["box"].text
    assert c["epoch_marks"] == 0 and c["box"].is_displayed()
    val = chart(driver, "val_loss")   # the validation loss per mode: once, as the quantiles
    assert val["series"] == ["rank 0", "rank 1", "t2i", "i2v"] and val["points"] == [STEPS // 60] * 4
    assert [e for e in driver.get_log("browser") if e["level"] == "SEVERE"] == []


def bins_drawn(driver):
    c = chart(driver, "loss_by_timestep")
    return dict(zip(c["series"], json.loads(c["box"].get_attribute("data-values"))))


def bins_match_the_monitor(driver, log_dir):
    drawn = bins_drawn(driver)
    modes = {rank: monitor_modes(log_dir, rank).by_timestep for rank in (0, 1)}
    want = {f"{mode} · rank {rank}": bins[mode].as_dict()["ema"] for mode in ("t2i", "i2v", "t2v")
            for rank, bins in modes.items() if mode in bins}
    return list(drawn) == list(want) and all(same(drawn[label], want[label]) for label in want)


def test_the_loss_by_timestep_chart_splits_by_mode_and_follows_new_steps(mode_page):
    driver, log_dir = mode_page
    box = chart(driver, "loss_by_timestep")["box"]
    assert chart(driver, "loss_by_timestep")["series"] == ["rank 0", "rank 1"]   # all samples, as before
    split = Select(box.find_element("css selector", 'select[data-control="split"]'))
    try:
        split.select_by_visible_text("by mode")
        wait_for(driver, lambda d: bins_match_the_monitor(d, log_dir))
        for mode, rgb in MODE_COLOURS.items():
            assert pixels_of_colour(driver, "loss_by_timestep", rgb) > 30, mode
        before = bins_drawn(driver)
        append(log_dir, list(range(STEPS + 1, STEPS + 41)))   # rank 1 trains t2v from now on: a new line
        wait_for(driver, lambda d: bins_drawn(d) != before and bins_match_the_monitor(d, log_dir))
        wait_for(driver, lambda d: drawn_lines(d, "loss_by_mode") == expected_lines(log_dir))
    finally:
        split.select_by_visible_text("all samples")
    wait_for(driver, lambda d: chart(d, "loss_by_timestep")["series"] == ["rank 0", "rank 1"])
