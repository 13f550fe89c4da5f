"""The dashboard page in a real headless Chromium: it polls the API and draws every rank's charts.

Needs Debian's chromium (``apt-get install -y chromium``); skipped when /usr/bin/chromium is absent.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from html.parser import HTMLParser

import pytest

import monitor_fixtures as F
from test_server import start_server, stop_server

CHROMIUM = "/usr/bin/chromium"

pytestmark = [
    pytest.mark.slow,
    # CI installs chromium and sets MBC_REQUIRE_BROWSER=1, so there a missing browser fails instead of skipping.
    pytest.mark.skipif(shutil.which(CHROMIUM) is None and not os.environ.get("MBC_REQUIRE_BROWSER"),
                       reason=f"{CHROMIUM} not installed (apt-get install chromium)"),
]


class ChartParser(HTMLParser):
    """Collects body data attributes, each chart's polylines and the text of the ranks table."""

    def __init__(self):
        super().__init__()
        self.body = {}
        self.lines = {}  # (chart id, series) -> (data-points, [(x, y), ...])
        self.chart = None
        self.in_ranks = False
        self.ranks_text = []

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if tag == "body":
            self.body = attrs
        elif tag == "svg":
            self.chart = attrs.get("data-chart")
        elif tag == "polyline":
            pairs = [tuple(map(float, p.split(","))) for p in attrs.get("points", "").split()]
            self.lines[(self.chart, attrs.get("data-series"))] = (int(attrs["data-points"]), pairs)
        elif tag == "tbody" and attrs.get("id") == "ranks-body":
            self.in_ranks = True

    def handle_endtag(self, tag):
        if tag == "tbody":
            self.in_ranks = False

    def handle_data(self, data):
        if self.in_ranks:
            self.ranks_text.append(data)


def chromium(*args, profile, timeout=90):
    cmd = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
           "--disable-background-networking", "--disable-component-update", "--disable-sync",
           f"--user-data-dir={profile}", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)


def test_dashboard_draws_loss_and_lr_for_every_rank(tmp_path):
    log_dir = tmp_path / "training_logs"
    now = time.time()
    F.make_run(log_dir, world_size=3, steps=300, ranks=[0], now=now)
    F.write_history(log_dir, 0, [100, 200, 300], append=True, kind="val", val_loss=0.31)
    F.write_history(log_dir, 1, range(1, 5001))  # long history: the page gets it down-sampled
    F.write_status(log_dir, 1, world_size=3, step=5000, total_steps=20000, now=now, updated_at=now - 3600)
    srv = start_server(log_dir)
    try:
        proc = chromium("--virtual-time-budget=8000", "--dump-dom", srv.url, profile=tmp_path / "profile")
    finally:
        stop_server(srv)
    assert proc.returncode == 0, proc.stderr[-2000:]
    page = ChartParser()
    page.feed(proc.stdout)
    assert page.body.get("data-ready") == "1" and page.body.get("data-ranks-drawn") == "2", page.body

    for (chart, series), (count, pairs) in page.lines.items():
        assert count == len(pairs), (chart, series)
        for x, y in pairs:  # inside the 600 x 170 view box
            assert 0 <= x <= 600 and 0 <= y <= 170, (chart, series, x, y)
    assert page.lines[("loss-0", "loss")][0] == 300
    assert page.lines[("lr-0", "lr")][0] == 300
    assert page.lines[("loss-0", "val_loss")][0] == 3
    n_loss1 = page.lines[("loss-1", "loss")][0]
    assert 500 <= n_loss1 <= 1000  # 5,000 steps down-sampled to at most 1,000 points
    assert page.lines[("lr-1", "lr")][0] == n_loss1
    # the curve spans the plot: first point at the left edge, last at the right edge
    xs = [x for x, _ in page.lines[("loss-0", "loss")][1]]
    assert min(xs) == pytest.approx(58, abs=0.1) and max(xs) == pytest.approx(590, abs=0.1)
    # loss falls over training: the last point is drawn lower (larger y) than the first
    ys = [y for _, y in page.lines[("loss-0", "loss")][1]]
    assert ys[-1] > ys[0]
    # the lr chart draws the lr: warm-up from the bottom of the plot, then flat at the top (y = 10)
    lr_ys = [y for _, y in page.lines[("lr-0", "lr")][1]]
    assert lr_ys[0] == pytest.approx(148, abs=0.1) and set(lr_ys[60:]) == {10.0}

    table = " ".join(page.ranks_text)
    assert "stalled" in table and "missing" in table and "training" in table
    assert "5000 / 20000" in table and "300 / 1000" in table
