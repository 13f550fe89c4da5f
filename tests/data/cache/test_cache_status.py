"""The cache job's per-rank status: rows/s and ETA (pure), the status file, and the monitor's view of it."""

import pytest

from diffsynth_mbc.data.cache.progress import RowRate


class FakeClock:
    def __init__(self, now=100.0):
        self.now = now

    def __call__(self):
        return self.now


def test_the_rate_leaves_out_rows_skipped_and_the_model_loading():
    clock = FakeClock()
    rate = RowRate(total=10, done=4, clock=clock)   # 4 rows already cached by an earlier run
    assert rate.rows_per_s is None and rate.eta_s is None and rate.progress == 40.0
    clock.now += 30.0                                # loading the encoders: not encoding
    rate.restart()
    for _ in range(3):
        clock.now += 2.0
        rate.advance()
    assert rate.done == 7 and rate.rows_per_s == pytest.approx(0.5)
    assert rate.eta_s == pytest.approx(3 / 0.5) and rate.progress == 70.0


def test_the_rate_follows_the_last_rows_only():
    clock = FakeClock()
    rate = RowRate(total=1000, window=10, clock=clock)
    for _ in range(50):       # clips: 4 s each
        clock.now += 4.0
        rate.advance()
    for _ in range(10):       # then images: 0.5 s each
        clock.now += 0.5
        rate.advance()
    assert rate.rows_per_s == pytest.approx(2.0)
    assert rate.eta_s == pytest.approx(940 / 2.0)
    assert len(rate._samples) == 11   # bounded, however many rows


def test_a_finished_share_has_no_time_left_and_never_counts_past_its_total():
    clock = FakeClock()
    rate = RowRate(total=2, clock=clock)
    clock.now += 1.0
    rate.advance(5)
    assert rate.done == 2 and rate.eta_s == 0.0 and rate.progress == 100.0
    assert RowRate(total=0, clock=clock).eta_s == 0.0
    with pytest.raises(ValueError):
        RowRate(total=1, window=0)


def cache_status(tmp_path, clock, wall, rank=0, world_size=1):
    from diffsynth_mbc.data.cache.status import CacheStatus
    from diffsynth_mbc.training.reporting.status_writer import RankStatusWriter

    return CacheStatus(RankStatusWriter, tmp_path / "logs", "run-1", rank, rank, world_size, tmp_path / "cache",
                       min_interval_s=5.0, clock=clock, wall_clock=wall)


def read(path):
    import json

    return json.loads(path.read_text())


def test_each_rank_writes_a_caching_status_at_most_every_interval(tmp_path):
    clock, wall = FakeClock(0.0), FakeClock(1_000.0)
    status = cache_status(tmp_path, clock, wall, rank=1, world_size=2)
    path = tmp_path / "logs" / "training_gpu1.json"
    first = read(path)
    assert (first["status"], first["rank"], first["world_size"]) == ("caching", 1, 2)
    assert first["phase"].startswith("caching") and first["run_id"] == "run-1"
    failed = [{"row": 2, "file": "a.mp4", "reason": "metadata row 2 (a.mp4): cannot decode"}]
    status.planned(total=10, done=2, failed=failed)      # a new phase: written at once
    status.loading()
    clock.now += 60.0
    status.encoding()
    assert read(path)["phase"] == "caching" and read(path)["rows_done"] == 2
    for _ in range(4):                                   # rows within the interval: nothing rewritten
        clock.now += 1.0
        status.row_done(failed)
    assert read(path)["rows_done"] == 2 and not list(path.parent.glob("*.jsonl"))
    clock.now += 1.0
    wall.now += 65.0
    status.row_done(failed)                              # 5 s since the last write
    state = read(path)
    assert (state["rows_done"], state["rows_total"], state["step"], state["total_steps"]) == (7, 10, 7, 10)
    assert state["rows_per_s"] == pytest.approx(1.0) and state["eta_s"] == pytest.approx(3.0)
    assert state["progress"] == 70.0 and state["step_time_s"] == pytest.approx(1.0)
    assert state["failures"] == 1 and state["last_failure"].startswith("metadata row 2 (a.mp4)")
    assert state["updated_at"] == 1_065.0
    status.finished("3 written")
    state = read(path)
    assert state["status"] == "finished" and state["phase"] == "caching done: 3 written" and state["eta_s"] == 0.0
    status.close()


def test_the_monitor_shows_the_cache_build_and_a_silent_cache_rank_as_stalled(tmp_path):
    from diffsynth_mbc.monitor.state import MonitorState
    from diffsynth_mbc.monitor.view import render
    from rich.console import Console

    clock, wall = FakeClock(0.0), FakeClock(1_000.0)
    ranks = [cache_status(tmp_path, clock, wall, rank, 2) for rank in (0, 1)]
    for status in ranks:
        status.planned(total=50, done=0, failed=[])
        status.encoding()
    for _ in range(10):
        clock.now += 2.0
        for status in ranks:
            status.row_done([])
    wall.now += 20.0
    for status in ranks:
        status.writer.flush()
    snap = MonitorState(tmp_path / "logs", clock=lambda: wall.now + 1.0).refresh()
    assert snap["status"] == "caching" and snap["stalled_ranks"] == []
    assert snap["caching"]["rows_done"] == 20 and snap["caching"]["rows_total"] == 100
    assert (snap["step"], snap["total_steps"], snap["progress"]) == (20, 100, 20.0)
    assert snap["samples_per_s"] == pytest.approx(1.0) and snap["eta_s"] == pytest.approx(80.0)
    console = Console(width=160, record=True)
    console.print(render(snap))
    text = console.export_text()
    assert "CACHING" in text and "cache rows" in text and "20 / 100" in text and "rows/s" in text

    # rank 1 hangs in a row; rank 0 finished its share and waits for it, its file kept fresh
    ranks[0].finished("25 written")
    later = wall.now + 600.0
    import json
    path = tmp_path / "logs" / "training_gpu0.json"
    state = json.loads(path.read_text())
    state["updated_at"] = later - 1.0
    path.write_text(json.dumps(state))
    snap = MonitorState(tmp_path / "logs", clock=lambda: later).refresh()
    assert snap["status"] == "stalled" and snap["stalled_ranks"] == [1]
    assert snap["caching"]["phase"] == "caching"
    for status in ranks:
        status.close()
