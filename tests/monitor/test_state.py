"""Pure monitor logic on crafted run files: aggregation, stalls, missing/failed ranks, robustness, history."""

from __future__ import annotations

import json
import os

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import monitor_fixtures as F
from diffsynth_mbc.monitor import history, series
from diffsynth_mbc.monitor.history import HistoryFile
from diffsynth_mbc.monitor.series import Series
from diffsynth_mbc.monitor.state import MonitorState
from diffsynth_mbc.monitor.status import exit_code


class FakeClock:
    def __init__(self, now: float = F.NOW):
        self.now = now

    def __call__(self) -> float:
        return self.now


def state_for(log_dir, now=F.NOW, **kw):
    clock = FakeClock(now)
    return MonitorState(log_dir, clock=clock, **kw), clock


def by_rank(snap):
    return {r["rank"]: r for r in snap["ranks"]}


def test_healthy_run_aggregates_slowest_rank_and_sums_throughput(tmp_path):
    F.make_run(tmp_path, world_size=2, steps=120)
    F.write_status(tmp_path, 1, step=100, step_time_s=2.5)  # the slower rank
    snap, = [state_for(tmp_path)[0].refresh()]
    assert snap["status"] == "training" and exit_code(snap["status"]) == 0
    assert snap["world_size"] == 2 and snap["missing_ranks"] == [] and snap["stalled_ranks"] == []
    assert snap["step"] == 100 and snap["total_steps"] == 1000
    assert snap["progress"] == pytest.approx(10.0)
    assert snap["eta_s"] == pytest.approx((1000 - 100) * 2.5)  # the slowest rank's ETA
    assert snap["samples_per_s"] == pytest.approx(1 / 2.0 + 1 / 2.5)
    assert snap["loss"] == pytest.approx((F.loss_at(120, 0) + F.loss_at(100, 1)) / 2)
    r0 = by_rank(snap)[0]
    assert r0["history_lines"] == 120 and r0["median_step_time_s"] == 2.0
    assert len(r0["loss_trend"]) == series.TREND_POINTS
    json.dumps(snap, allow_nan=False)



def test_a_finished_run_shows_the_throughput_it_trained_at(tmp_path):
    """The sum over training ranks left a finished (or stopped) run with samples/s "-"."""
    F.make_run(tmp_path, world_size=2, steps=1000, status="finished")
    F.write_status(tmp_path, 1, step=1000, status="finished", step_time_s=2.5)
    snap = state_for(tmp_path)[0].refresh()
    assert snap["status"] == "finished" and snap["samples_per_s"] == pytest.approx(1 / 2.0 + 1 / 2.5)
    F.write_status(tmp_path, 1, step=400, status="stopped", step_time_s=2.5)
    assert state_for(tmp_path)[0].refresh()["samples_per_s"] == pytest.approx(1 / 2.0 + 1 / 2.5)
    F.write_status(tmp_path, 0, step=0, status="loading")     # a resumed rank loading again: no rate yet, no old one
    F.write_status(tmp_path, 1, step=0, status="starting")
    assert state_for(tmp_path)[0].refresh()["samples_per_s"] is None

def test_stalled_rank_by_default_threshold_and_since_when(tmp_path):
    F.make_run(tmp_path, world_size=2, steps=50)
    F.write_status(tmp_path, 1, step=50, updated_at=F.NOW - 100)
    state, clock = state_for(tmp_path)
    snap = state.refresh()
    assert snap["status"] == "training" and not by_rank(snap)[1]["stalled"]  # 100 s < 120 s
    clock.now += 30  # rank 1 silent for 130 s now
    snap = state.refresh()
    r1 = by_rank(snap)[1]
    assert r1["stalled"] and r1["stalled_since"] == F.NOW - 100 and r1["age_s"] == pytest.approx(130)
    assert r1["stall_after_s"] == 120
    assert snap["status"] == "stalled" and snap["stalled_ranks"] == [1] and exit_code("stalled") == 3
    assert not by_rank(snap)[0]["stalled"]  # rank 0 wrote 30 s ago


def test_stall_threshold_grows_with_slow_steps(tmp_path):
    # median step time 30 s -> threshold 300 s
    F.write_history(tmp_path, 0, range(1, 40), step_time_s=30.0)
    F.write_status(tmp_path, 0, world_size=1, step=39, step_time_s=30.0, updated_at=F.NOW - 250)
    state, clock = state_for(tmp_path)
    snap = state.refresh()
    assert by_rank(snap)[0]["stall_after_s"] == 300 and snap["status"] == "training"
    clock.now += 60
    assert state.refresh()["status"] == "stalled"
    # an explicit --stall-after wins
    strict, _ = state_for(tmp_path, stall_after=10)
    assert strict.refresh()["status"] == "stalled"


def test_loading_and_starting_ranks_stall_too_but_finished_ones_never(tmp_path):
    F.write_status(tmp_path, 0, world_size=2, status="loading", step=0, updated_at=F.NOW - 600)
    F.write_status(tmp_path, 1, world_size=2, status="finished", step=1000, updated_at=F.NOW - 6000)
    snap = state_for(tmp_path)[0].refresh()
    assert snap["stalled_ranks"] == [0] and snap["status"] == "stalled"
    F.write_status(tmp_path, 0, world_size=2, status="starting", step=0, updated_at=F.NOW - 5)
    snap = state_for(tmp_path)[0].refresh()
    assert snap["status"] == "starting" and snap["stalled_ranks"] == []


def test_missing_rank_is_listed_but_does_not_change_status(tmp_path):
    F.make_run(tmp_path, world_size=4, steps=20, ranks=[0, 2])
    snap = state_for(tmp_path)[0].refresh()
    assert snap["missing_ranks"] == [1, 3] and snap["world_size"] == 4
    assert snap["status"] == "training"
    assert any("rank 1 missing" in n for n in snap["notes"])


def test_failed_rank_with_traceback_wins_over_stalled(tmp_path):
    F.make_run(tmp_path, world_size=2, steps=20)
    F.write_status(tmp_path, 0, step=20, updated_at=F.NOW - 10_000)  # stalled
    F.write_status(tmp_path, 1, status="failed", step=20, error=F.failed_error())
    snap = state_for(tmp_path)[0].refresh()
    assert snap["status"] == "failed" and exit_code(snap["status"]) == 1
    (err,) = snap["errors"]
    assert err["rank"] == 1 and err["type"] == "RuntimeError"
    assert "loss.backward()" in err["traceback_tail"] and "out of memory" in err["message"]
    assert snap["eta_s"] is None


def test_failed_rank_without_error_record_and_list_traceback(tmp_path):
    F.write_status(tmp_path, 0, world_size=2, status="failed", error=None)
    F.write_status(tmp_path, 1, world_size=2, status="failed",
                   error={"type": "X", "message": "m", "traceback_tail": ["line a\n", "line b"]})
    errors = {e["rank"]: e for e in state_for(tmp_path)[0].refresh()["errors"]}
    assert "without an error record" in errors[0]["message"]
    assert errors[1]["traceback_tail"] == "line a\nline b"


def test_finished_and_stopped_runs(tmp_path):
    F.make_run(tmp_path, world_size=2, steps=1000, status="finished")
    snap = state_for(tmp_path, now=F.NOW + 86400)[0].refresh()
    assert snap["status"] == "finished" and snap["progress"] == 100 and snap["eta_s"] == 0
    assert snap["stalled_ranks"] == [] and exit_code("finished") == 0
    F.write_status(tmp_path, 1, status="stopped", step=500)
    snap = state_for(tmp_path)[0].refresh()
    assert snap["status"] == "stopped" and exit_code("stopped") == 0


def test_a_preempted_run_is_preempted_never_failed_stopped_or_unknown(tmp_path):
    """The scheduler ended the job after a checkpoint (train.sbatch): PREEMPTED, exit code 0, no ETA; a rank the
    stop reached first may say stopped, the run is still preempted; a requeued job training again is one run."""
    F.make_run(tmp_path, world_size=2, steps=500, status="preempted")
    snap = state_for(tmp_path)[0].refresh()
    assert snap["status"] == "preempted" and exit_code("preempted") == 0 and snap["eta_s"] is None
    assert [rank["status"] for rank in snap["ranks"]] == ["preempted", "preempted"]
    assert not [note for note in snap["notes"] if "unknown status" in note], snap["notes"]
    F.write_status(tmp_path, 1, status="stopped", step=500)
    assert state_for(tmp_path)[0].refresh()["status"] == "preempted"
    for rank in (0, 1):
        F.write_status(tmp_path, rank, status="training", step=501)
    snap = state_for(tmp_path)[0].refresh()
    assert snap["status"] == "training" and [rank["status"] for rank in snap["ranks"]] == ["training", "training"]


def test_most_advanced_active_status_wins(tmp_path):
    F.write_status(tmp_path, 0, world_size=3, status="starting", step=0)
    F.write_status(tmp_path, 1, world_size=3, status="loading", step=0)
    assert state_for(tmp_path)[0].refresh()["status"] == "loading"
    F.write_status(tmp_path, 2, world_size=3, status="training", step=3)
    assert state_for(tmp_path)[0].refresh()["status"] == "training"


def test_empty_and_missing_directory_are_no_data(tmp_path):
    snap = state_for(tmp_path)[0].refresh()
    assert snap["status"] == "no_data" and exit_code("no_data") == 4 and snap["ranks"] == []
    snap = state_for(tmp_path / "not-there")[0].refresh()
    assert snap["status"] == "no_data" and any("does not exist" in n for n in snap["notes"])
    F.write_raw(tmp_path / "a-file", "x")
    assert "not a directory" in " ".join(state_for(tmp_path / "a-file")[0].refresh()["notes"])


def test_a_log_folder_that_vanished_is_no_data_and_said_so(tmp_path):
    """Deleted mid-run: neither the last status read ("training, step 115") nor its history is shown as live."""
    log_dir = tmp_path / "logs"
    F.make_run(log_dir, world_size=2, steps=115)
    state, _ = state_for(log_dir)
    assert state.refresh()["status"] == "training"
    for path in log_dir.iterdir():
        path.unlink()
    log_dir.rmdir()
    snap = state.refresh()
    assert snap["status"] == "no_data" and snap["ranks"] == [] and exit_code(snap["status"]) == 4
    assert any("vanished" in note for note in snap["notes"]), snap["notes"]
    assert state.metrics(points=100)["ranks"] == {}


def test_the_silent_rank_is_the_stalled_one_and_the_rank_waiting_for_it_says_so(tmp_path):
    """Rank 1 stopped (its file stale); rank 0 blocked in the all-reduce keeps its file fresh, naming the wait."""
    F.make_run(tmp_path, world_size=2, steps=115)
    F.write_status(tmp_path, 0, step=115, updated_at=F.NOW - 1,
                   waiting={"for": "ranks in all-reduce (step agreement)", "since": F.NOW - 95})
    F.write_status(tmp_path, 1, step=115, updated_at=F.NOW - 96)
    snap = state_for(tmp_path, stall_after=30)[0].refresh()
    assert snap["status"] == "stalled" and snap["stalled_ranks"] == [1]
    waiting = by_rank(snap)[0]["waiting_text"]
    assert waiting.startswith("waiting for ranks in all-reduce (step agreement) since ") and waiting.endswith("(95 s)")
    assert by_rank(snap)[1]["waiting_text"] is None
    assert any(note.startswith("rank 1 silent (stalled) while rank 0 is waiting for") for note in snap["notes"])


def test_torn_last_line_is_read_once_complete(tmp_path):
    F.write_history(tmp_path, 0, range(1, 11))
    path = F.write_status(tmp_path, 0, world_size=1, step=10)
    line = F.history_line(11)
    with open(path.with_suffix(".jsonl"), "a") as h:
        h.write(line[:15])
    state = state_for(tmp_path)[0]
    snap = state.refresh()
    assert snap["ranks"][0]["history_lines"] == 10
    assert any("incomplete" in n for n in snap["notes"])
    with open(path.with_suffix(".jsonl"), "a") as h:
        h.write(line[15:])
    snap = state.refresh()
    assert snap["ranks"][0]["history_lines"] == 11 and not any("incomplete" in n for n in snap["notes"])
    assert state.metrics(rank=0, since=10)["ranks"]["0"]["records"][0]["step"] == 11


def test_schema_drift_newer_version_extra_and_missing_fields(tmp_path):
    obj = F.status(0, world_size=1, schema_version=2, brand_new_field={"a": [1, 2]}, tokens_per_s=123.0)
    for key in ("grad_norm", "samples_per_s", "gpu", "loss_avg", "eta_s"):
        del obj[key]
    F.write_raw(tmp_path / "training_gpu0.json", json.dumps(obj))
    F.write_history(tmp_path, 0, range(1, 5), kind_of_line="new", extra_metric=[1, 2])
    state = state_for(tmp_path)[0]
    for _ in range(3):
        snap = state.refresh()
    warnings = [n for n in snap["notes"] if "schema_version 2" in n]
    assert len(warnings) == 1
    r0 = snap["ranks"][0]
    assert r0["brand_new_field"] == {"a": [1, 2]} and r0["tokens_per_s"] == 123.0
    assert r0["gpu"] is None and r0["grad_norm"] is None and r0["history_lines"] == 4
    assert snap["status"] == "training" and snap["eta_s"] == pytest.approx((1000 - 100) * 2.0)


def test_non_numeric_and_non_finite_fields(tmp_path):
    obj = F.status(0, world_size=1, loss=float("nan"), progress="55.5", eta_s=float("inf"))
    obj["gpu"]["util_pct"] = "n/a"
    obj["step"] = "abc"
    F.write_raw(tmp_path / "training_gpu0.json", json.dumps(obj))  # writes NaN and Infinity literals
    snap = state_for(tmp_path)[0].refresh()
    r0 = snap["ranks"][0]
    assert r0["loss"] is None and r0["step"] is None and r0["progress"] == 55.5
    assert r0["gpu"]["util_pct"] is None
    notes = " ".join(snap["notes"])
    assert "loss is NaN" in notes and "step is not a whole number" in notes
    assert "eta_s is not a finite number" in notes
    json.dumps(snap, allow_nan=False)


def test_every_field_is_read_as_the_schema_declares_it(tmp_path):
    """#61 item 5: the monitor reads a status file through run_files.STATUS_SCHEMA: each declared field by its type
    (a number from its text, a list of texts without the rest, an object's declared parts), an undeclared one as it
    is; nothing that cannot be read gets through."""
    F.write_status(tmp_path, 0, world_size=1, val_loss="0.25", rows_done="12", val_step=7.0, compile="yes",
                   val_loss_by_quantile={"0.1": "0.5", "0.9": float("nan")}, resumed_with_changes=["lr", 5, None],
                   last_samples={"step": "10", "dir": ["x"], "files": ["01-a.mp4", 3, "\x1b[2J02-b.mp4"],
                                 "extra": 1},
                   resumed_from="step-00000004", brand_new_field={"a": [1, float("inf")]})
    r0 = by_rank(state_for(tmp_path)[0].refresh())[0]
    assert r0["val_loss"] == 0.25 and r0["rows_done"] == 12 and r0["val_step"] == 7 and r0["compile"] is None
    assert r0["val_loss_by_quantile"] == {"0.1": 0.5, "0.9": None} and r0["resumed_with_changes"] == ["lr"]
    assert r0["last_samples"] == {"step": 10, "dir": None, "files": ["01-a.mp4", "[2J02-b.mp4"]}
    assert r0["resumed_from"] is None and r0["brand_new_field"] == {"a": [1, None]}
    assert r0["launch_id"] is None and "val_loss_ema" not in r0   # in every file: shown; written when it happens: not


def test_a_new_metric_is_one_line_in_the_schema_and_the_monitor_reads_it(tmp_path, monkeypatch):
    from diffsynth_mbc import run_files
    from diffsynth_mbc.training.reporting.status_writer import RankStatusWriter

    writer = RankStatusWriter(tmp_path, "run-a", 0, 0, 1, min_interval_s=0)
    with pytest.raises(run_files.StatusFieldError, match="'clip_score' is not declared"):
        writer.update(clip_score=0.75)
    monkeypatch.setitem(run_files.STATUS_SCHEMA, "clip_score", run_files.Field("clip_score", float, optional=True))
    writer.update(clip_score=0.75)
    writer.close()
    assert by_rank(state_for(tmp_path)[0].refresh())[0]["clip_score"] == 0.75
    F.write_status(tmp_path, 0, world_size=1, clip_score="high")
    assert by_rank(state_for(tmp_path)[0].refresh())[0]["clip_score"] is None


def test_garbage_files_never_crash(tmp_path, monkeypatch):
    monkeypatch.setattr(history, "MAX_LINE_BYTES", 1000)
    F.write_raw(tmp_path / "training_gpu0.json", b"\x00\xff\xfegarbage{")
    F.write_raw(tmp_path / "training_gpu1.json", b"")
    F.write_raw(tmp_path / "training_gpu2.json", b"[1, 2, 3]")
    F.write_status(tmp_path, 3, world_size=5, status="weird")
    F.write_status(tmp_path, 4, world_size=5)
    F.write_raw(tmp_path / "training_gpu4.jsonl",
                F.history_line(1, 4) + "not json\n[1,2]\n{\"no_step\": 1}\n\n\x00\x01\xff\n" + F.history_line(2, 4)
                + "z" * 5000 + "\n" + F.history_line(3, 4) + "y" * 3000)
    for name in ("training_gpuX.json", "training_gpu.json", "notes.txt", ".training_gpu0.json.abc.tmp"):
        F.write_raw(tmp_path / name, "{}")
    (tmp_path / "training_gpu7.json.d").mkdir()
    snap = state_for(tmp_path)[0].refresh()
    notes = " ".join(snap["notes"])
    assert "training_gpu0.json is not valid JSON" in notes
    assert "training_gpu1.json is empty" in notes
    assert "training_gpu2.json does not hold a JSON object" in notes
    assert "unknown status 'weird'" in notes
    assert "training_gpu4.jsonl: skipped 5 unreadable line(s) (last at line 8)" in notes
    assert "skipped 3000 bytes without line breaks" in notes and "incomplete" not in notes
    assert snap["missing_ranks"] == [0, 1, 2]
    r4 = by_rank(snap)[4]
    assert r4["history_lines"] == 3
    assert snap["status"] == "training"  # rank 3's unknown status is not active, rank 4 trains


def test_status_file_unreadable_after_a_good_read_keeps_the_last_one(tmp_path):
    F.write_status(tmp_path, 0, world_size=1, step=7)
    state = state_for(tmp_path)[0]
    assert state.refresh()["step"] == 7
    F.write_raw(tmp_path / "training_gpu0.json", '{"step": 8, "stat')  # a writer that does not replace atomically
    snap = state.refresh()
    assert snap["step"] == 7 and any("showing its last good read" in n for n in snap["notes"])
    F.write_status(tmp_path, 0, world_size=1, step=9)
    snap = state.refresh()
    assert snap["step"] == 9 and not any("last good read" in n for n in snap["notes"])


def test_rank_field_disagreeing_with_file_name_is_flagged(tmp_path):
    F.write_status(tmp_path, 0, world_size=2)
    F.write_raw(tmp_path / "training_gpu1.json", json.dumps(F.status(0, world_size=2)))
    snap = state_for(tmp_path)[0].refresh()
    assert sorted(by_rank(snap)) == [0, 1]
    assert any("training_gpu1.json says it is rank 0" in n for n in snap["notes"])


def test_newest_run_wins_and_others_are_flagged(tmp_path):
    F.make_run(tmp_path, world_size=4, steps=10, run_id="old", now=F.NOW - 86400)
    F.make_run(tmp_path, world_size=2, steps=5, run_id="new")
    snap = state_for(tmp_path)[0].refresh()
    assert snap["run_id"] == "new" and snap["world_size"] == 2 and sorted(by_rank(snap)) == [0, 1]
    assert snap["missing_ranks"] == [] and snap["ignored_runs"] == [{"run_id": "old", "ranks": [2, 3]}]
    assert any("ignored files of run old" in n for n in snap["notes"])


def test_rank_beyond_world_size_is_left_out(tmp_path):
    F.make_run(tmp_path, world_size=2, steps=5)
    F.write_status(tmp_path, 5, world_size=2)
    snap = state_for(tmp_path)[0].refresh()
    assert sorted(by_rank(snap)) == [0, 1] and any("outside world_size 2" in n for n in snap["notes"])


def test_a_run_resumed_on_fewer_ranks_is_shown_on_them_and_the_change_said_once(tmp_path):
    """Resumed on 1 GPU at step 40 from 3: ranks 1 and 2 were closed there (status retired, still declaring 3)."""
    moved = {"step": 40, "from_world_size": 3, "world_size": 1, "end_step": 150, "said": "resumed on 1 GPU ..."}
    F.write_status(tmp_path, 0, world_size=1, step=60, total_steps=150, resumed_elsewhere=moved)
    for rank in (1, 2):
        F.write_status(tmp_path, rank, world_size=3, status="retired", step=40)
    snap = state_for(tmp_path)[0].refresh()
    assert (snap["world_size"], sorted(by_rank(snap)), snap["status"]) == (1, [0], "training")
    assert snap["missing_ranks"] == [] and snap["step"] == 60 and snap["total_steps"] == 150
    assert [note for note in snap["notes"] if "rank" in note or "resumed" in note] == [
        "resumed on 1 GPU at step 40 (from 3); ranks 1, 2 retired there (records up to that step)"]


def test_a_run_resumed_on_more_ranks_says_so(tmp_path):
    moved = {"step": 40, "from_world_size": 1, "world_size": 2, "end_step": 90}
    for rank in (0, 1):
        F.write_status(tmp_path, rank, world_size=2, resumed_elsewhere=moved)
    snap = state_for(tmp_path)[0].refresh()
    assert snap["world_size"] == 2 and "resumed on 2 GPUs at step 40 (from 1)" in snap["notes"]


def test_history_is_read_incrementally_and_reread_after_truncation_or_replacement(tmp_path):
    path = F.write_history(tmp_path, 0, range(1, 101))
    hf = HistoryFile(path)
    assert hf.poll() and hf.records == 100
    size = hf.offset
    assert size == path.stat().st_size and not hf.poll()
    F.write_history(tmp_path, 0, range(101, 104), append=True)
    assert hf.poll() and hf.records == 103 and hf.rereads == 0
    # truncated in place (same inode, smaller)
    F.write_history(tmp_path, 0, range(1, 6))
    assert hf.poll() and hf.records == 5 and hf.rereads == 1 and hf.last_step == 5
    # replaced by a new file (new inode), even a larger one
    tmp = tmp_path / "new.jsonl"
    tmp.write_text("".join(F.history_line(s) for s in range(1, 201)))
    os.replace(tmp, path)
    assert hf.poll() and hf.records == 200 and hf.rereads == 2
    # removed
    path.unlink()
    assert hf.poll() and hf.records == 0


def test_metrics_window_matches_a_full_scan(tmp_path):
    steps = list(range(1, 400)) + list(range(200, 260))  # a restart from a checkpoint repeats steps
    lines = [F.history_line(s) for s in steps]
    lines.insert(50, F.history_line(50, kind="val", val_loss=0.42))
    F.write_raw(tmp_path / "training_gpu0.jsonl", "".join(lines) + "garbage\n")
    F.write_status(tmp_path, 0, world_size=1)
    state = state_for(tmp_path, index_every=7)[0]
    state.refresh()
    every = [json.loads(x) for x in lines]
    for since, limit in ((None, 10), (-1, 5000), (0, 3), (150, 20), (250, 1000), (398, 10), (399, 10), (1e9, 3)):
        got = state.metrics(rank=0, since=since, limit=limit)["ranks"]["0"]
        want = [r for r in every if since is None or r["step"] > since]
        assert got["records"] == want[:limit], (since, limit)
        assert got["truncated"] == (len(want) > limit)
        if got["records"]:
            assert got["next_since"] == got["records"][-1]["step"]


def test_metrics_downsampled_and_all_ranks(tmp_path):
    F.make_run(tmp_path, world_size=2, steps=300)
    F.write_history(tmp_path, 1, [100, 200], append=True, kind="val", val_loss=0.3)
    state = state_for(tmp_path, max_points=100)[0]
    out = state.metrics(points=40)
    assert set(out["ranks"]) == {"0", "1"}
    r1 = out["ranks"]["1"]
    assert r1["downsampled"] and 20 <= len(r1["loss"]) <= 40 and len(r1["lr"]) <= 40
    assert sum(p["n"] for p in r1["loss"]) == 300 and r1["loss"][-1]["step"] == 300
    assert [p["value"] for p in r1["val_loss"]] == [0.3, 0.3] and r1["last_step"] == 300
    mean = sum(F.loss_at(s, 1) for s in range(1, 301)) / 300
    assert sum(p["value"] * p["n"] for p in r1["loss"]) / 300 == pytest.approx(mean)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.floats(-1e6, 1e6, allow_nan=False), max_size=700), st.integers(2, 50))
def test_series_stays_bounded_and_keeps_the_mean(values, max_points):
    series = Series(max_points)
    for i, v in enumerate(values):
        series.add(i, v)
    assert len(series) <= max(2, max_points // 2 * 2)
    assert sum(series.n) == len(values) == series.count
    if values:
        assert series.x[-1] == len(values) - 1
        assert min(series.lo) == min(values) and max(series.hi) == max(values)
        total = sum(m * n for m, n in zip(series.mean, series.n))
        assert total == pytest.approx(sum(values), rel=1e-6, abs=1e-3)
        assert len(series.points(max_points=5)) <= 5


@settings(max_examples=60, deadline=None)
@given(st.lists(st.lists(st.floats(-1e3, 1e3, allow_nan=False), max_size=90), max_size=12), st.integers(2, 30))
def test_series_extend_in_batches_equals_adding_one_by_one(batches, max_points):
    one, bulk = Series(max_points), Series(max_points)
    i = 0
    for batch in batches:
        xs = list(range(i, i + len(batch)))
        i += len(batch)
        for x, y in zip(xs, batch):
            one.add(x, y)
        bulk.extend(xs, batch)
    assert (bulk.x, bulk.lo, bulk.hi, bulk.n, bulk.bucket, bulk.count) == (one.x, one.lo, one.hi, one.n, one.bucket,
                                                                         one.count)
    assert bulk.mean == pytest.approx(one.mean, abs=1e-6)


def test_a_new_run_replacing_the_history_is_an_event_not_a_warning(tmp_path):
    F.make_run(tmp_path, world_size=1, ranks=[0], steps=5, run_id="run-1")
    state = MonitorState(tmp_path, clock=lambda: F.NOW)
    state.refresh()
    (tmp_path / "training_gpu0.jsonl").rename(tmp_path / "training_gpu0.old.jsonl.old")
    F.make_run(tmp_path, world_size=1, ranks=[0], steps=3, run_id="run-2")
    snap = state.refresh()
    assert "new run run-2 replaced run-1" in snap["events"]
    assert not any("replaced or truncated" in note for note in snap["notes"])
    assert snap["ranks"][0]["history_lines"] == 3


def test_downsampled_metrics_hold_grad_norm_step_time_throughput_and_epoch_starts(tmp_path):
    F.write_history(tmp_path, 0, range(1, 101), step_time_s=0.5, samples=4, grad_norm=1.5)
    F.write_history(tmp_path, 0, range(101, 201), append=True, step_time_s=0.25, samples=4, grad_norm=0.5, epoch=1)
    F.write_status(tmp_path, 0, world_size=1, step=200)
    out = state_for(tmp_path)[0].metrics(points=1000)["ranks"]["0"]
    assert [p["value"] for p in out["grad_norm"]] == [1.5] * 100 + [0.5] * 100
    assert [p["value"] for p in out["step_time_s"]] == [0.5] * 100 + [0.25] * 100
    assert [p["value"] for p in out["samples_per_s"]] == [8.0] * 100 + [16.0] * 100
    assert out["epochs"] == [{"step": 101, "epoch": 1}]  # epoch 0 beginning is not a boundary
    assert state_for(tmp_path)[0].metrics(points=1000, since=150)["ranks"]["0"]["epochs"] == []


@pytest.mark.parametrize("medians, slow", [
    ([2.0, 2.0], []),
    ([2.0, 3.0], [1]),                 # 1.5x the other rank
    ([2.0, 2.4], []),                  # within 25 %
    ([2.0, 2.1, 1.9, 2.0, 9.0], [4]),  # one straggler among five
    ([2.0], []),                       # alone: nothing to compare with
    ([2.0, None, 3.0], [2]),           # a rank without step times yet is left out
])
def test_a_rank_persistently_slower_than_the_others_is_slow(medians, slow):
    from diffsynth_mbc.monitor.aggregate import slow_ranks
    ranks = [{"rank": i, "median_step_time_s": m} for i, m in enumerate(medians)]
    assert slow_ranks(ranks) == slow


def test_the_snapshot_names_the_slow_rank(tmp_path):
    F.make_run(tmp_path, world_size=2, steps=50)
    F.write_history(tmp_path, 1, range(1, 51), step_time_s=3.0)
    assert state_for(tmp_path)[0].refresh()["slow_ranks"] == [1]


def test_validation_loss_per_timestep_quantile_is_kept_per_quantile(tmp_path):
    F.make_run(tmp_path, world_size=1, steps=20)
    F.write_raw(tmp_path / "training_gpu0.jsonl", (tmp_path / "training_gpu0.jsonl").read_text() + "".join(
        json.dumps({"step": s, "kind": "val", "val_loss": 0.3, "val_loss_by_quantile": {"0.1": 0.2, "0.9": 0.4}}) + "\n"
        for s in (10, 20)))
    out = state_for(tmp_path)[0].metrics(points=100)["ranks"]["0"]
    assert {q: [p["value"] for p in points] for q, points in out["val_loss_by_quantile"].items()} == {
        "0.1": [0.2, 0.2], "0.9": [0.4, 0.4]}


def test_time_between_steps_is_read_typed_and_the_slowest_rank_speaks_for_the_run(tmp_path):
    F.make_run(tmp_path, world_size=2, steps=20)
    slow = {"checkpoint": {"count": 2, "total_s": 9.2, "last_s": 4.7, "mean_s": 4.6},
            "validation": {"count": "1", "total_s": 1.5, "last_s": 1.5, "mean_s": 1.5}}
    F.write_status(tmp_path, 1, step=20, overheads=slow, gpu={
        "name": "H100", "util_pct": 90.0, "mem_used_mb": 20000.0, "mem_total_mb": 81559.0,
        "peak_allocated_mb": 31000, "peak_reserved_mb": 33000, "run_peak_allocated_mb": 40000,
        "run_peak_reserved_mb": 42000})
    F.write_status(tmp_path, 0, step=20, step_time_avg_s="1.0", eta_overheads_s=40.0,
                   overheads={"checkpoint": {"count": 2, "total_s": 8.0, "last_s": 4.0, "mean_s": 4.0}})
    # The time of each checkpoint in the history is no step: the step times stay the steps'.
    F.write_raw(tmp_path / "training_gpu1.jsonl", (tmp_path / "training_gpu1.jsonl").read_text() + json.dumps(
        {"kind": "overhead", "overhead": "checkpoint", "step": 20, "seconds": 4.7, "time": F.NOW}) + "\n")
    snap = state_for(tmp_path)[0].refresh()
    ranks = by_rank(snap)
    assert ranks[1]["overheads"]["validation"] == {"count": 1, "total_s": 1.5, "last_s": 1.5, "mean_s": 1.5}
    assert ranks[0]["step_time_avg_s"] == 1.0 and ranks[0]["eta_overheads_s"] == 40.0
    assert ranks[1]["gpu"]["peak_allocated_mb"] == 31000.0 and ranks[1]["gpu"]["run_peak_reserved_mb"] == 42000.0
    assert snap["overheads"] == slow | {"validation": ranks[1]["overheads"]["validation"]}
    assert ranks[1]["median_step_time_s"] == 2.0 and ranks[1]["history_lines"] == 21
    json.dumps(snap, allow_nan=False)


def test_odd_overheads_are_noted_and_left_out(tmp_path):
    F.make_run(tmp_path, world_size=2, steps=5)
    F.write_status(tmp_path, 0, step=5, overheads={"checkpoint": {"count": "many"}, "\x1b[2Jlora": {"count": 1},
                                                   **{f"k{i}": {"count": 1} for i in range(100)}})
    F.write_status(tmp_path, 1, step=5, overheads=["not", "an", "object"])
    snap = state_for(tmp_path)[0].refresh()
    ranks = by_rank(snap)
    assert ranks[1]["overheads"] is None and "overheads is not an object" in " ".join(snap["notes"])
    assert "checkpoint" not in ranks[0]["overheads"] and "[2Jlora" in ranks[0]["overheads"]
    assert len(ranks[0]["overheads"]) < 20      # bounded
    assert any("is not a tally" in note for note in snap["notes"])


def test_a_long_history_is_answered_from_its_tail_and_read_whole_behind_it(tmp_path):
    # Once the first refresh parsed every line of every history: 10 s before the first answer at 8 x 200,000 steps.
    steps = 90_000   # about 9 MB: over history.TAIL_FIRST_ABOVE
    F.make_run(tmp_path, world_size=1, ranks=[0], steps=steps)
    assert (tmp_path / "training_gpu0.jsonl").stat().st_size > history.TAIL_FIRST_ABOVE
    whole, _ = state_for(tmp_path, tail_first_above=None)
    reference = whole.refresh()["ranks"][0]
    assert reference["history_complete"] and reference["history_lines"] == steps

    state, _ = state_for(tmp_path, backfill=False)   # what --once and --json do: one answer, no whole read
    r0 = state.refresh()["ranks"][0]
    assert r0["history_complete"] is False and r0["history_lines"] is None
    assert r0["median_step_time_s"] == reference["median_step_time_s"] == 2.0 and r0["step"] == steps
    assert len(r0["loss_trend"]) == series.TREND_POINTS
    assert all(abs(a - b) < 0.01 for a, b in zip(r0["loss_trend"][1:], reference["loss_trend"][1:]))
    ids = lambda answer: [r["step"] for r in answer["ranks"]["0"]["records"]]  # noqa: E731
    assert ids(state.metrics(rank=0, since=10, limit=3)) == [11, 12, 13]       # before the tail: read from the start
    assert ids(state.metrics(rank=0, since=steps - 3, limit=5)) == [steps - 2, steps - 1, steps]

    downsampled = state.metrics(rank=0, points=100)["ranks"]["0"]   # needs the whole history: waits for it
    assert sum(p["n"] for p in downsampled["loss"]) == steps and downsampled["lines"] == steps
    assert downsampled["loss"] == whole.metrics(rank=0, points=100)["ranks"]["0"]["loss"]
    F.write_history(tmp_path, 0, [steps + 1], append=True)
    r0 = state.refresh()["ranks"][0]
    assert r0["history_complete"] and r0["history_lines"] == steps + 1
    assert r0["loss_trend"] == whole.refresh()["ranks"][0]["loss_trend"]


def test_a_resumed_runs_cut_back_history_reads_as_the_resume_it_is(tmp_path):
    """The resume cuts the history back to the checkpoint's step; the monitor kept saying "file was replaced or
    truncated 1 time(s)" for the rest of the run."""
    F.make_run(tmp_path, world_size=1, ranks=[0], steps=8)
    state = MonitorState(tmp_path, clock=lambda: F.NOW)
    state.refresh()
    F.write_history(tmp_path, 0, range(1, 5))   # cut back to step 4, as the resume does
    F.write_status(tmp_path, 0, step=4, resumed_from={"checkpoint": "checkpoints/step-00000004", "step": 4,
                                                      "run_id": "run-a"})
    notes = state.refresh()["notes"]
    assert "training_gpu0.jsonl: resumed at step 4 (the history was cut back to it and read again)" in notes
    assert not any("replaced or truncated" in note for note in notes)


def test_a_resumed_run_shows_its_whole_training_time_while_it_trains(tmp_path):
    """While a resumed run trained, `monitor --json` said 4.9 s where its status file said 16.8 s: the time since
    the resumed processes started, without the training before the checkpoint. The status file is the real
    writer's, with the time before the checkpoint set as a resume sets it."""
    from diffsynth_mbc.training.reporting.status_writer import RankStatusWriter

    wall, monotonic = FakeClock(F.NOW), FakeClock(500.0)
    writer = RankStatusWriter(tmp_path, "run-a", 0, 0, 1, min_interval_s=0.0, wall_clock=wall, monotonic=monotonic)
    writer.elapsed_before_s = 12.0   # trained before the checkpoint it resumed from
    wall.now += 4.9
    monotonic.now += 4.9
    writer.set_status("training", step=7, total_steps=12)
    state, clock = state_for(tmp_path, now=wall.now)
    assert state.refresh()["elapsed_s"] == pytest.approx(16.9)
    clock.now += 3.0   # between two writes the time still runs
    assert state.refresh()["elapsed_s"] == pytest.approx(19.9)
    wall.now += 3.0
    monotonic.now += 3.0
    writer.set_status("finished", step=12)
    assert state.refresh()["elapsed_s"] == pytest.approx(19.9)   # and the finished run's own figure, as before
