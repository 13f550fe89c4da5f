"""The gallery of a --sample_strengths sweep in headless Chromium: per prompt one row with the base model's clip,
then each sample step's clips of every LoRA strength, the EMA's beside the raw weights', side by side.

Uses test_dashboard_browser's browser and skips (Debian's chromium and chromium-driver, selenium)."""

from __future__ import annotations

import time

import monitor_fixtures as F
from test_dashboard_browser import browser, pytestmark, wait_for  # noqa: F401  (fixture, skips)
from test_server import start_server, stop_server

try:
    from selenium.webdriver.common.by import By
except ImportError:  # pragma: no cover - skipped with the rest of the browser tests
    By = None

WIDE = (2400, 1400)   # the whole sweep in the window, for the screenshot


def write_clip(path, colour, size=(96, 64)):
    """A real 9-frame mp4 of one colour (the gallery shows each clip's own size) and its first frame."""
    import imageio
    import numpy as np
    from PIL import Image

    frame = np.full((size[1], size[0], 3), colour, np.uint8)
    writer = imageio.get_writer(str(path), fps=16, quality=8)
    for _ in range(9):
        writer.append_data(frame)
    writer.close()
    Image.fromarray(frame).save(path.with_suffix(".png"))


def write_sweep(tmp_path):
    """Two prompts, --sample_strengths 0,0.5,1 --validate_with both: the base model once, steps 0 (no EMA before the
    first update) and 4 (raw and EMA at each strength)."""
    from diffsynth_mbc.atomic import atomic_write_json
    from diffsynth_mbc.sample_prompts import clip_suffix, load_sample_prompts, prompts_file_record, sample_file_stem

    (tmp_path / "prompts.yaml").write_text("- a news anchor in the studio\n- 도시 거리 밤\n", encoding="utf-8")
    prompts = load_sample_prompts(tmp_path / "prompts.yaml", height=64, width=96, num_frames=9, seed=1)
    records = prompts_file_record(prompts)
    samples = tmp_path / "lora" / "samples"
    (samples / "base").mkdir(parents=True)
    atomic_write_json(samples / "base" / "prompts.json", {"prompts": [{**r, "step": 0} for r in records["prompts"]]})
    for step, kinds in ((0, [(0.5, "raw"), (1.0, "raw")]),
                        (4, [(0.5, "raw"), (0.5, "ema"), (1.0, "raw"), (1.0, "ema")])):
        folder = samples / f"step-{step:08d}"
        folder.mkdir()
        atomic_write_json(folder / "prompts.json", records)
        for index, prompt in enumerate(prompts):
            stem = sample_file_stem(index, prompt)
            for number, (strength, weights) in enumerate(kinds):
                write_clip(folder / f"{stem}{clip_suffix(strength, weights)}.mp4",
                           (60 + 90 * number % 255, 40 * step, 120 * index))
    for index, prompt in enumerate(prompts):
        write_clip(samples / "base" / f"{sample_file_stem(index, prompt)}-base.mp4", (20, 20, 20))
    return samples


def test_a_strength_sweep_shows_each_prompts_clips_side_by_side(browser, tmp_path):  # noqa: F811
    samples = write_sweep(tmp_path)
    log_dir = tmp_path / "lora" / "training_logs"
    F.make_run(log_dir, world_size=1, steps=4, now=time.time(), samples_dir=str(samples.resolve()))
    srv = start_server(log_dir)
    browser.set_window_size(*WIDE)
    try:
        browser.get(srv.url)
        wait_for(browser, lambda d: len(d.find_elements(By.CSS_SELECTOR, "#gallery video")) == 2 * (1 + 2 + 4))
        wait_for(browser, lambda d: d.execute_script(
            "return Array.from(document.querySelectorAll('#gallery video')).every(v => v.readyState >= 1)"))
        head = [th.text for th in browser.find_elements(By.CSS_SELECTOR, "#gallery tr:first-child th")]
        assert head == ["PROMPT", "BASE MODEL", "STEP 0", "STEP 4"] or \
            [t.lower() for t in head] == ["prompt", "base model", "step 0", "step 4"]
        rows = browser.find_elements(By.CSS_SELECTOR, "#gallery tr[data-prompt]")
        assert [r.get_attribute("data-prompt") for r in rows] == ["1", "2"]   # one row per prompt
        assert [r.find_element(By.CSS_SELECTOR, "th").text for r in rows] == [
            "1. a news anchor in the studio", "2. 도시 거리 밤"]
        boxes = browser.execute_script("""
            return Array.from(document.querySelectorAll('#gallery tr[data-prompt]')).map(row =>
              Array.from(row.querySelectorAll('figure')).map(f => {
                const v = f.querySelector('video'), r = (v || f).getBoundingClientRect();
                const c = f.querySelector('figcaption');
                return {step: f.closest('td').dataset.step, kind: f.dataset.kind, label: c ? c.textContent : null,
                        video: !!v, x: r.left, right: r.right, y: r.top, bottom: r.bottom,
                        width: v ? v.videoWidth : 0};
              }));""")
        for row in boxes:
            # the base model, then step 0 (no EMA before the first update), then step 4, the EMA beside the raw
            assert [(b["step"], b["label"]) for b in row] == [
                ("base", "base model"), ("0", "strength 0.5"), ("0", "strength 1"),
                ("4", "strength 0.5"), ("4", "strength 0.5 · EMA"), ("4", "strength 1"), ("4", "strength 1 · EMA")]
            videos = [b for b in row if b["video"]]
            assert len(videos) == 7 and all(b["width"] == 96 for b in videos)
            assert max(b["y"] for b in videos) - min(b["y"] for b in videos) < 1   # side by side: one line
            assert videos[-1]["right"] <= WIDE[0]   # the whole sweep on the page, none cut off
            xs = [b["x"] for b in row]
            assert all(later > earlier for earlier, later in zip(xs, xs[1:])), xs   # left to right, in order
        assert min(b["y"] for b in boxes[1]) > max(b["bottom"] for b in boxes[0] if b["video"])   # row under row
        shot = tmp_path / "gallery.png"
        browser.find_element(By.ID, "samples-box").screenshot(str(shot))
        assert shot.stat().st_size > 10_000
    finally:
        browser.get("about:blank")
        browser.set_window_size(1400, 1800)
        stop_server(srv)
