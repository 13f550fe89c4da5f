"""The best LoRA on the dashboard, in a real headless Chromium: a card with its step, validation loss, gain over the
base and file, where --early_stop's count stands (and why the run stopped early, when it did, in the words of the
run's summary), and a ring marked "best" on the validation chart at that step; a run without one shows neither."""

from __future__ import annotations

import json

import health_run as H
import monitor_fixtures as F
from test_dashboard_browser import (browser, chart, pixels_of_colour, pytestmark, served_dashboard,  # noqa: F401
                                    wait_for)

BEST_STEP = 90
BEST = {"step": BEST_STEP, "val_loss": sum(H.val_loss(BEST_STEP, q) for q in H.QUANTILES) / 3,
        "val_loss_base": sum(H.base_loss(q) for q in H.QUANTILES) / 3, "file": "runs/full/lora/lora-best.safetensors"}
BEST["gain"] = (BEST["val_loss_base"] - BEST["val_loss"]) / BEST["val_loss_base"]
EARLY = {"step": 120, "best_step": BEST_STEP, "validations_without_improvement": 1, "since_step": BEST_STEP,
         "since_val_loss": BEST["val_loss"], "patience": 1, "min_delta": 0.001}
COUNT = {"step": 110, "count": 2, "patience": 3, "min_delta": 0.001, "not_counted": None, "counts_from_step": 11,
         "finite": True, "compared_with_step": 90, "change": -0.0004, "reset": False, "since_step": 90}
YELLOW = (242, 201, 76)


def test_the_best_lora_has_a_card_and_a_ring_on_the_validation_chart(browser, tmp_path):
    log_dir = tmp_path / "training_logs"
    log_dir.mkdir()
    H.write_health_run(log_dir)
    for rank in (0, 1):   # the status files as an early-stopped run leaves them
        path = log_dir / f"training_gpu{rank}.json"
        state = json.loads(path.read_text())
        F.write_raw(path, json.dumps({**state, "best": BEST, "early_stop": EARLY}))
    with served_dashboard(browser, log_dir):
        wait_for(browser, lambda d: not d.find_element("id", "best-card").get_attribute("hidden"))
        card = browser.find_element("id", "best-card").text
        assert "step 90" in card and BEST["file"] in card
        assert f"({100 * BEST['gain']:.2f}% below the base)" in card
        assert ("stopped early at step 120: 1 validation in a row since step 90 without the 0.10% improvement that "
                "resets the count (--early_stop 1)") in card
        box = chart(browser, "val_loss")["box"]
        wait_for(browser, lambda d: box.get_attribute("data-best"))
        step, x, y = json.loads(box.get_attribute("data-best"))
        assert step == BEST_STEP and x > 0 and y > 0
        assert pixels_of_colour(browser, "val_loss", YELLOW) > 20   # the ring and its label, drawn


def test_the_card_says_where_the_early_stop_count_stands_while_the_run_goes_on(browser, tmp_path):
    log_dir = tmp_path / "training_logs"
    log_dir.mkdir()
    H.write_health_run(log_dir)
    for rank in (0, 1):
        path = log_dir / f"training_gpu{rank}.json"
        state = json.loads(path.read_text())
        F.write_raw(path, json.dumps({**state, "best": BEST, "early_stop_count": COUNT}))
    with served_dashboard(browser, log_dir):
        wait_for(browser, lambda d: "early stop" in d.find_element("id", "best-card").text)
        card = browser.find_element("id", "best-card").text
        assert ("early stop: 2 of 3 validations since step 90 without the 0.10% improvement that resets the count"
                in card)
        assert "stopped early" not in card


def test_a_run_without_a_best_shows_no_card_and_no_ring(browser, tmp_path):
    log_dir = tmp_path / "training_logs"
    log_dir.mkdir()
    H.write_health_run(log_dir)
    with served_dashboard(browser, log_dir):
        wait_for(browser, lambda d: d.execute_script("return document.body.dataset.ranksDrawn") == "2")
        assert browser.find_element("id", "best-card").get_attribute("hidden")
        assert not chart(browser, "val_loss")["box"].get_attribute("data-best")
        assert pixels_of_colour(browser, "val_loss", YELLOW) == 0


STAGES = [{"stage": 1, "size": "832x480x17", "from_step": 1, "to_step": 70, "steps": 70, "tokens": 1950},
          {"stage": 2, "size": "1280x704x17", "from_step": 71, "to_step": 120, "steps": 50, "tokens": 4400}]


def test_resolution_stages_are_said_beside_the_step_and_marked_on_the_charts(browser, tmp_path):
    log_dir = tmp_path / "training_logs"
    log_dir.mkdir()
    H.write_health_run(log_dir)
    for rank in (0, 1):
        path = log_dir / f"training_gpu{rank}.json"
        state = json.loads(path.read_text())
        best = {**BEST, "stage": {"stage": 1, "of": 2, "size": "832x480x17", "final": False}}   # trained in stage 1
        F.write_raw(path, json.dumps({**state, "stages": STAGES, "stage": {**STAGES[1], "of": 2, "final": True},
                                      "best": best}))
    with served_dashboard(browser, log_dir):
        wait_for(browser, lambda d: d.find_element("id", "sum-stage").text)
        assert browser.find_element("id", "sum-stage").text == "stage 2/2: 1280x704x17"
        wait_for(browser, lambda d: not d.find_element("id", "best-card").get_attribute("hidden"))
        assert "trained at stage 1/2 (832x480x17), not the final size" in browser.find_element("id", "best-card").text
        for chart_id in ("loss", "val_loss"):
            box = chart(browser, chart_id)["box"]
            wait_for(browser, lambda d, box=box: box.get_attribute("data-stage-marks"))
            assert json.loads(box.get_attribute("data-stage-marks")) == [71], chart_id
