"""Measure every row's training window, in parallel, reusing what an earlier run measured.

Each row not already in the store is decoded and measured by a worker process (``--workers``; one row costs
tens of milliseconds of CPU, so processes, not threads: PyAV's decoding and numpy's statistics both hold the
GIL for part of it). Results are stored as they arrive, so a run that is killed resumes where it stopped, and
a second run over an unchanged catalogue decodes nothing. Progress: a bar with the rate and the time left
on a terminal, a line every ``REPORT_EVERY_S`` seconds otherwise (a log file gets a readable record).
"""

from __future__ import annotations

import gc
import multiprocessing
import os
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from typing import Callable, Iterator, Sequence

from diffsynth_mbc.data.inspect.measure_store import MeasureStore
from diffsynth_mbc.data.inspect.window import InspectWindow, read_window, stream_window
from diffsynth_mbc.lifecycle.processes import end_with_parent

MEASURES_VERSION = 2    # raise when measure_window's statistics change: older stored measures are then remeasured
ROWS_PER_TASK = 8       # rows a worker takes at a time: few enough to keep both workers busy to the end
REPORT_EVERY_S = 30.0   # a progress line this often when the output is no terminal


@dataclass(frozen=True)
class InspectItem:
    path: str                  # resolved file path
    media_type: str            # "video" or "image"
    available: int | None      # the probed frame count (videos)
    fps: float | None


@dataclass(frozen=True)
class InspectResult:
    measures: dict | None      # WindowMeasures.to_dict(), None when the file could not be read
    error: str | None          # why not
    reused: bool = False       # measured by an earlier run
    key: str | None = None     # the row's key in the store (None: the file could not be stat'ed)


def measure_item(item: InspectItem, window: InspectWindow) -> InspectResult:
    """Decode and measure one row (in a worker process)."""
    from diffsynth_mbc.data.inspect.cut_check import located_cut
    from diffsynth_mbc.data.inspect.measures import WindowMeter, measure_window

    try:
        if item.media_type == "image":
            frames = read_window(item.path, item.media_type, window, available=item.available, fps=item.fps)
            return InspectResult(measure_window(frames.frames).to_dict(), None)
        meters = []   # the frames stream through the meter: bounded memory for a clip of any length

        def new_meter(count: int):
            meters.append(WindowMeter(count))
            return lambda _index, frame: meters[-1].push(frame)
        streamed = stream_window(item.path, window, new_meter, available=item.available, fps=item.fps)
        measures = located_cut(meters[-1].result(), streamed.positions, streamed.fps, item.path)
        return InspectResult(measures.to_dict(), None)
    except Exception as error:   # any decoder failure is this row's reason, never the run's end
        message = " ".join(str(error).split()) or type(error).__name__
        return InspectResult(None, f"{type(error).__name__}: {message[:300]}")


def _measure_batch(batch: list[InspectItem], window: InspectWindow) -> list[InspectResult]:
    return [measure_item(item, window) for item in batch]


def _batches(indices: list[int], size: int) -> Iterator[list[int]]:
    for start in range(0, len(indices), size):
        yield indices[start:start + size]


def inspect_items(items: Sequence[InspectItem], window: InspectWindow, workers: int, store: MeasureStore,
                  on_done: Callable[[int], None] | None = None) -> list[InspectResult]:
    """One result per item, in order. ``on_done(n)`` is told after each ``n`` rows (reused ones included)."""
    results: list[InspectResult | None] = [None] * len(items)
    settings = window.settings()
    keys = [store.key(item.path, settings) for item in items]
    todo = []
    for index, key in enumerate(keys):
        known = store.get(key) if key is not None else None
        if known is not None:
            results[index] = InspectResult(known, None, reused=True, key=key)
        else:
            todo.append(index)
    if on_done is not None and len(todo) < len(items):
        on_done(len(items) - len(todo))
    for indices, measured in _measure_all(items, todo, window, workers):
        for index, result in zip(indices, measured):
            results[index] = InspectResult(result.measures, result.error, key=keys[index])
            if result.measures is not None and keys[index] is not None:
                store.add(keys[index], result.measures)
        if on_done is not None:
            on_done(len(indices))
    return results


def _measure_all(items: Sequence[InspectItem], indices: list[int], window: InspectWindow,
                 workers: int) -> Iterator[tuple[list[int], list[InspectResult]]]:
    """(indices, results) for the items at ``indices``, a batch at a time, in order; in this process when one
    worker is asked for or one batch is all there is (no process start-up for a small catalogue)."""
    index_batches = list(_batches(indices, ROWS_PER_TASK))
    batches = [[items[index] for index in index_batch] for index_batch in index_batches]
    if workers <= 1 or len(batches) <= 1:
        for index_batch, batch in zip(index_batches, batches):
            yield index_batch, _measure_batch(batch, window)
        return
    # fork: a worker starts at once with what it needs already imported, and a caller's script (or stdin, or
    # a notebook) is not run again in each worker, as spawn and forkserver would. The parent runs no other
    # thread here (the progress bar is refreshed by the caller, without a thread of its own).
    context = multiprocessing.get_context("fork")
    with ProcessPoolExecutor(max_workers=min(workers, len(batches)), mp_context=context,
                             initializer=end_with_parent, initargs=(os.getpid(),)) as pool:
        # The workers start at the first submission. What this process left for the garbage collector is
        # collected here first, and what it still holds is frozen, so that no worker ever frees a forked copy
        # of this process's objects (a decoder's state freed in a child crashed it).
        gc.collect()
        gc.freeze()
        try:
            measured_batches = pool.map(_measure_batch, batches, [window] * len(batches))
        finally:
            gc.unfreeze()
        for index_batch, measured in zip(index_batches, measured_batches):
            yield index_batch, measured


class ProgressLines:
    """A line every ``every_s`` seconds for a run whose output is no terminal: rows done, rate, time left."""

    def __init__(self, total: int, say: Callable[[str], None], every_s: float = REPORT_EVERY_S,
                 clock: Callable[[], float] = time.monotonic):
        self.total, self.say, self.every_s, self.clock = total, say, every_s, clock
        self.done = 0
        self.started = self.last = clock()

    def advance(self, rows: int) -> None:
        self.done += rows
        now = self.clock()
        if now - self.last >= self.every_s or self.done == self.total:
            self.last = now
            self.say(progress_line(self.done, self.total, now - self.started))


def progress_line(done: int, total: int, elapsed_s: float) -> str:
    """``"inspected 1,200 of 170,180 rows (21.3 rows/s, about 2 h 12 min left)"``."""
    rate = done / elapsed_s if elapsed_s > 0 else 0.0
    line = f"inspected {done:,} of {total:,} rows"
    if done >= total:
        return f"{line} in {duration_text(elapsed_s)}"
    if rate <= 0:
        return line
    return f"{line} ({rate:.1f} rows/s, about {duration_text((total - done) / rate)} left)"


def duration_text(seconds: float) -> str:
    seconds = max(0, round(seconds))
    if seconds < 60:
        return f"{seconds} s"
    minutes = seconds // 60
    if minutes < 60:
        return f"{minutes} min {seconds % 60} s"
    return f"{minutes // 60} h {minutes % 60} min"
