"""The dashboard page in a real headless Chromium driven by Selenium: charts, tooltips, zoom, polling.

Needs Debian's ``chromium`` and ``chromium-driver`` (and the ``selenium`` package of the dev extra);
skipped when they are absent, except where CI sets MBC_REQUIRE_BROWSER=1 and a missing browser fails.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

import pytest

import monitor_fixtures as F
from browser_helpers import browser_for_module, needs_browser
from test_server import start_server, stop_server

RANK_COLOURS = {0: (0x4c, 0xc3, 0x8a), 1: (0x5a, 0xa2, 0xff)}  # the page's palette for ranks 0 and 1
STEPS = 300
EPOCH_STEPS = 150
VIDEO_BYTES = b"\x00\x00\x00\x18ftypmp42" + bytes(64)   # the gallery needs only a listed file, not a decodable one

try:
    from selenium.webdriver.common.action_chains import ActionChains
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait
except ImportError:  # pragma: no cover - the dev extra installs it; needs_browser skips the tests
    pass

pytestmark = [pytest.mark.slow, needs_browser]


def write_run(log_dir):
    """Two ranks, 300 steps over two epochs, validation every 100 steps, a checkpoint after steps 100 and 200;
    rank 1 steps 1.5x slower."""
    now = time.time()
    for rank, step_time in ((0, 2.0), (1, 3.0)):
        lines = []
        for s in range(1, STEPS + 1):
            lines.append(F.history_line(s, rank, step_time_s=step_time, epoch=(s - 1) // EPOCH_STEPS,
                                        grad_norm=grad_norm_at(s, rank), samples=2))
            if s % 100 == 0 and s < STEPS:   # timed apart from the steps: never a point of a chart
                lines.append(json.dumps({"kind": "overhead", "overhead": "checkpoint", "step": s, "seconds": 4.6,
                                         "time": now}) + "\n")
        lines += [json.dumps({"step": s, "kind": "val", "val_loss": 0.3 - s / 10_000, "val_loss_by_quantile": {
            q: round(0.1 + float(q) / 2 - s / 10_000, 6) for q in ("0.1", "0.5", "0.9")}}) + "\n" for s in (100, 200, 300)]
        F.write_raw(log_dir / f"training_gpu{rank}.jsonl", "".join(lines))
        F.write_status(log_dir, rank, world_size=2, step=STEPS, total_steps=1000, step_time_s=step_time, now=now,
                       overheads={"checkpoint": {"count": 2, "total_s": 9.2, "last_s": 4.6, "mean_s": 4.6}},
                       gpu={"name": "H100", "util_pct": 97.0, "mem_used_mb": 22000.0, "mem_total_mb": 81559.0,
                            "peak_allocated_mb": 31027.0})


LONG_EPOCHS, LONG_EPOCH_STEPS = 20, 30
LONG_STEPS = LONG_EPOCHS * LONG_EPOCH_STEPS
LONG_TRACE_LINE = ("  File \"/opt/conda/envs/diffsynth/lib/python3.11/site-packages/torch/nn/parallel/distributed.py\", "
                   "line 1636, in _run_ddp_forward -> return self.module(*inputs, **kwargs)  # " + "x" * 120)


def write_long_failed_run(log_dir):
    """Two ranks that failed the same way at the end of 20 epochs: warm-up then cosine lr from 1e-3, the
    same loss on both ranks at every step (the lines lie on each other), a traceback with long lines."""
    now = time.time()
    error = {"type": "RuntimeError", "message": "CUDA out of memory. Tried to allocate 2.00 GiB",
             "traceback_tail": "Traceback (most recent call last):\n" + (LONG_TRACE_LINE + "\n") * 6
                               + "RuntimeError: CUDA out of memory. Tried to allocate 2.00 GiB"}
    for rank in (0, 1):
        F.write_raw(log_dir / f"training_gpu{rank}.jsonl", "".join(
            F.history_line(s, rank, epoch=(s - 1) // LONG_EPOCH_STEPS, loss=F.loss_at(s, 0), lr=long_lr_at(s),
                           grad_norm=0.5, samples=2) for s in range(1, LONG_STEPS + 1)))
        F.write_status(log_dir, rank, world_size=2, status="failed", step=LONG_STEPS, total_steps=LONG_STEPS, now=now,
                       epoch=LONG_EPOCHS - 1, num_epochs=LONG_EPOCHS, loss=F.loss_at(LONG_STEPS, 0),
                       lr=long_lr_at(LONG_STEPS), error=error, phase="failed",
                       gpu={"name": "Tesla V100S-PCIE-32GB", "util_pct": 0.0, "mem_used_mb": 31000.0,
                            "mem_total_mb": 32768.0, "peak_allocated_mb": 32100.0})


def long_lr_at(step):
    warm = 40
    if step <= warm:
        return 1e-3 * step / warm
    return 1e-3 * 0.5 * (1 + math.cos(math.pi * (step - warm) / (LONG_STEPS - warm)))


def grad_norm_at(step, rank):
    return round(0.5 + 0.4 * rank + 0.1 * (step % 7) / 7, 6)


@pytest.fixture(scope="module")
def browser(chromium):
    return browser_for_module(chromium, 1400, 1800)


@contextlib.contextmanager
def served_dashboard(browser, log_dir, width=None):
    """The dashboard of ``log_dir``, served on 127.0.0.1 and loaded (drawn once) in ``browser``, ``width`` CSS pixels
    wide if given; the page and the server go, and the window size comes back, when the block ends."""
    srv = start_server(log_dir)
    try:
        if width is not None:
            browser.set_window_size(width, 900)
        browser.get(srv.url)
        wait_for(browser, lambda d: d.execute_script("return document.body.dataset.ready") == "1")
        yield srv
    finally:
        browser.get("about:blank")
        if width is not None:
            browser.set_window_size(1400, 1800)
        stop_server(srv)


@pytest.fixture
def page(browser, tmp_path):
    """The dashboard of a fresh 2-rank run, loaded and drawn once."""
    log_dir = tmp_path / "training_logs"
    log_dir.mkdir()
    write_run(log_dir)
    browser.get_log("performance")  # forget what earlier tests asked for
    with served_dashboard(browser, log_dir) as srv:
        yield browser, srv


def wait_for(driver, condition, timeout=30):
    return WebDriverWait(driver, timeout, poll_frequency=0.1).until(condition)


def chart(driver, chart_id):
    box = driver.find_element(By.CSS_SELECTOR, f'.chartbox[data-chart="{chart_id}"]')
    return {
        "box": box,
        "series": box.get_attribute("data-series").split("|"),
        "points": [int(n) for n in box.get_attribute("data-points").split(",")],
        "epoch_marks": int(box.get_attribute("data-epoch-marks")),
        "x": (float(box.get_attribute("data-x-min")), float(box.get_attribute("data-x-max"))),
    }


def pixels_of_colour(driver, chart_id, rgb, tolerance=12):
    """How many canvas pixels of a chart have (about) this colour: proof the line was really drawn."""
    return driver.execute_script("""
        const [id, rgb, tol] = arguments;
        const canvas = document.querySelector('.chartbox[data-chart="' + id + '"] canvas');
        const data = canvas.getContext('2d').getImageData(0, 0, canvas.width, canvas.height).data;
        let n = 0;
        for (let i = 0; i < data.length; i += 4) {
          if (Math.abs(data[i] - rgb[0]) <= tol && Math.abs(data[i + 1] - rgb[1]) <= tol
              && Math.abs(data[i + 2] - rgb[2]) <= tol && data[i + 3] > 200) n++;
        }
        return n;""", chart_id, list(rgb), tolerance)


def test_every_metric_is_one_chart_with_both_ranks_drawn(page):
    driver, _ = page
    expected = {
        "loss": (["rank 0 raw", "rank 1 raw", "rank 0", "rank 1"], [STEPS] * 4),   # raw lines under the smoothed
        "val_loss": (["rank 0", "rank 1", "t=0.1", "t=0.5", "t=0.9"], [3] * 5),   # + each fixed timestep
        "lr": (["lr"], [STEPS]),  # once, not per rank
        "grad_norm": (["rank 0", "rank 1"], [STEPS, STEPS]),
        "step_time": (["rank 0", "rank 1 · slow"], [STEPS, STEPS]),  # rank 1 is the slow one, and says so
        "samples_per_s": (["rank 0", "rank 1"], [STEPS, STEPS]),
    }
    for chart_id, (series, points) in expected.items():
        c = chart(driver, chart_id)
        assert (c["series"], c["points"]) == (series, points), chart_id
        assert c["epoch_marks"] == 1, chart_id  # the second epoch starts at step 151
        assert c["x"] == (1.0, 300.0) or chart_id == "val_loss", (chart_id, c["x"])
    for chart_id in ("grad_norm", "step_time", "samples_per_s"):
        for rank, rgb in RANK_COLOURS.items():
            assert pixels_of_colour(driver, chart_id, rgb) > 50, (chart_id, rank)
    table = driver.find_element(By.ID, "ranks-body").text
    assert "300 / 1000" in table and "slow" in table
    assert "21.5 / 80 GB (peak 30.3)" in table
    assert driver.find_element(By.ID, "sum-overheads").text == "checkpoints 2 × 4.6 s"
    errors = [e for e in driver.get_log("browser") if e["level"] == "SEVERE"]
    assert errors == []  # no script errors


def test_hovering_shows_every_ranks_exact_values_at_that_step(page):
    driver, _ = page
    for chart_id, check in (("grad_norm", lambda step, values: values == {
                                f"rank {r}": pytest.approx(grad_norm_at(step, r), abs=1e-9) for r in (0, 1)}),
                            ("loss", lambda step, values: values["rank 0 raw"] == pytest.approx(F.loss_at(step, 0))
                             and values["rank 1 raw"] == pytest.approx(F.loss_at(step, 1))),
                            ("samples_per_s", lambda step, values: values == {"rank 0": 1.0,
                                                                             "rank 1": pytest.approx(2 / 3)})):
        over = chart(driver, chart_id)["box"].find_element(By.CSS_SELECTOR, ".u-over")
        ActionChains(driver).move_to_element_with_offset(over, -over.size["width"] * 3 // 10, 5).perform()  # from the centre
        tip = chart(driver, chart_id)["box"].find_element(By.CSS_SELECTOR, ".tip")
        wait_for(driver, lambda d: tip.is_displayed())
        step = int(tip.get_attribute("data-step"))
        assert 40 <= step <= 90, step  # a fifth of the way along 1..300
        values = json.loads(tip.get_attribute("data-values"))
        assert check(step, values), (chart_id, step, values)
        assert f"step {step}" in tip.text


def test_dragging_zooms_the_x_range_and_double_click_resets_it(page):
    driver, _ = page
    over = chart(driver, "loss")["box"].find_element(By.CSS_SELECTOR, ".u-over")
    width = over.size["width"]
    start = -width // 2 + width // 4   # offsets are from the centre of the element
    ActionChains(driver).move_to_element_with_offset(over, start, 0).click_and_hold() \
        .move_by_offset(width // 4, 0).release().perform()
    lo, hi = chart(driver, "loss")["x"]
    assert 60 <= lo < hi <= 160 and hi - lo < 100, (lo, hi)
    time.sleep(2.5)  # a poll comes and goes: the zoom stays
    assert chart(driver, "loss")["x"] == (lo, hi)
    ActionChains(driver).double_click(over).perform()
    wait_for(driver, lambda d: chart(d, "loss")["x"] == (1.0, 300.0))


def test_legend_hides_a_rank_and_loss_switches_to_log_scale(page):
    driver, _ = page
    box = chart(driver, "grad_norm")["box"]
    before = pixels_of_colour(driver, "grad_norm", RANK_COLOURS[1])
    entry = [e for e in box.find_elements(By.CSS_SELECTOR, ".u-legend .u-series") if "rank 1" in e.text][0]
    entry.find_element(By.CSS_SELECTOR, "th").click()
    wait_for(driver, lambda d: "u-off" in entry.get_attribute("class"))
    assert before > 50 and pixels_of_colour(driver, "grad_norm", RANK_COLOURS[1]) < before / 10

    loss = chart(driver, "loss")["box"]
    assert loss.get_attribute("data-scale") == "linear"
    loss.find_element(By.CSS_SELECTOR, 'input[data-control="log"]').click()
    wait_for(driver, lambda d: chart(d, "loss")["box"].get_attribute("data-scale") == "log")
    assert chart(driver, "loss")["points"] == [STEPS] * 4


def test_the_page_polls_only_new_points_and_asks_nothing_outside_the_server(page):
    driver, srv = page
    with open(srv.log_dir / "training_gpu0.jsonl", "a", encoding="utf-8") as handle:
        handle.write("".join(F.history_line(s, 0, epoch=1, grad_norm=0.5, samples=2) for s in range(301, 321)))
    wait_for(driver, lambda d: chart(d, "grad_norm")["points"] == [320, STEPS])
    assert chart(driver, "grad_norm")["x"] == (1.0, 320.0)

    requests = [json.loads(entry["message"])["message"] for entry in driver.get_log("performance")]
    urls = [m["params"]["request"]["url"] for m in requests if m["method"] == "Network.requestWillBeSent"]
    origin = srv.url.rstrip("/")
    assert urls and all(u.startswith(origin) for u in urls), [u for u in urls if not u.startswith(origin)]
    metrics = [parse_qs(urlsplit(u).query) for u in urls if "/api/training/metrics" in u]
    full_loads = [q for q in metrics if "points" in q]
    assert sorted(q["rank"][0] for q in full_loads) == ["0", "1"]  # the history once per rank...
    later = [q for q in metrics if "points" not in q]
    assert later and all("since" in q for q in later)  # ...then only what is newer
    assert any(q["rank"] == ["0"] and float(q["since"][0]) >= 300 for q in later)


@pytest.fixture
def failed_page(browser, tmp_path, request):
    """The dashboard of write_long_failed_run's run in a window ``request.param`` CSS pixels wide."""
    width = getattr(request, "param", 1280)
    log_dir = tmp_path / "training_logs"
    log_dir.mkdir()
    write_long_failed_run(log_dir)
    with served_dashboard(browser, log_dir, width):
        assert browser.execute_script("return innerWidth") == width
        yield browser


WIDTHS = [800, 1280, 1920]


@pytest.mark.parametrize("failed_page", WIDTHS, indirect=True)
def test_the_page_never_scrolls_sideways_and_the_rank_table_is_whole(failed_page):
    driver = failed_page
    width = driver.execute_script("return innerWidth")
    scroll = driver.execute_script("const s = document.scrollingElement; return [s.scrollWidth, s.clientWidth]")
    assert scroll[0] <= scroll[1], f"the page scrolls sideways at {width} px: {scroll}"
    table = driver.execute_script("const t = document.getElementById('ranks'), box = t.parentElement;"
                                  "return [t.getBoundingClientRect().right, box.getBoundingClientRect().right,"
                                  "        box.scrollWidth, box.clientWidth, t.innerText]")
    assert table[0] <= table[1] + 0.5 and table[2] <= table[3], f"the rank table is cut at {width} px: {table[:4]}"
    assert "600 / 600" in table[4] and "31.3" in table[4]


@pytest.mark.parametrize("failed_page", WIDTHS, indirect=True)
def test_epoch_labels_are_thinned_so_that_none_overlaps(failed_page):
    driver = failed_page
    width = driver.execute_script("return innerWidth")
    for chart_id in ("loss", "lr", "grad_norm", "step_time"):
        labels = json.loads(chart(driver, chart_id)["box"].get_attribute("data-epoch-labels") or "[]")
        assert len(labels) >= 3, (width, chart_id, labels)   # thinned, not dropped
        for (_, _, right), (text, left, _) in zip(labels, labels[1:]):
            assert right <= left, f"'{text}' overlaps the label before it at {width} px: {labels}"


def test_each_axis_labels_its_ticks_in_one_format(failed_page):
    driver = failed_page
    # the learning rate's: "1.0e-3" beside "7.5e-4", never "0.001" beside "8.0e-4"
    ticks = [t for t in json.loads(chart(driver, "lr")["box"].get_attribute("data-y-ticks") or "[]") if t and t != "0"]
    assert len(ticks) >= 3 and all(re.fullmatch(r"\d\.\de-\d", t) for t in ticks), ticks
    for chart_id in ("loss", "grad_norm"):   # one number of decimals per axis
        ticks = [t for t in json.loads(chart(driver, chart_id)["box"].get_attribute("data-y-ticks")) if t]
        assert len(ticks) >= 3 and len({len(t.partition(".")[2]) for t in ticks}) == 1, (chart_id, ticks)


@pytest.mark.parametrize("failed_page", WIDTHS, indirect=True)
def test_the_same_error_on_both_ranks_is_said_once_and_its_traceback_wraps(failed_page):
    driver = failed_page
    traces = driver.find_elements(By.CSS_SELECTOR, "#errors pre")
    assert traces and all(driver.execute_script("return arguments[0].scrollWidth <= arguments[0].clientWidth", pre)
                          for pre in traces), "a traceback scrolls sideways"
    headings = [h.text for h in driver.find_elements(By.CSS_SELECTOR, "#errors h2")]
    assert headings == ["Ranks 0-1 failed on node-a: RuntimeError: CUDA out of memory. Tried to allocate 2.00 GiB"]
    assert len(traces) == 1 and "RuntimeError: CUDA out of memory" in traces[0].text   # its end is in view


@pytest.mark.parametrize("failed_page", [800], indirect=True)
def test_the_charts_start_on_the_first_screen_at_800_px(failed_page):
    driver = failed_page
    top = driver.execute_script("return document.querySelector('.chartbox').getBoundingClientRect().top")
    assert top + 100 <= driver.execute_script("return innerHeight"), top


def test_rank_0s_line_shows_where_rank_1_has_the_same_values(failed_page):
    """Both ranks log the same loss and gradient norm: rank 1's line is drawn over rank 0's and hid it."""
    driver = failed_page
    for chart_id in ("loss", "grad_norm"):
        counts = {rank: pixels_of_colour(driver, chart_id, rgb) for rank, rgb in RANK_COLOURS.items()}
        assert counts[0] > 200 and counts[1] > 200, (chart_id, counts)


def test_the_gallery_shows_a_playable_video_per_prompt_and_sample_step(browser, tmp_path):
    """Real mp4 files as the training writes them (DiffSynth's save_video), two prompts at three steps."""
    import numpy as np
    from diffsynth import save_video
    from PIL import Image

    output = tmp_path / "lora"
    samples = output / "samples"
    for step in (0, 6, 12):
        folder = samples / f"step-{step:08d}"
        folder.mkdir(parents=True)
        for index, slug in ((1, "a-news-anchor"), (2, "prompt")):
            frames = [Image.fromarray(np.full((64, 96, 3), (step * 20 + index * 60 + t * 5) % 255, np.uint8))
                      for t in range(9)]
            save_video(frames, str(folder / f"{index:02d}-{slug}.mp4"), fps=16, quality=8)
            frames[0].save(folder / f"{index:02d}-{slug}.png")
    log_dir = output / "training_logs"
    F.make_run(log_dir, world_size=1, steps=12, now=time.time(), samples_dir=str(samples.resolve()))
    srv = start_server(log_dir)
    browser.get_log("performance")
    try:
        browser.get(srv.url)
        wait_for(browser, lambda d: len(d.find_elements(By.CSS_SELECTOR, "#gallery video")) == 6)
        rows = browser.find_elements(By.CSS_SELECTOR, "#gallery tr[data-prompt]")
        assert [r.get_attribute("data-prompt") for r in rows] == ["1", "2"]
        # sets from before prompts files were kept: the file names' words stand in for the prompts
        assert [r.find_element(By.CSS_SELECTOR, "th").text for r in rows] == ["1. a news anchor", "2. prompt"]
        for row in rows:
            assert [c.get_attribute("data-step") for c in row.find_elements(By.CSS_SELECTOR, "td")] == ["0", "6", "12"]
        # every source loads: metadata known (readyState >= 1), the clip's own size, no media error
        wait_for(browser, lambda d: d.execute_script(
            "return Array.from(document.querySelectorAll('#gallery video')).every(v => v.readyState >= 1)"))
        sizes = browser.execute_script("return Array.from(document.querySelectorAll('#gallery video'))"
                                       ".map(v => [v.videoWidth, v.videoHeight, v.error === null])")
        assert sizes == [[96, 64, True]] * 6
        first = browser.find_element(By.CSS_SELECTOR, "#gallery video")
        ActionChains(browser).move_to_element(first).perform()   # hovering plays it
        wait_for(browser, lambda d: d.execute_script("return arguments[0].currentTime > 0", first))
        urls = [json.loads(e["message"])["message"]["params"]["request"]["url"]
                for e in browser.get_log("performance")
                if json.loads(e["message"])["message"]["method"] == "Network.requestWillBeSent"]
        assert all(u.startswith(srv.url.rstrip("/")) for u in urls) and any("/samples/step-" in u for u in urls)
    finally:
        browser.get("about:blank")
        stop_server(srv)


def test_the_gallery_shows_each_prompt_in_full_in_its_own_script(browser, tmp_path):
    """A Korean prompt was shown as '1. PROMPT' and an English one cut and upper-cased: each row now says the
    prompt exactly as written, from the prompts file beside the clips."""
    from diffsynth_mbc.atomic import atomic_write_json
    from diffsynth_mbc.sample_prompts import load_sample_prompts, prompts_file_record, sample_file_stem

    texts = ["도시 거리 밤, 비가 내린다", "A News Anchor reads the evening headlines while the camera slowly pushes "
             "in under warm studio light"]
    (tmp_path / "prompts.yaml").write_text("".join(f"- {t}\n" for t in texts), encoding="utf-8")
    prompts = load_sample_prompts(tmp_path / "prompts.yaml", height=64, width=96, num_frames=9, seed=1)
    samples = tmp_path / "lora" / "samples"
    for step in (0, 4):
        folder = samples / f"step-{step:08d}"
        folder.mkdir(parents=True)
        for index, prompt in enumerate(prompts):
            (folder / f"{sample_file_stem(index, prompt)}.png").write_bytes(b"\x89PNG")
            F.write_raw(folder / f"{sample_file_stem(index, prompt)}.mp4", VIDEO_BYTES)
        atomic_write_json(folder / "prompts.json", prompts_file_record(prompts))
    log_dir = tmp_path / "lora" / "training_logs"
    F.make_run(log_dir, world_size=1, steps=4, now=time.time(), samples_dir=str(samples.resolve()))
    srv = start_server(log_dir)
    try:
        browser.get(srv.url)
        wait_for(browser, lambda d: len(d.find_elements(By.CSS_SELECTOR, "#gallery video")) == 4)
        rows = browser.find_elements(By.CSS_SELECTOR, "#gallery tr[data-prompt]")
        # WebDriver's text is what is shown: CSS upper-casing or clipping would show here
        assert [r.find_element(By.CSS_SELECTOR, "th").text for r in rows] == [f"1. {texts[0]}", f"2. {texts[1]}"]
        label = rows[1].find_element(By.CSS_SELECTOR, "th")
        assert label.size["height"] > 2 * 16 and browser.execute_script(
            "return arguments[0].scrollWidth <= arguments[0].clientWidth", label)   # wrapped, not cut
    finally:
        browser.get("about:blank")
        stop_server(srv)


def test_the_page_opened_from_its_token_url_reads_the_api_through_its_cookie(browser, tmp_path):
    # Bound to every interface, the server wants its token on every request: the page gets it once, in its URL.
    log_dir = tmp_path / "training_logs"
    log_dir.mkdir()
    write_run(log_dir)
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[2]))
    proc = subprocess.Popen([sys.executable, "-m", "diffsynth_mbc.monitor", str(log_dir), "--serve", "0.0.0.0:0",
                             "--no-view"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        match = re.search(r"http://[^/\s]+:(\d+)/\?token=([A-Za-z0-9_-]+)", proc.stdout.readline())
        assert match
        browser.get(f"http://127.0.0.1:{match.group(1)}/?token={match.group(2)}")
        wait_for(browser, lambda d: d.execute_script("return document.body.dataset.ready") == "1")
        assert chart(browser, "loss")["points"] == [STEPS] * 4 and chart(browser, "grad_norm")["points"] == [STEPS] * 2
        assert browser.execute_script("return document.cookie") == ""   # HttpOnly: no script on the page reads it
    finally:
        browser.get("about:blank")
        proc.kill()
        proc.wait()
