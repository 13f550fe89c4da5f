"""The inspection runner: worker processes give what one process gives, in order; measures are stored as they
come and reused; a file that cannot be decoded is that row's error; progress lines say the rate and time left."""

from __future__ import annotations

import json

import pytest

from diffsynth_mbc.data.inspect.measure_store import MeasureStore
from diffsynth_mbc.data.inspect.run_inspection import (
    MEASURES_VERSION,
    ROWS_PER_TASK,
    InspectItem,
    ProgressLines,
    duration_text,
    inspect_items,
    progress_line,
)
from diffsynth_mbc.data.inspect.window import InspectWindow
from inspect_media import FRAMES, RATE, make_media


BROKEN = 5   # the unreadable file's place among the items


def inspect_with_store(store_path, items, workers=1, window=InspectWindow(), on_done=None):
    """One run of the runner over ``items``, its measures kept in the store at ``store_path``."""
    with MeasureStore(store_path, MEASURES_VERSION) as store:
        return inspect_items(items, window, workers, store, on_done=on_done)


@pytest.fixture(scope="module")
def items(tmp_path_factory):
    """Every test medium, and an unreadable file in the middle: more rows than one worker task holds."""
    folder = tmp_path_factory.mktemp("runner")
    media = make_media(folder)
    broken = folder / "broken.mp4"
    broken.write_bytes(b"\x00\x00\x00\x18ftypmp42 not a video" * 4)
    found = [InspectItem(path, kind, FRAMES if kind == "video" else None, RATE if kind == "video" else None)
             for path, kind in media.values()]
    found.insert(BROKEN, InspectItem(str(broken), "video", FRAMES, RATE))
    assert len(found) > ROWS_PER_TASK
    return found


def test_two_workers_give_what_one_process_gives_in_order_and_store_it(items, tmp_path):
    alone = inspect_with_store(tmp_path / "one.jsonl", items)
    told = []
    pooled = inspect_with_store(tmp_path / "two.jsonl", items, workers=2, on_done=told.append)
    assert [r.measures for r in pooled] == [r.measures for r in alone]
    assert sum(told) == len(items) and not any(r.reused for r in pooled)
    broken = pooled[BROKEN]
    assert broken.measures is None and broken.error.split(":")[0].endswith(("Error", "InvalidDataError"))
    assert all(r.measures is not None for i, r in enumerate(pooled) if i != BROKEN)
    stored = (tmp_path / "two.jsonl").read_text().splitlines()
    assert len(stored) == len(items) - 1                  # the unreadable row is not stored: it is tried again


def test_a_second_run_reuses_every_stored_measure_and_retries_the_unreadable_row(items, tmp_path):
    first = inspect_with_store(tmp_path / "store.jsonl", items)
    told = []
    again = inspect_with_store(tmp_path / "store.jsonl", items, on_done=told.append)
    assert [r.reused for r in again] == [i != BROKEN for i in range(len(items))]
    assert [r.measures for r in again] == [r.measures for r in first]
    assert told[0] == len(items) - 1 and sum(told) == len(items)   # the reused rows are told at once
    other = inspect_with_store(tmp_path / "store.jsonl", items[:2], window=InspectWindow(num_frames=9))
    assert not any(r.reused for r in other)               # another window is measured again
    assert all(json.loads(line) for line in (tmp_path / "store.jsonl").read_text().splitlines())


def test_progress_lines_say_the_rate_and_the_time_left_every_interval():
    said, now = [], [0.0]
    lines = ProgressLines(170_180, said.append, every_s=30, clock=lambda: now[0])
    now[0] = 10
    lines.advance(200)
    assert said == []                                     # not yet 30 s since the last line
    now[0] = 60
    lines.advance(1_000)
    assert said == ["inspected 1,200 of 170,180 rows (20.0 rows/s, about 2 h 20 min left)"]
    now[0] = 8_509
    lines.advance(168_980)
    assert said[-1] == "inspected 170,180 of 170,180 rows in 2 h 21 min"
    assert progress_line(0, 10, 0) == "inspected 0 of 10 rows"
    assert [duration_text(s) for s in (5, 65, 3_600, 7_260)] == ["5 s", "1 min 5 s", "1 h 0 min", "2 h 1 min"]


def test_a_run_stopped_midway_keeps_what_it_measured_and_the_next_run_resumes_there(items, tmp_path):
    class Stopped(Exception):
        pass

    def stop_after_the_first_task(rows: int) -> None:
        raise Stopped

    with pytest.raises(Stopped):
        inspect_with_store(tmp_path / "store.jsonl", items, on_done=stop_after_the_first_task)
    resumed = inspect_with_store(tmp_path / "store.jsonl", items)
    first_task = [i for i in range(ROWS_PER_TASK) if i != BROKEN]      # the unreadable row is never stored
    assert [i for i, r in enumerate(resumed) if r.reused] == first_task


RUN_MANY = """
import json, sys
from diffsynth_mbc.data.inspect.measure_store import MeasureStore
from diffsynth_mbc.data.inspect.run_inspection import InspectItem, inspect_items
from diffsynth_mbc.data.inspect.window import InspectWindow
items = [InspectItem(*item) for item in json.loads(sys.argv[1])] * 60
with MeasureStore(sys.argv[2], 1) as store:
    inspect_items(items, InspectWindow(), 2, store)
"""


@pytest.mark.slow
def test_workers_end_when_the_converter_is_killed(items, tmp_path):
    """``kill -9`` of ``convert --inspect`` left its workers blocked forever, their parent pid 1."""
    import signal
    import subprocess
    import sys
    import time

    import psutil

    listed = json.dumps([[item.path, item.media_type, item.available, item.fps] for item in items])
    parent = subprocess.Popen([sys.executable, "-c", RUN_MANY, listed, str(tmp_path / "store.jsonl")])
    workers = []
    try:
        deadline = time.monotonic() + 60
        while not workers and time.monotonic() < deadline and parent.poll() is None:
            workers = psutil.Process(parent.pid).children()
            time.sleep(0.05)
        assert workers, "no worker started"
        time.sleep(0.3)
        parent.send_signal(signal.SIGKILL)
        parent.wait(timeout=10)
        _, alive = psutil.wait_procs(workers, timeout=10)
        assert alive == [], f"workers still running after their parent's kill: {[p.pid for p in alive]}"
    finally:
        for process in workers:
            try:
                process.kill()
            except psutil.NoSuchProcess:
                pass
        if parent.poll() is None:
            parent.kill()
