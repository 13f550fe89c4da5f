"""Issue #30's monitor side, pure: LoRA health records (no training step), the validation gain over the base model,
the health flags of every rank, the recipe and each catalogue's progress, read from crafted run files."""

from __future__ import annotations

import json

import pytest

import health_run as H
import monitor_fixtures as F
from diffsynth_mbc.monitor.aggregate import MAX_RECIPE_BYTES, recipe_of
from diffsynth_mbc.monitor.health import HealthRecords, block_norms, run_flags
from diffsynth_mbc.monitor.history import HistoryFile
from diffsynth_mbc.monitor.state import MonitorState
from diffsynth_mbc.monitor.status import normalize_status
from diffsynth_mbc.monitor.validation import ValidationQuantiles


def health(step, updates=(0.0, 0.0), flags=()):
    return {"kind": "lora_health", "step": step, "update_norm_by_block": list(updates), "grad_norm_by_block": None,
            "flags": [{"flag": name, "step": step, "what": "w", "do": "d"} for name in flags], "seconds": 0.5,
            "time": F.NOW + step}


def test_a_health_record_is_no_training_step(tmp_path):
    """Step 0's health record (before the first step) and the ones between steps move no step-derived figure: the
    last step, the step times (so the ETA's median), the charts' points, the epochs; they are kept for the heat
    map only. The same for the other non-step lines (overhead, samples)."""
    lines = [json.dumps(health(0)) + "\n"]
    for step in range(1, 21):
        lines.append(F.history_line(step, 0, grad_norm=0.5, samples=2, epoch=(step - 1) // 10))
        if step % 10 == 0:
            lines.append(json.dumps(health(step, (0.01 * step, None), ["still"] if step == 20 else [])) + "\n")
    lines.append(json.dumps({"kind": "overhead", "overhead": "lora", "step": 20, "seconds": 3.0, "epoch": 7}) + "\n")
    lines.append(json.dumps({"kind": "samples", "step": 20, "seconds": 9.0, "loss": 99.0}) + "\n")
    F.write_raw(tmp_path / "training_gpu0.jsonl", "".join(lines))
    F.write_status(tmp_path, 0, world_size=1, step=20, total_steps=100)
    history = HistoryFile(tmp_path / "training_gpu0.jsonl")
    history.poll()
    assert history.last_step == 20 and history.bad_lines == 0
    assert {name: series.count for name, series in history.series.items()} == {
        "loss": 20, "lr": 20, "grad_norm": 20, "step_time_s": 20, "samples_per_s": 20}
    assert history.loss.x[0] == 1 and list(history.step_times) == [2.0] * 20   # 0.5 s of a health record: no step
    assert history.epoch_marks == [(11, 1)]
    assert [(r["step"], r["update_norm_by_block"], r["flags"]) for r in history.health.records] == [
        (0, [0.0, 0.0], []), (10, [0.1, None], []), (20, [0.2, None], ["still"])]
    state = MonitorState(tmp_path, clock=lambda: F.NOW)
    rank = state.refresh()["ranks"][0]
    assert rank["median_step_time_s"] == 2.0 and rank["loss_trend"][0] == pytest.approx(F.loss_at(1), rel=0.2)
    out = state.metrics(points=100)["ranks"]["0"]
    assert out["last_step"] == 20 and [p["step"] for p in out["loss"]][:2] == [1, 2]
    assert [r["step"] for r in out["lora_health"]] == [0, 10, 20]
    assert [r["step"] for r in state.metrics(points=100, since=10)["ranks"]["0"]["lora_health"]] == [20]
    raw = state.metrics(since=None)["ranks"]["0"]["records"]   # the raw window serves every line, as written
    assert [r.get("kind") for r in raw[:2]] == ["lora_health", None]


def test_health_records_keep_the_whole_span_bounded_and_a_resumed_runs_newer_record_wins():
    records = HealthRecords(most=10)
    for step in range(0, 200, 10):
        records.add(step, health(step))
    steps = [r["step"] for r in records.records]
    assert len(steps) <= 10 and steps[0] == 0 and steps[-1] == 190 and steps == sorted(steps)
    records.add(150, health(150, (1.0, 2.0)))   # a resumed run's history goes on from step 150
    assert records.records[-1]["step"] == 150 and records.records[-1]["update_norm_by_block"] == [1.0, 2.0]
    assert all(r["step"] < 150 for r in records.records[:-1])
    records.add(160, {"kind": "lora_health", "step": 160, "update_norm_by_block": "not a list"})
    assert records.records[-1]["step"] == 150   # nothing to draw: left out
    assert block_norms([1, "2", "inf", None, True, float("nan")]) == [1.0, 2.0, None, None, None, None]
    assert block_norms(None) is None and len(block_norms([0.1] * 5000)) == 1024


def test_the_gain_over_the_base_is_base_minus_lora_per_quantile_and_absent_without_a_base():
    gain = ValidationQuantiles(max_points=100)
    gain.add(10, {"val_loss_by_quantile": {"0.9": 0.5, "0.1": 0.3}}, 0.4)   # before the base was measured
    for step in (20, 30):
        gain.add(step, {"val_loss_by_quantile": {"0.1": 0.3, "0.9": 0.5, "0.5": "x"}, "val_loss_base": 0.45,
                        "val_loss_base_by_quantile": {"0.1": 0.35, "0.9": 0.52, "0.5": 0.4, "0.7": 0.1}}, 0.4)
    out = gain.payload(None, 100)
    assert list(out["val_loss_by_quantile"]) == ["0.1", "0.9"]   # by value, not by text
    assert [(p["step"], p["value"]) for p in out["val_gain"]] == [(20, pytest.approx(0.05)), (30, pytest.approx(0.05))]
    assert {q: [round(p["value"], 9) for p in points] for q, points in out["val_gain_by_quantile"].items()} == {
        "0.1": [0.05, 0.05], "0.9": [0.02, 0.02]}   # only the quantiles both measured
    assert ValidationQuantiles(100).payload(None, 10) == {"val_loss_by_quantile": {}, "val_gain": [],
                                                          "val_gain_by_quantile": {}}


def test_the_gain_and_health_reach_the_metrics_api(tmp_path):
    H.write_health_run(tmp_path)
    out = MonitorState(tmp_path, clock=lambda: F.NOW).metrics(rank=0, points=500)["ranks"]["0"]
    steps = list(range(H.VAL_EVERY, H.STEPS + 1, H.VAL_EVERY))
    for q in H.QUANTILES:
        assert [(p["step"], p["value"]) for p in out["val_gain_by_quantile"][q]] == [
            (s, pytest.approx(H.base_loss(q) - H.val_loss(s, q))) for s in steps]
    assert [r["step"] for r in out["lora_health"]] == list(range(0, H.STEPS + 1, H.HEALTH_EVERY))
    assert out["lora_health"][5]["update_norm_by_block"][7] is None and out["lora_health"][11]["flags"] == ["still"]
    assert len(out["loss"]) == H.STEPS and out["last_step"] == H.STEPS


def test_the_status_types_health_and_catalogue_progress_and_the_run_says_each_flag_once(tmp_path):
    H.write_health_run(tmp_path)
    snap = MonitorState(tmp_path, clock=lambda: F.NOW).refresh()
    assert snap["health_flags"] == [dict(H.STILL, ranks=[0, 1]), dict(H.OVERFIT, ranks=[0])]
    assert snap["recipe"] == H.RECIPE
    assert snap["ranks"][1]["catalogue_progress"] == [{"name": n, "seen": s, "per_epoch": p}
                                                      for n, s, p in H.CATALOGUES[1]]
    assert snap["ranks"][0]["health"]["max_update_block"] == 15
    json.dumps(snap, allow_nan=False)
    odd, notes = normalize_status({"status": "training", "health": {"step": "7", "max_update_norm": "nan", "flags": [
        {"flag": "\x1b[2Jstill", "what": 3, "do": "x" * 5000}, {"what": "no name"}, "still"] + [{"flag": "f"}] * 40},
        "catalogue_progress": [{"name": "a\x07", "seen": "3", "per_epoch": None}, 5, {"seen": 1}]}, 0)
    assert odd["health"]["step"] == 7 and odd["health"]["max_update_norm"] is None
    flags = odd["health"]["flags"]
    assert flags[0] == {"flag": "[2Jstill", "step": None, "what": None, "do": "x" * 2000} and len(flags) == 14
    assert odd["catalogue_progress"] == [{"name": "a", "seen": 3, "per_epoch": None}]
    none, _ = normalize_status({"status": "training", "health": [1], "catalogue_progress": {"a": 1}}, 0)
    assert none["health"] is None and none["catalogue_progress"] is None


def test_the_status_types_the_early_stop_count_and_drops_what_is_not_one():
    odd, _ = normalize_status({"status": "training", "early_stop_count": {
        "step": "224", "count": 2, "patience": "3", "min_delta": "0.001", "not_counted": "\x1b[2J", "change": "nan",
        "since_step": 203, "reset": "yes", "finite": False}}, 0)
    assert odd["early_stop_count"] == {"step": 224, "count": 2, "patience": 3, "counts_from_step": None,
                                       "compared_with_step": None, "since_step": 203, "min_delta": 0.001,
                                       "change": None, "not_counted": None, "finite": False, "reset": False}
    for bad in ([1], {"count": 2}, {"count": "x", "patience": 3}):
        assert normalize_status({"status": "training", "early_stop_count": bad}, 0)[0]["early_stop_count"] is None


def test_the_recipe_is_rank_0s_and_an_absurd_one_is_not_shown():
    assert recipe_of([{"rank": 1, "recipe": {"lora": 1}}, {"rank": 0, "recipe": {"lora": 0}}]) == {"lora": 0}
    assert recipe_of([{"rank": 1, "recipe": {"lora": 1}}, {"rank": 0, "recipe": "odd"}]) == {"lora": 1}
    assert recipe_of([{"rank": 0}]) is None
    assert recipe_of([{"rank": 0, "recipe": {"x": "y" * MAX_RECIPE_BYTES}}]) is None
    assert run_flags([{"rank": 0, "health": None}, {"rank": 1}]) == []


def test_a_ranks_absurd_recipe_leaves_its_view_in_the_status_api_too(tmp_path):
    """The run-level recipe was capped at 64 KB while a rank's 1.2 MB recipe passed /api/training/status whole."""
    F.write_status(tmp_path, 0, recipe={"x": "y" * (1200 << 10)})
    F.write_status(tmp_path, 1, recipe={"lora": "rank 4"})
    snapshot = MonitorState(tmp_path, clock=lambda: F.NOW).snapshot()
    views = {r["rank"]: r for r in snapshot["ranks"]}
    assert views[0]["recipe"] is None and views[1]["recipe"] == {"lora": "rank 4"}
    assert len(json.dumps(snapshot)) < 64 << 10
