"""flagged.html, the inspection's contact sheet: its groups, rows and thumbnails as written, and the page as a
person sees it, opened from disk in a real headless Chromium (Selenium).

The browser tests need Debian's ``chromium`` and ``chromium-driver`` and the ``selenium`` package (dev extra);
they skip when those are absent, except where MBC_REQUIRE_BROWSER=1 makes a missing browser fail. With
MBC_SHOT_DIR set, a full-page screenshot is also left in that folder as contact_sheet_shot.png to look at.
"""

from __future__ import annotations

import base64
import io
import json
import os
from html.parser import HTMLParser
from pathlib import Path

import numpy as np
import pytest
from PIL import Image, ImageDraw

from browser_helpers import browser_for_module, needs_browser
from diffsynth_mbc.data.inspect.contact_sheet import REASON_ORDER, THUMB_HEIGHT_PX, SheetRow, contact_sheet_html

THUMB_W, THUMB_H = 160, 90
FRAME_NUMBERS = list(range(0, 32, 4))   # 8 frames a row
HOSTILE_PATH = "<script>alert(1)</script>.mp4"
HOSTILE_DETAIL = 'luma 3.1 & "mean" <b>not bold</b>'
OTHER_REASON = "short window"

try:
    from selenium.common.exceptions import NoAlertPresentException
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait
except ImportError:  # pragma: no cover - the dev extra installs it; needs_browser skips the tests
    pass


def thumbnail(row: int, number: int, reason: str) -> np.ndarray:
    """A 160x90 frame that looks the part: a colour gradient of the row's own hue, moving with the frame number,
    the number written on it; black bars, black frames, a frozen picture or a cut where the reason says so."""
    y, x = np.mgrid[0:THUMB_H, 0:THUMB_W].astype(np.float32)
    shift = 0 if reason == "frozen" else number * 3
    if reason == "scene_cut" and number >= FRAME_NUMBERS[len(FRAME_NUMBERS) // 2]:
        row += 7   # another shot: another hue
    rgb = np.stack([(x * 1.4 + row * 41 + shift) % 256, (y * 2.5 + row * 67) % 256,
                    (x + y + row * 23 + shift * 2) % 256], axis=-1)
    if reason == "black":
        rgb *= 0.04
    image = Image.fromarray(rgb.astype(np.uint8))
    draw = ImageDraw.Draw(image)
    if reason == "letterbox":
        draw.rectangle((0, 0, THUMB_W, 14), fill=0)
        draw.rectangle((0, THUMB_H - 15, THUMB_W, THUMB_H), fill=0)
    elif reason == "pillarbox":
        draw.rectangle((0, 0, 28, THUMB_H), fill=0)
        draw.rectangle((THUMB_W - 29, 0, THUMB_W, THUMB_H), fill=0)
    draw.rectangle((4, THUMB_H - 20, 62, THUMB_H - 5), fill=(20, 20, 20))
    draw.text((8, THUMB_H - 18), f"frame {number}", fill=(240, 240, 240))
    return np.asarray(image)


def sheet_row(row: int, reason: str, file_path: str | None = None, **fields) -> SheetRow:
    values = {"scene_cut": (0.71, 0.35), "black": (4.2, 12.0), "frozen": (0.3, 1.5), "letterbox": (0.16, 0.08),
              "pillarbox": (0.18, 0.08), "duplicate": (2.0, 6.0)}.get(reason, (9.0, 17.0))
    return SheetRow(row=row, file_path=file_path or f"clips/{reason}/take_{row:03d}.mp4",
                    catalog="val" if row % 5 == 0 else "train", reason=reason, value=values[0], threshold=values[1],
                    detail=fields.pop("detail", f"{reason.replace('_', ' ')} found in the training window"),
                    duplicate_of=fields.pop("duplicate_of", "row 3: clips/a.mp4" if reason == "duplicate" else None),
                    frames=[thumbnail(row, n, reason) for n in FRAME_NUMBERS],
                    labels=[f"frame {n}" for n in FRAME_NUMBERS], **fields)


def flagged_rows() -> list[SheetRow]:
    """Rows of all six reasons and one other, given out of order: 2-3 a reason, a hostile path among them."""
    rows = [sheet_row(40, "duplicate", duplicate_of="row 12: clips/a.mp4"), sheet_row(17, "black"),
            sheet_row(9, "scene_cut"), sheet_row(31, "pillarbox"), sheet_row(5, "frozen"), sheet_row(2, "scene_cut"),
            sheet_row(22, "letterbox"), sheet_row(8, "black", file_path=HOSTILE_PATH, detail=HOSTILE_DETAIL),
            sheet_row(14, "frozen"), sheet_row(11, OTHER_REASON), sheet_row(26, "letterbox"),
            sheet_row(3, "duplicate", duplicate_of="row 1: clips/original.mp4"), sheet_row(30, "scene_cut"),
            sheet_row(35, "pillarbox", file_path="footage/" + "a-very-long-folder-name/" * 8 + "clip.mp4")]
    return rows


# in row order, train's rows before val's (rows 5, 30, 35 and 40 are val's: every fifth)
EXPECTED_GROUPS = {"scene_cut": [2, 9, 30], "black": [8, 17], "frozen": [14, 5], "letterbox": [22, 26],
                   "pillarbox": [31, 35], "duplicate": [3, 40], OTHER_REASON: [11]}


class PageParts(HTMLParser):
    """What a page is made of: its sections (reason, id, rows), headings, links, every src/href, tags, text."""

    def __init__(self, page: str):
        super().__init__()
        self.sections: list[dict] = []
        self.headings: list[str] = []
        self.contents_links: list[str] = []
        self.urls: list[str] = []
        self.tags: list[str] = []
        self.text: list[str] = []
        self._in_h2 = self._in_nav = False
        self.feed(page)

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        self.tags.append(tag)
        self.urls += [attrs[name] for name in ("src", "href") if name in attrs]
        if tag == "section":
            self.sections.append({"reason": attrs["data-reason"], "id": attrs["id"], "rows": []})
        elif tag == "article":
            self.sections[-1]["rows"].append(int(attrs["data-row"]))
        elif tag == "h2":
            self._in_h2 = True
            self.headings.append("")
        elif tag == "nav":
            self._in_nav = True
        elif tag == "a" and self._in_nav:
            self.contents_links.append(attrs["href"])

    def handle_endtag(self, tag):
        self._in_h2 = self._in_h2 and tag != "h2"
        self._in_nav = self._in_nav and tag != "nav"

    def handle_data(self, data):
        self.text.append(data)
        if self._in_h2:
            self.headings[-1] += data


def test_groups_follow_the_reason_order_with_their_counts_and_rows_in_row_order():
    page = contact_sheet_html(flagged_rows(), "flagged rows", "14 of 200 rows flagged")
    parts = PageParts(page)
    assert [(s["reason"], s["rows"]) for s in parts.sections] == list(EXPECTED_GROUPS.items())
    assert [s["reason"] for s in parts.sections][:6] == list(REASON_ORDER)
    assert parts.headings == [f"{reason} {len(rows)}" for reason, rows in EXPECTED_GROUPS.items()]
    assert parts.contents_links == [f"#{s['id']}" for s in parts.sections]
    assert len({s["id"] for s in parts.sections}) == len(parts.sections)   # "short window" gets a safe id of its own
    text = " ".join(parts.text)
    assert "14 flagged" in text and "14 of 200 rows flagged" in text
    assert "value 0.71, threshold 0.35" in text and "value 4.2, threshold 12" in text
    assert "The frames cross a cut" in text   # each known reason says why it matters


def test_a_hostile_path_and_detail_show_as_text():
    page = contact_sheet_html(flagged_rows(), "<b>title</b>")
    parts = PageParts(page)
    assert "script" not in parts.tags and "b" not in parts.tags   # nothing from the data became markup
    assert HOSTILE_PATH in parts.text and HOSTILE_DETAIL in parts.text and "<b>title</b>" in parts.text
    assert "&lt;script&gt;alert(1)&lt;/script&gt;.mp4" in page


def test_a_duplicate_names_the_row_it_repeats():
    text = " ".join(PageParts(contact_sheet_html(flagged_rows(), "flagged")).text)
    assert "duplicate of row 12: clips/a.mp4" in text and "duplicate of row 1: clips/original.mp4" in text
    assert text.count("duplicate of") == 2   # only the duplicates say so


def test_an_empty_page_says_nothing_was_flagged():
    parts = PageParts(contact_sheet_html([], "flagged rows", "0 of 200 rows flagged"))
    assert parts.sections == [] and parts.contents_links == [] and "img" not in parts.tags
    assert "Nothing was flagged" in " ".join(parts.text)


def test_thumbnails_are_inline_jpegs_of_the_frames_size():
    parts = PageParts(contact_sheet_html(flagged_rows(), "flagged"))
    sources = [url for url in parts.urls if url.startswith("data:")]
    assert len(sources) == 14 * len(FRAME_NUMBERS)
    for source in sources:
        header, _, payload = source.partition(",")
        assert header == "data:image/jpeg;base64"
        image = Image.open(io.BytesIO(base64.b64decode(payload)))
        assert (image.format, image.size, image.mode) == ("JPEG", (THUMB_W, THUMB_H), "RGB")


def test_a_full_size_frame_is_scaled_down_before_it_is_inlined():
    row = sheet_row(1, "black")
    row.frames = [np.zeros((720, 1280, 3), np.uint8)]
    source = PageParts(contact_sheet_html([row], "flagged")).urls
    payload = [url for url in source if url.startswith("data:")][0].partition(",")[2]
    assert Image.open(io.BytesIO(base64.b64decode(payload))).size == (320, 180)


def test_the_page_references_nothing_outside_itself():
    page = contact_sheet_html(flagged_rows(), "flagged")
    assert "http://" not in page and "https://" not in page and "url(" not in page and "@import" not in page
    assert all(url.startswith(("data:", "#")) for url in PageParts(page).urls)


def test_a_row_of_eight_thumbnails_weighs_tens_of_kilobytes():
    """The module's docstring quotes this weight (about 31 KB a row of 8 frames at 160x90)."""
    rows = [sheet_row(n, "frozen") for n in range(1, 11)]
    per_row = (len(contact_sheet_html(rows, "t").encode()) - len(contact_sheet_html([], "t").encode())) / len(rows)
    assert 8 * 1000 < per_row < 60 * 1000, per_row


# ---- the page in a real browser -------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def browser(chromium):
    return browser_for_module(chromium, 1280, 900)


@pytest.fixture
def opened_sheet(browser, tmp_path):
    """flagged_rows()'s page written to disk and opened from its file:// URL, every image decoded."""
    path = tmp_path / "flagged.html"
    path.write_text(contact_sheet_html(flagged_rows(), "flagged.html: 14 rows", "14 of 200 rows flagged"),
                    encoding="utf-8")
    browser.get_log("performance")   # forget what earlier pages asked for
    browser.get(path.as_uri())
    WebDriverWait(browser, 30, poll_frequency=0.1).until(lambda d: d.execute_script(
        "return document.readyState === 'complete' && Array.from(document.images).every(i => i.complete)"))
    yield browser
    browser.get("about:blank")


@pytest.mark.slow
@needs_browser
def test_every_group_row_and_thumbnail_shows(opened_sheet):
    driver = opened_sheet
    headings = driver.find_elements(By.CSS_SELECTOR, "section h2")
    assert [h.text for h in headings] == [f"{reason} {len(rows)}" for reason, rows in EXPECTED_GROUPS.items()]
    assert all(h.is_displayed() for h in headings)
    articles = driver.find_elements(By.CSS_SELECTOR, "article")
    assert len(articles) == 14 and all(a.is_displayed() and a.size["height"] > 90 for a in articles)
    images = driver.execute_script("return Array.from(document.images).map(i => [i.naturalWidth, i.naturalHeight,"
                                   " i.getBoundingClientRect().height])")
    assert images == [[THUMB_W, THUMB_H, THUMB_HEIGHT_PX]] * (14 * len(FRAME_NUMBERS))   # all decoded, all shown
    strip_lines = driver.execute_script("return Array.from(document.querySelectorAll('.strip')).map("
                                        "s => new Set(Array.from(s.querySelectorAll('img')).map(i => i.y)).size)")
    assert strip_lines == [1] * 14   # a row's 8 frames side by side on one line, 1280 px wide
    hostile = driver.find_element(By.CSS_SELECTOR, 'article[data-row="8"] .path')
    assert hostile.text == HOSTILE_PATH
    with pytest.raises(NoAlertPresentException):
        driver.switch_to.alert.text   # the path's script never ran
    scroll = driver.execute_script("const s = document.scrollingElement; return [s.scrollWidth, s.clientWidth]")
    assert scroll[0] <= scroll[1], f"the page scrolls sideways: {scroll}"   # the long path wraps


@pytest.mark.slow
@needs_browser
def test_the_contents_links_scroll_to_their_groups(opened_sheet):
    driver = opened_sheet
    links = driver.find_elements(By.CSS_SELECTOR, "nav a")
    assert len(links) == len(EXPECTED_GROUPS)
    for index in range(len(links)):
        link = driver.find_elements(By.CSS_SELECTOR, "nav a")[index]
        link.click()
        target = link.get_attribute("href").rpartition("#")[2]
        WebDriverWait(driver, 10).until(lambda d: d.execute_script("return location.hash") == f"#{target}")
        heading_top, scrolled, at_end, viewport = driver.execute_script(
            "const h = document.querySelector('#' + arguments[0] + ' h2').getBoundingClientRect();"
            "const s = document.scrollingElement;"
            "return [h.top, s.scrollTop, s.scrollTop + innerHeight >= s.scrollHeight - 1, innerHeight]", target)
        # the heading comes to the top of the window, or as far up as the end of the page lets it
        assert 0 <= heading_top <= 40 or (at_end and 0 <= heading_top < viewport - 100), (target, heading_top)
        assert scrolled > 0, target
        driver.find_element(By.CSS_SELECTOR, f"#{target} .to-contents").click()   # and back up
        WebDriverWait(driver, 10).until(lambda d: d.execute_script("return document.scrollingElement.scrollTop") <
                                        d.execute_script("return document.getElementById('contents').offsetTop + 1"))


@pytest.mark.slow
@needs_browser
def test_the_page_fetches_nothing_and_its_screenshot_is_not_blank(opened_sheet, tmp_path):
    driver = opened_sheet
    requests = [json.loads(e["message"])["message"] for e in driver.get_log("performance")]
    urls = [m["params"]["request"]["url"] for m in requests if m["method"] == "Network.requestWillBeSent"]
    assert urls and all(u.startswith(("file://", "data:")) for u in urls), urls
    assert [e for e in driver.get_log("browser") if e["level"] == "SEVERE"] == []

    shot = tmp_path / "contact_sheet.png"
    assert driver.save_screenshot(str(shot))
    pixels = np.asarray(Image.open(shot).convert("RGB"), dtype=np.float32)
    assert pixels.shape[:2] == (driver.execute_script("return innerHeight"), 1280)
    assert pixels.std() > 20, "the screenshot is blank"
    if os.environ.get("MBC_SHOT_DIR"):
        full_page = driver.execute_cdp_cmd("Page.captureScreenshot", {"format": "png",
                                                                      "captureBeyondViewport": True})
        folder = Path(os.environ["MBC_SHOT_DIR"])
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "contact_sheet_shot.png").write_bytes(base64.b64decode(full_page["data"]))
