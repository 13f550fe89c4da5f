"""Headless Chromium for the tests of the project's pages (the dashboard, flagged.html), driven by Selenium.

Needs Debian's ``chromium`` and ``chromium-driver`` and the ``selenium`` package (dev extra); ``needs_browser``
skips a test when they are absent, except where MBC_REQUIRE_BROWSER=1 makes a missing browser fail.
"""

from __future__ import annotations

import os
import shutil

import pytest

CHROMIUM = "/usr/bin/chromium"
CHROMEDRIVER = shutil.which("chromedriver") or "/usr/bin/chromedriver"

try:
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service
except ImportError:  # pragma: no cover - the dev extra installs it
    webdriver = None

HAVE_BROWSER = webdriver is not None and os.path.exists(CHROMIUM) and os.path.exists(CHROMEDRIVER)
needs_browser = pytest.mark.skipif(
    not HAVE_BROWSER and not os.environ.get("MBC_REQUIRE_BROWSER"),
    reason="needs chromium, chromium-driver and selenium (apt-get install chromium chromium-driver)")


def start_chromium(width: int, height: int):
    """A headless Chromium window of ``width`` x ``height`` at scale 1 that keeps its performance and console logs
    (what the page asked the network for, what it printed); the caller quits it."""
    opts = webdriver.ChromeOptions()
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--no-first-run",
                "--disable-background-networking", "--disable-component-update", "--disable-sync",
                f"--window-size={width},{height}", "--force-device-scale-factor=1"):
        opts.add_argument(arg)
    opts.binary_location = CHROMIUM
    opts.set_capability("goog:loggingPrefs", {"performance": "ALL", "browser": "ALL"})
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=opts)
    driver.set_page_load_timeout(60)
    return driver


def browser_for_module(chromium, width: int, height: int):
    """The test process's Chromium (the session's ``chromium`` fixture), ready for a test module's pages: a
    ``width`` x ``height`` window on a blank page, the logs of earlier modules' pages read away."""
    chromium.set_window_size(width, height)
    chromium.get("about:blank")
    for log in ("performance", "browser"):
        chromium.get_log(log)
    return chromium
