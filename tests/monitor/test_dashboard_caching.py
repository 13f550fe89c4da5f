"""The dashboard during a latent cache build: status files as the cache job writes them, in a headless browser."""

from __future__ import annotations

import pytest

from diffsynth_mbc.data.cache.status import CacheStatus
from diffsynth_mbc.training.reporting.status_writer import RankStatusWriter
from browser_helpers import needs_browser
from test_dashboard_browser import browser, wait_for  # noqa: F401 - browser is a fixture
from test_server import start_server, stop_server

pytestmark = [pytest.mark.slow, needs_browser]


def test_the_dashboard_counts_cache_rows_while_the_cache_is_built(browser, tmp_path):  # noqa: F811
    from selenium.webdriver.common.by import By

    log_dir = tmp_path / "training_logs"
    ranks = [CacheStatus(RankStatusWriter, log_dir, "run-c", rank, rank, 2, tmp_path / "cache") for rank in (0, 1)]
    for status in ranks:
        status.planned(total=50, done=10, failed=[])   # 10 rows of each share were cached before
        status.encoding()
        status.writer.flush()
    srv = start_server(log_dir)
    try:
        browser.get(srv.url)
        wait_for(browser, lambda d: d.find_element(By.ID, "sum-step").text == "20 / 100")
        label = browser.find_element(By.XPATH, "//*[@id='sum-step']/preceding-sibling::div[@class='k']")
        assert label.text.lower() == "cache rows"
        assert browser.find_element(By.ID, "run-status").text.lower() == "caching"
        assert browser.find_element(By.ID, "sum-progress").text == "20.0 %"
        rate = browser.find_element(By.XPATH, "//*[@id='sum-rate']/preceding-sibling::div[@class='k']")
        assert rate.text.lower() == "rows / s"
    finally:
        browser.get("about:blank")
        stop_server(srv)
        for status in ranks:
            status.close()
