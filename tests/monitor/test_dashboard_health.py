"""Issue #30's dashboard panels in a real headless Chromium: the validation gain over the base model (a line per
quantile and rank, base - LoRA), the LoRA health heat map (DiT blocks x health records, rank 0's) and the newest
flags of every rank, the recipe and each catalogue's progress this epoch; from the first load and carried on by the
page as new records arrive; nothing scrolls sideways at 800 or 1920 px (screenshots of both are saved)."""

from __future__ import annotations

import json
import time

import pytest
from selenium.webdriver.common.action_chains import ActionChains

import health_run as H
import monitor_fixtures as F
from test_dashboard_browser import (browser, chart, pixels_of_colour, pytestmark, served_dashboard,  # noqa: F401
                                    wait_for)

MORE = 30   # steps appended while the page is open
QUANTILE_LABELS = ["mean"] + [f"t={q}" for q in H.QUANTILES]


@pytest.fixture(scope="module")
def health_page(browser, tmp_path_factory):
    log_dir = tmp_path_factory.mktemp("health") / "training_logs"
    log_dir.mkdir()
    H.write_health_run(log_dir)
    with served_dashboard(browser, log_dir):
        wait_for(browser, lambda d: d.execute_script("return document.body.dataset.ranksDrawn") == "2")
        yield browser, log_dir


def append(log_dir, steps):
    for rank in (0, 1):
        with open(log_dir / f"training_gpu{rank}.jsonl", "a", encoding="utf-8") as handle:
            handle.write(H.history_lines(rank, steps))


def expected_gain(label, last_step):
    """{step: base - LoRA} of one line of the gain chart ("t=0.5 · rank 1", "mean · rank 0")."""
    key = label.split(" · ")[0]
    steps = range(H.VAL_EVERY, last_step + 1, H.VAL_EVERY)
    if key == "mean":
        return {s: sum(H.base_loss(q) for q in H.QUANTILES) / 3 - sum(H.val_loss(s, q) for q in H.QUANTILES) / 3
                for s in steps}
    return {s: H.base_loss(key[2:]) - H.val_loss(s, key[2:]) for s in steps}


def gain_drawn(driver):
    """{label: {step: value}} of the gain chart as drawn."""
    box = chart(driver, "val_gain")["box"]
    steps = json.loads(box.get_attribute("data-steps") or "[]")
    values = json.loads(box.get_attribute("data-values") or "[]")
    labels = box.get_attribute("data-series").split("|")
    return {label: {s: v for s, v in zip(steps, ys) if v is not None} for label, ys in zip(labels, values)}


def gain_matches(driver, last_step):
    drawn = gain_drawn(driver)
    want = [f"{label} · rank {rank}" for label in QUANTILE_LABELS for rank in (0, 1)]
    return list(drawn) == want and all(drawn[label] == pytest.approx(expected_gain(label, last_step), abs=1e-9)
                                       for label in want)


def heat(driver):
    box = driver.find_element("css selector", '.chartbox[data-chart="health"]')
    return {"box": box, "blocks": int(box.get_attribute("data-blocks") or 0),
            "steps": json.loads(box.get_attribute("data-steps") or "[]"),
            "cells": int(box.get_attribute("data-cells") or 0),
            "values": json.loads(box.get_attribute("data-values") or "[]")}


def test_the_gain_chart_draws_base_minus_lora_per_quantile_and_rank_above_zero(health_page):
    driver, log_dir = health_page
    wait_for(driver, lambda d: gain_matches(d, H.STEPS))
    c = chart(driver, "val_gain")
    assert c["box"].is_displayed() and "above 0: the LoRA beats the base" in c["box"].text
    styles = dict(zip(c["series"], json.loads(c["box"].get_attribute("data-styles"))))
    assert styles["t=0.5 · rank 0"] == [3, None] and styles["t=0.5 · rank 1"] == [1.5, [6, 6]]   # the ranks' style
    ticks = [float(t) for t in json.loads(c["box"].get_attribute("data-y-ticks")) if t]
    assert min(ticks) <= 0 < max(ticks)   # 0 is always in view: which side a line lies on shows
    assert pixels_of_colour(driver, "val_gain", (0xe4, 0xe9, 0xf0), tolerance=8) > 50   # the mean's line
    append(log_dir, range(H.STEPS + 1, H.STEPS + MORE + 1))   # read on record by record by the page
    wait_for(driver, lambda d: gain_matches(d, H.STEPS + MORE))
    assert [e for e in driver.get_log("browser") if e["level"] == "SEVERE"] == []


def test_the_heat_map_has_a_cell_per_block_and_health_record_and_tells_each_cells_value(health_page):
    driver, log_dir = health_page
    wait_for(driver, lambda d: heat(d)["steps"] and heat(d)["steps"][-1] >= H.STEPS)
    last = heat(driver)["steps"][-1]   # the test before may have appended records
    steps = list(range(0, last + 1, H.HEALTH_EVERY))
    m = heat(driver)
    assert m["box"].is_displayed() and m["box"].get_attribute("data-rank") == "0"
    assert (m["blocks"], m["steps"], m["cells"]) == (H.BLOCKS, steps, H.BLOCKS * len(steps))
    assert m["values"] == [[H.update_norm(s, b) for b in range(H.BLOCKS)] for s in steps]
    assert "log scale" in m["box"].text and "not finite" in m["box"].text and "DiT block" in m["box"].text
    low, high = json.loads(m["box"].get_attribute("data-range"))
    assert low == pytest.approx(H.update_norm(H.HEALTH_EVERY, 0), rel=1e-6) and high == pytest.approx(
        max(H.update_norm(last, b) for b in range(H.BLOCKS)), rel=1e-6)
    canvas = m["box"].find_element("css selector", "canvas")
    counts = driver.execute_script("""
        const c = arguments[0], d = c.getContext('2d').getImageData(0, 0, c.width, c.height).data;
        let red = 0, yellow = 0;
        for (let i = 0; i < d.length; i += 4) {
          if (Math.abs(d[i] - 0xff) < 10 && Math.abs(d[i + 1] - 0x6b) < 10 && Math.abs(d[i + 2] - 0x6b) < 10) red++;
          if (d[i] > 0xe8 && d[i + 1] > 0xd8 && d[i + 2] < 0x50) yellow++;
        }
        return [red, yellow];""", canvas)
    assert counts[0] > 20 and counts[1] > 20, counts   # the non-finite cell, the largest updates
    columns = json.loads(m["box"].get_attribute("data-columns"))
    top, height = float(m["box"].get_attribute("data-cell-top")), float(m["box"].get_attribute("data-cell-height"))
    x, y = sum(columns[steps.index(50)]) / 2, top + 7.5 * height   # step 50, block 7: not finite
    ActionChains(driver).move_to_element_with_offset(canvas, int(x - canvas.size["width"] / 2),
                                                     int(y - canvas.size["height"] / 2)).perform()
    tip = m["box"].find_element("css selector", ".tip")
    wait_for(driver, lambda d: tip.is_displayed())
    assert "step 50 · block 7" in tip.text and "not finite" in tip.text and "gradient norm: 1.70e-1" in tip.text
    append(log_dir, range(last + 1, last + 2 * H.HEALTH_EVERY + 1))
    wait_for(driver, lambda d: heat(d)["steps"][-1] == last + 2 * H.HEALTH_EVERY)
    assert heat(driver)["cells"] == H.BLOCKS * (len(steps) + 2)


def test_the_newest_flags_of_every_rank_are_said_once_above_the_charts_with_what_to_do(health_page):
    driver, _ = health_page
    box = driver.find_element("id", "health-box")
    wait_for(driver, lambda d: box.is_displayed())
    items = {e.get_attribute("data-flag"): e for e in box.find_elements("css selector", ".flag")}
    assert list(items) == ["still", "overfitting"]
    assert H.STILL["what"] in items["still"].text and H.STILL["do"] in items["still"].text
    assert "Ranks 0-1" in items["still"].text and "Rank 0" in items["overfitting"].text
    assert "What to do: " + H.OVERFIT["do"] in items["overfitting"].text
    tops = driver.execute_script("return ['health-box', 'charts'].map((id) => "
                                 "document.getElementById(id).getBoundingClientRect().top)")
    assert tops[0] < tops[1], tops   # above the charts, under the rank table


def test_the_recipe_and_each_catalogues_progress_per_rank_are_shown(health_page):
    driver, _ = health_page
    recipe = driver.find_element("id", "recipe-box")
    wait_for(driver, lambda d: recipe.is_displayed())
    rows = {e.get_attribute("data-key"): e.find_element("css selector", ".v").text
            for e in recipe.find_elements("css selector", ".kv")}
    assert list(rows) == list(H.RECIPE)   # every entry, as the run wrote it, in its order
    assert rows["buckets"] == "aspect" and rows["learning_rate"] == "0.0001" and rows["objective"] == "modes"
    assert all(f"{key} {value}" in rows["lora"] for key, value in (("variant", "dora"), ("rank", 32), ("alpha", 16),
                                                                   ("loraplus_lr_ratio", "none")))
    assert "decay 0.999" in rows["ema"] and 'prefix ""' in rows["captions"] and "method logit_normal" in \
        rows["timestep_sampling"]
    assert all(item["metadata_path"] in rows["catalogues"] for item in H.RECIPE["catalogues"])
    cards = driver.find_elements("css selector", "#catalogues .cats")
    assert [c.get_attribute("data-rank") for c in cards] == ["0", "1"]
    for card, rank in zip(cards, (0, 1)):
        shown = [(r.find_element("css selector", ".name").text, r.find_element("css selector", ".count").text)
                 for r in card.find_elements("css selector", ".cat")]
        assert shown == [(f"{name}:", f"{seen} / {per}") for name, seen, per in H.CATALOGUES[rank]]
        bars = [r.find_element("css selector", ".bar > div").get_attribute("style")
                for r in card.find_elements("css selector", ".cat")]
        assert bars[2] == ("width: 100%;" if rank == 0 else "width: 94.3%;"), bars   # 70 / 70, 66 / 70


@pytest.mark.parametrize("width", [800, 1920])
def test_nothing_scrolls_sideways_and_each_new_panel_is_whole(browser, tmp_path_factory, width):
    log_dir = tmp_path_factory.mktemp(f"health-{width}") / "training_logs"
    log_dir.mkdir()
    H.write_health_run(log_dir)
    with served_dashboard(browser, log_dir, width):
        wait_for(browser, lambda d: d.execute_script("return document.body.dataset.ranksDrawn") == "2"
                 and d.find_element("id", "recipe-box").is_displayed())
        page = browser.execute_script("const s = document.scrollingElement; return [s.scrollWidth, s.clientWidth]")
        assert page[0] <= page[1], f"the page scrolls sideways at {width} px: {page}"
        for panel in ("health-box", "catalogues-box", "recipe-box", "chart-val_gain", "chart-health", "ranks"):
            edges = browser.execute_script("""
                const e = document.getElementById(arguments[0]), r = e.getBoundingClientRect();
                const box = e.id === 'ranks' ? e.parentElement : e;
                return [r.right, document.scrollingElement.clientWidth, box.scrollWidth, box.clientWidth,
                        r.width * r.height];""", panel)
            assert edges[0] <= edges[1] + 0.5 and edges[2] <= edges[3] and edges[4] > 0, (width, panel, edges)
        canvas = browser.execute_script("const c = document.querySelector('#chart-health canvas');"
                                        "return [c.getBoundingClientRect().right,"
                                        "        c.parentElement.getBoundingClientRect().right]")
        assert canvas[0] <= canvas[1] + 0.5, (width, canvas)
        shots = tmp_path_factory.getbasetemp() / "dashboard-shots"   # for a person to look at
        shots.mkdir(exist_ok=True)
        height = browser.execute_script("return document.scrollingElement.scrollHeight")
        browser.set_window_size(width, height + 100)   # the whole page in one screenshot
        time.sleep(0.5)
        assert browser.save_screenshot(str(shots / f"dashboard-{width}.png"))
        assert [e for e in browser.get_log("browser") if e["level"] == "SEVERE"] == []


def test_an_older_runs_page_shows_none_of_the_new_panels(browser, tmp_path):
    log_dir = F.make_run(tmp_path / "training_logs", world_size=2, steps=40, now=time.time())
    with open(log_dir / "training_gpu0.jsonl", "a", encoding="utf-8") as handle:   # validation without the base
        handle.write(json.dumps({"kind": "val", "step": 40, "val_loss": 0.3,
                                 "val_loss_by_quantile": {"0.5": 0.3}}) + "\n")
    with served_dashboard(browser, log_dir):
        wait_for(browser, lambda d: d.execute_script("return document.body.dataset.ranksDrawn") == "2")
        assert chart(browser, "val_loss")["points"][0] == 1
        for panel in ("chart-val_gain", "chart-health", "health-box", "catalogues-box", "recipe-box"):
            assert not browser.find_element("id", panel).is_displayed(), panel
