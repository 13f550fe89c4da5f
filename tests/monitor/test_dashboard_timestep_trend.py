"""What the dashboard's loss-by-timestep chart says about its bins, in a real headless Chromium: each bin's earlier
average drawn faintly under its average (the monitor's, carried on by the page as new steps arrive) and a title
that says no more than that; the hovered bin named by its timesteps, never as a step, with the samples behind
each value; and a loss written the same in the status card, the rank table, the legend and the tooltip.
One page serves every test here; the last one appends steps."""

from __future__ import annotations

import json
import re
import time

import pytest
from selenium.webdriver.common.action_chains import ActionChains
from selenium.webdriver.common.by import By

import monitor_fixtures as F
from diffsynth_mbc.monitor.history import HistoryFile
from diffsynth_mbc.monitor.timestep_bins import LAG, MARK_EVERY
from diffsynth_mbc.monitor.view import fmt_loss
from test_dashboard_browser import browser, chart, pytestmark, served_dashboard, wait_for  # noqa: F401
from test_dashboard_timesteps import same

STEPS = 650
GOLDEN = 0.6180339887498949
LAST_LOSS = 0.412346   # rank 0's last 10 steps' and both ranks' status loss: "0.4123" wherever the page shows it
FEW = (100, 200, 300)  # the steps at which rank 0 trains one sample in [0, 50): the bin holds 3 samples


def step_record(step, rank):
    """Rank 0 trains four samples a step over [50, 1000) (some 137 per bin by the end: each bin has an earlier
    average); rank 1 one a step over [500, 1000) (some 65 per bin: none yet). The loss falls as the steps go."""
    n, low = (4, 50.0) if rank == 0 else (1, 500.0)
    timesteps = [round(low + ((step * n + k) * GOLDEN % 1.0) * (1000.0 - low), 2) for k in range(n)]
    if rank == 0 and step in FEW:
        timesteps[0] = 10.0
    losses = [round(0.2 + t / 4000 + 0.05 * rank - step / 10_000, 6) for t in timesteps]
    loss = LAST_LOSS if rank == 0 and STEPS - 10 < step <= STEPS else sum(losses) / n
    return json.dumps({"step": step, "epoch": 0, "loss": loss, "lr": 1e-4, "step_time_s": 2.0, "samples": n,
                       "time": F.NOW + step, "timesteps": timesteps, "timestep_losses": losses}) + "\n"


def append(log_dir, steps):
    for rank in (0, 1):
        with open(log_dir / f"training_gpu{rank}.jsonl", "a", encoding="utf-8") as handle:
            handle.write("".join(step_record(s, rank) for s in steps))


def monitor_bins(log_dir, rank):
    history = HistoryFile(log_dir / f"training_gpu{rank}.jsonl")
    history.poll()
    return history.by_timestep.as_dict()


@pytest.fixture(scope="module")
def trend_page(browser, tmp_path_factory):
    log_dir = tmp_path_factory.mktemp("trend") / "training_logs"
    log_dir.mkdir()
    append(log_dir, range(1, STEPS + 1))
    for rank in (0, 1):
        F.write_status(log_dir, rank, world_size=2, step=STEPS, total_steps=1000, now=time.time(), loss=LAST_LOSS,
                       step_time_s=2.0, lr=1e-4)
    with served_dashboard(browser, log_dir):
        yield browser, log_dir


def drawn(driver):
    c = chart(driver, "loss_by_timestep")
    return dict(zip(c["series"], json.loads(c["box"].get_attribute("data-values"))))


def follows_the_monitor(driver, log_dir):
    lines = drawn(driver)
    zero, one = monitor_bins(log_dir, 0), monitor_bins(log_dir, 1)
    return (list(lines) == ["rank 0 earlier", "rank 0", "rank 1"] and same(lines["rank 0 earlier"], zero["earlier"])
            and same(lines["rank 0"], zero["ema"]) and same(lines["rank 1"], one["ema"]))


def test_each_bins_earlier_average_is_drawn_faintly_under_it_and_the_title_claims_no_more(trend_page):
    driver, log_dir = trend_page
    assert follows_the_monitor(driver, log_dir)
    zero = monitor_bins(log_dir, 0)
    lags = [n - e for n, e in zip(zero["count"], zero["earlier_count"]) if e is not None]
    assert len(lags) == 19 and all(LAG <= lag < LAG + MARK_EVERY for lag in lags)   # bin [0, 50): 3 samples, none
    lines = drawn(driver)
    assert all(before > now for before, now in zip(lines["rank 0 earlier"], lines["rank 0"]) if before is not None)
    styles = dict(zip(lines, json.loads(chart(driver, "loss_by_timestep")["box"].get_attribute("data-styles"))))
    assert styles["rank 0 earlier"][0] < styles["rank 0"][0]   # thinner (and faded) under its line
    text = chart(driver, "loss_by_timestep")["box"].find_element(By.CSS_SELECTOR, ".t").text + " " + \
        chart(driver, "loss_by_timestep")["box"].find_element(By.CSS_SELECTOR, ".hint").text
    assert "still learning" not in text and "falling" not in text, text   # one snapshot cannot say so
    assert "faint" in text and "earlier" in text and "samples per bin" in text, text
    assert [e for e in driver.get_log("browser") if e["level"] == "SEVERE"] == []


def hover(driver, chart_id, x, near=0.0):
    """Move the mouse over ``chart_id``'s plot at data x ``x``; its tooltip's heading and text, once shown at x
    (give or take ``near``: a pixel holds more than one step)."""
    box = chart(driver, chart_id)
    over = box["box"].find_element(By.CSS_SELECTOR, ".u-over")
    (lo, hi), width = box["x"], over.size["width"]
    offset = (x - lo) / (hi - lo) * width - width / 2   # from the element's centre
    offset = min(width / 2 - 2, max(-width / 2 + 2, offset))
    ActionChains(driver).move_to_element_with_offset(over, int(round(offset)), 0).perform()
    tip = box["box"].find_element(By.CSS_SELECTOR, ".tip")
    wait_for(driver, lambda d: tip.is_displayed() and abs(float(tip.get_attribute("data-step")) - x) <= near)
    return read(driver, "const tip = document.querySelector(`.chartbox[data-chart='${arguments[0]}'] .tip`);"
                        "return [tip.querySelector('b').innerText, tip.innerText];", chart_id)


def read(driver, script, *args):
    """What a script reads of the page, in one go: the page redraws its table and legends every poll."""
    return driver.execute_script(script, *args)


def legend(driver, chart_id):
    """{label: value} of a chart's legend as shown, the x value's row first."""
    return dict(read(driver, "return Array.from(document.querySelectorAll("
                             "`.chartbox[data-chart='${arguments[0]}'] .u-legend .u-series`)).map("
                             "(row) => [row.querySelector('th').innerText.trim(), row.querySelector('td').innerText]);",
                     chart_id))


def test_the_hovered_bin_is_named_by_its_timesteps_with_the_samples_behind_each_value(trend_page):
    driver, log_dir = trend_page
    zero, one = monitor_bins(log_dir, 0), monitor_bins(log_dir, 1)
    head, tip = hover(driver, "loss_by_timestep", 25.0)   # bin [0, 50): 3 samples of rank 0, none of rank 1
    assert zero["count"][0] == 3 and one["count"][0] == 0
    assert head == "timestep 0-50 · 3 samples"
    assert f"rank 0: {fmt_loss(zero['ema'][0])} (3 samples)" in tip
    shown = legend(driver, "loss_by_timestep")
    assert list(shown)[0] == "timestep" and shown["timestep"] == "0-50 (3 samples)", shown
    assert shown["rank 0"] == f"{fmt_loss(zero['ema'][0])} (3 samples)"
    assert not any(re.search(r"\bstep\b", text) for text in list(shown) + list(shown.values())), shown

    head, tip = hover(driver, "loss_by_timestep", 625.0)   # bin [600, 650): both ranks, rank 0 with its earlier one
    n0, n1, before = zero["count"][12], one["count"][12], zero["count"][12] - zero["earlier_count"][12]
    assert head == f"timestep 600-650 · {n0 + n1} samples"
    shown = legend(driver, "loss_by_timestep")
    assert shown["timestep"] == f"600-650 ({n0 + n1} samples)"
    assert shown["rank 0"] == f"{fmt_loss(zero['ema'][12])} ({n0} samples)"
    assert shown["rank 1"] == f"{fmt_loss(one['ema'][12])} ({n1} samples)"
    assert shown["rank 0 earlier"] == f"{fmt_loss(zero['earlier'][12])} ({before} samples before)"
    assert f"rank 0 earlier: {shown['rank 0 earlier']}" in tip
    bars = json.loads(chart(driver, "loss_by_timestep")["box"].get_attribute("data-bin-samples"))
    assert bars == [a + b for a, b in zip(zero["count"], one["count"])]   # the faint bars' heights


def test_a_loss_reads_the_same_in_the_status_card_the_rank_table_the_legend_and_the_tooltip(trend_page):
    driver, _ = trend_page
    card, cells = read(driver, "return [document.getElementById('sum-loss').innerText, Array.from("
                               "document.querySelectorAll('#ranks-body tr')).map((row) => Array.from("
                               "row.querySelectorAll('td')).map((td) => td.innerText))];")
    _, tip = hover(driver, "loss", float(STEPS), near=9)   # rank 0's last steps: their loss is the status files'
    shown = legend(driver, "loss")
    assert card == fmt_loss(LAST_LOSS) == "0.4123"   # as the terminal writes it
    assert [c[6] for c in cells] == [card, card]     # the rank table's loss column
    assert shown["rank 0 raw"] == card and f"rank 0 raw: {card}" in tip
    assert [c[8] for c in cells] == ["2.00 s", "2.00 s"]   # a step time, too, is one text everywhere
    _, tip = hover(driver, "step_time", float(STEPS), near=9)
    assert legend(driver, "step_time")["rank 0"] == "2.00 s" and "rank 0: 2.00 s" in tip


def test_new_steps_carry_the_earlier_averages_on_as_the_monitor_does(trend_page):
    driver, log_dir = trend_page
    before, marked = drawn(driver), monitor_bins(log_dir, 0)["earlier_count"]
    append(log_dir, range(STEPS + 1, STEPS + 301))   # 1200 samples more: every earlier average moves on
    wait_for(driver, lambda d: drawn(d) != before)
    wait_for(driver, lambda d: follows_the_monitor(d, log_dir))   # the page's marks are the monitor's
    assert all(now > then for now, then in zip(monitor_bins(log_dir, 0)["earlier_count"][1:], marked[1:]))
