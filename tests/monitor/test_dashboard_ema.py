"""The validation chart in a real headless Chromium with `--validate_with both`: the EMA's validation loss is a
dotted line per rank beside the trained weights', from the first load and from later polls. (A run without an EMA
draws no such line: test_dashboard_browser.py checks the validation chart's series exactly.)"""

from __future__ import annotations

import json
import time

import monitor_fixtures as F
from test_dashboard_browser import browser, chart, pytestmark, served_dashboard, wait_for  # noqa: F401


def validation(step, rank):
    return json.dumps({"step": step, "kind": "val", "val_loss": 0.3 - step / 10_000 + rank / 100,
                       "val_loss_ema": 0.28 - step / 10_000 + rank / 100, "val_weights": "both"}) + "\n"


def test_the_emas_validation_loss_is_a_line_per_rank_and_follows_new_records(browser, tmp_path):
    log_dir = tmp_path / "training_logs"
    log_dir.mkdir()
    now = time.time()
    for rank in (0, 1):
        lines = [F.history_line(s, rank, epoch=0, samples=2) for s in range(1, 201)]
        lines += [validation(s, rank) for s in (100, 200)]
        F.write_raw(log_dir / f"training_gpu{rank}.jsonl", "".join(lines))
        F.write_status(log_dir, rank, world_size=2, step=200, total_steps=1000, now=now)
    with served_dashboard(browser, log_dir):
        c = chart(browser, "val_loss")
        assert c["series"] == ["rank 0", "rank 1", "rank 0 EMA", "rank 1 EMA"], c["series"]
        assert c["points"] == [2, 2, 2, 2]
        for rank in (0, 1):   # a later validation reaches the page through the incremental poll
            with open(log_dir / f"training_gpu{rank}.jsonl", "a", encoding="utf-8") as handle:
                handle.write("".join(F.history_line(s, rank, epoch=0, samples=2) for s in range(201, 301)))
                handle.write(validation(300, rank))
        wait_for(browser, lambda d: chart(d, "val_loss")["points"] == [3, 3, 3, 3])
        legend = chart(browser, "val_loss")["box"].find_element("css selector", ".u-legend").text
        assert "rank 0 EMA" in legend and "rank 1 EMA" in legend
