"""The dashboard's "samples and loss per bucket" panel in a real headless Chromium: a row per shape bucket with each
rank's samples and mean loss, as the monitor computes them, from the first load and carried on by the page as new
steps arrive; hidden for a run whose history has no shapes (an older run's)."""

from __future__ import annotations

import json
import time

import pytest

import monitor_fixtures as F
from diffsynth_mbc.monitor.history import HistoryFile
from diffsynth_mbc.monitor.view import fmt_loss
from test_dashboard_browser import browser, pytestmark, served_dashboard, wait_for  # noqa: F401

STEPS = 60
OLD_STEPS = 10   # rank 0's first steps were written before buckets: no shapes


def step_record(step, rank):
    """Rank 0: a 1280x704 video and an image of it, and a 960x960 video every third step; rank 1: a 960x960 image
    and a 960x960 video (one size, two buckets). Losses with many digits, drifting with the step."""
    if rank == 0:
        shapes = [[33, 704, 1280], [1, 704, 1280]] + ([[49, 960, 960]] if step % 3 == 0 else [])
    else:
        shapes = [[1, 960, 960], [49, 960, 960]]
    losses = [round(0.2 + 0.1 * k + ((step * 37 + k * 11) % 17) / 1000 + rank / 100, 6) for k in range(len(shapes))]
    record = {"step": step, "epoch": 0, "loss": sum(losses) / len(losses), "lr": 1e-4, "step_time_s": 2.0,
              "samples": len(shapes), "time": F.NOW + step, "timesteps": [100.0 + 300 * k for k in range(len(shapes))],
              "timestep_losses": losses, "modes": ["t2v" if s[0] > 1 else "t2i" for s in shapes]}
    if rank == 1 or step > OLD_STEPS:
        record["shapes"] = shapes
    return json.dumps(record) + "\n"


def append(log_dir, steps):
    for rank in (0, 1):
        with open(log_dir / f"training_gpu{rank}.jsonl", "a", encoding="utf-8") as handle:
            handle.write("".join(step_record(s, rank) for s in steps))


def monitor_buckets(log_dir):
    """{bucket: {rank: (samples, mean loss)}} as the monitor reads the histories now."""
    out = {}
    for rank in (0, 1):
        history = HistoryFile(log_dir / f"training_gpu{rank}.jsonl")
        history.poll()
        for name, bucket in history.buckets.as_dict().items():
            out.setdefault(name, {})[rank] = (bucket["samples"], bucket["loss"])
    return out


def panel_rows(driver):
    """{bucket: {rank: (samples, mean loss, the loss as written)}} as the page shows them."""
    return driver.execute_script("""
        const out = {};
        for (const tr of document.querySelectorAll('#buckets tr[data-bucket]')) {
          const row = out[tr.dataset.bucket] = {};
          for (const td of tr.querySelectorAll('td[data-field="samples"]')) {
            if (td.textContent === '-') continue;
            const loss = tr.querySelector('td[data-field="loss"][data-rank="' + td.dataset.rank + '"]');
            row[td.dataset.rank] = [Number(td.textContent), Number(loss.dataset.value), loss.textContent];
          }
        }
        return out;""")


def panel_matches_the_monitor(driver, log_dir):
    shown, want = panel_rows(driver), monitor_buckets(log_dir)
    if list(shown) != list(want):
        return False
    for name, ranks in want.items():
        got = {int(rank): cells for rank, cells in shown[name].items()}
        if set(got) != set(ranks):
            return False
        for rank, (samples, loss) in ranks.items():
            if got[rank][0] != samples or got[rank][1] != pytest.approx(loss, rel=1e-9) \
                    or got[rank][2] != fmt_loss(got[rank][1]):
                return False
    return True


@pytest.fixture(scope="module")
def bucket_page(browser, tmp_path_factory):
    log_dir = tmp_path_factory.mktemp("buckets") / "training_logs"
    log_dir.mkdir()
    append(log_dir, list(range(1, STEPS + 1)))
    for rank in (0, 1):
        F.write_status(log_dir, rank, world_size=2, step=STEPS, total_steps=1000, now=time.time())
    with served_dashboard(browser, log_dir):
        yield browser, log_dir


def test_the_panel_shows_each_buckets_samples_and_loss_per_rank_and_follows_new_steps(bucket_page, tmp_path):
    driver, log_dir = bucket_page
    wait_for(driver, lambda d: panel_matches_the_monitor(d, log_dir))
    rows = panel_rows(driver)
    assert list(rows) == ["1280x704", "1280x704 image", "960x960", "960x960 image"]   # by name
    assert rows["1280x704"]["0"][0] == STEPS - OLD_STEPS and "1" not in rows["1280x704"]   # old records count nowhere
    assert rows["960x960"]["0"][0] == 17 and rows["960x960"]["1"][0] == STEPS   # steps 12, 15, ... 60 on rank 0
    assert rows["960x960 image"]["1"][0] == STEPS and "0" not in rows["960x960 image"]
    panel = driver.find_element("id", "buckets-box")
    assert panel.is_displayed() and panel.size["width"] > 0 and panel.size["height"] > 0
    assert "Samples and loss per bucket" in panel.text and "RANK 1 LOSS" in panel.text   # th: upper case
    shot = tmp_path / "buckets.png"   # what the panel looks like, for a person reading a failure
    driver.execute_script("arguments[0].scrollIntoView()", panel)   # below the charts: a screenshot is of the window
    assert panel.screenshot(str(shot)) and shot.stat().st_size > 0
    append(log_dir, list(range(STEPS + 1, STEPS + 31)))   # read on record by record by the page
    wait_for(driver, lambda d: panel_rows(d)["1280x704"]["0"][0] == STEPS + 30 - OLD_STEPS
             and panel_matches_the_monitor(d, log_dir))
    assert [e for e in driver.get_log("browser") if e["level"] == "SEVERE"] == []


def test_the_panel_is_hidden_for_a_history_without_shapes(browser, tmp_path):
    log_dir = F.make_run(tmp_path / "training_logs", world_size=2, steps=40, now=time.time())
    with served_dashboard(browser, log_dir):
        wait_for(browser, lambda d: d.execute_script("return document.body.dataset.ranksDrawn") == "2")
        panel = browser.find_element("id", "buckets-box")
        assert not panel.is_displayed() and panel_rows(browser) == {}
        assert browser.find_element("css selector", '.chartbox[data-chart="loss"]').is_displayed()
