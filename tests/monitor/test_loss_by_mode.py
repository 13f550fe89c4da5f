"""Loss per training mode (t2i, i2v, t2v): each step record's ``modes`` (one per sample, beside ``timesteps`` and
``timestep_losses``) read incrementally into a series per mode and loss-by-timestep bins per mode, served by the
metrics API and shown by the terminal monitor. Histories from before modes (no ``modes``) keep working."""

from __future__ import annotations

import json
import time

import pytest

import monitor_fixtures as F
from diffsynth_mbc.monitor import cli as monitor
from diffsynth_mbc.monitor.history import HistoryFile
from diffsynth_mbc.monitor.modes import MAX_MODES, RECENT_STEPS
from diffsynth_mbc.monitor.state import MonitorState
from diffsynth_mbc.monitor.timestep_bins import LossByTimestep
from test_server import start_server, stop_server

# Hand-written records as the training writes them: step 2 is an older record (no modes), step 3 trains i2v only.
RECORDS = [
    {"step": 1, "epoch": 0, "loss": 0.4, "timesteps": [912.35, 87.0, 500.1], "timestep_losses": [0.4, 0.6, 0.2],
     "modes": ["t2i", "i2v", "t2i"]},
    {"step": 2, "epoch": 0, "loss": 0.3, "timesteps": [10.0, 990.0], "timestep_losses": [0.3, 0.3]},
    {"step": 3, "epoch": 0, "loss": 0.6, "timesteps": [40.0, 960.0], "timestep_losses": [0.5, 0.7],
     "modes": ["i2v", "i2v"]},
    {"step": 3, "kind": "val", "val_loss": 0.6, "val_loss_by_mode": {"t2i": 0.5, "i2v": 0.7}},
]
TORN = {"step": 4, "epoch": 0, "loss": 0.9, "timesteps": [700.0], "timestep_losses": [0.9], "modes": ["t2v"]}


def lines(records) -> str:
    return "".join(json.dumps(r) + "\n" for r in records)


def curve(history: HistoryFile, mode: str) -> list[tuple[float, float]]:
    return [(p["step"], p["value"]) for p in history.modes.payload(None, None)["loss_by_mode"][mode]]


def test_each_mode_is_the_mean_of_its_samples_at_the_steps_it_trained(tmp_path):
    path = F.write_raw(tmp_path / "training_gpu0.jsonl", lines(RECORDS) + json.dumps(TORN)[:40])
    history = HistoryFile(path)
    history.poll()
    assert history.torn
    out = history.modes.payload(None, None)
    assert list(out["loss_by_mode"]) == ["t2i", "i2v"]        # the torn t2v line is not read yet
    assert curve(history, "t2i") == [(1, pytest.approx(0.3))]   # no point at step 3, which trained no t2i
    assert curve(history, "i2v") == [(1, 0.6), (3, pytest.approx(0.6))]
    assert {m: [p["value"] for p in points] for m, points in out["val_loss_by_mode"].items()} == {
        "t2i": [0.5], "i2v": [0.7]}
    assert history.loss.count == 3 and sum(history.by_timestep.count) == 7   # the record without modes counts there
    F.write_raw(path, lines(RECORDS) + json.dumps(TORN) + "\n")   # the rest of the line arrives
    history.poll()
    assert not history.torn and curve(history, "t2v") == [(4, 0.9)]
    assert list(history.modes.payload(None, None)["loss_by_mode"]) == ["t2i", "i2v", "t2v"]
    assert history.modes.recent_losses() == {"t2i": pytest.approx(0.3), "i2v": pytest.approx(0.6), "t2v": 0.9}


def test_each_modes_bins_hold_its_own_samples_and_the_all_samples_bins_stay_whole(tmp_path):
    path = F.write_raw(tmp_path / "training_gpu0.jsonl", lines(RECORDS + [TORN]))
    history = HistoryFile(path)
    history.poll()
    bins = history.modes.payload(None, None)["loss_by_timestep_by_mode"]
    for mode in ("t2i", "i2v", "t2v"):
        alone = LossByTimestep()
        for record in [r for r in RECORDS + [TORN] if "timesteps" in r]:
            pairs = [(t, v) for t, v, m in zip(record["timesteps"], record["timestep_losses"],
                                                record.get("modes", [])) if m == mode]
            alone.add([t for t, _ in pairs], [v for _, v in pairs])
        assert bins[mode] == alone.as_dict(), mode
    assert bins["i2v"]["count"][0] == 1 and bins["i2v"]["count"][1] == 1 and sum(bins["i2v"]["count"]) == 3
    everything = LossByTimestep()
    for record in RECORDS + [TORN]:
        everything.add(record.get("timesteps"), record.get("timestep_losses"))
    assert history.by_timestep.as_dict() == everything.as_dict()   # all samples, old records among them


def mode_record(step: int) -> dict:
    """Three samples a step: t2i, i2v, and a t2v every third step (a mode absent from a step has no point there)."""
    modes = ["t2i", "i2v"] + (["t2v"] if step % 3 == 0 else [])
    timesteps = [round((step * 37.0 + k * 311.0) % 1000, 2) for k in range(len(modes))]
    losses = [round(0.3 + 0.1 * k + t / 10_000 - step / 100_000, 6) for k, t in enumerate(timesteps)]
    return {"step": step, "loss": sum(losses) / len(losses), "step_time_s": 1.0, "timesteps": timesteps,
            "timestep_losses": losses, "modes": modes}


def test_read_incrementally_it_is_what_a_whole_read_gives_and_stays_bounded(tmp_path):
    path = tmp_path / "training_gpu0.jsonl"
    growing = HistoryFile(path, max_points=64)
    for start in range(1, 3001, 750):   # four appends, each read on from where the last poll stopped
        with open(path, "a", encoding="utf-8") as handle:
            handle.write(lines(mode_record(s) for s in range(start, start + 750)))
        growing.poll()
    whole = HistoryFile(path, max_points=64)
    whole.poll()
    for mode, steps in (("t2i", 3000), ("i2v", 3000), ("t2v", 1000)):
        kept = growing.modes.series[mode]
        assert len(kept) <= 64 and sum(kept.n) == kept.count == steps, mode   # bounded, every step counted
        assert kept.x == whole.modes.series[mode].x and kept.mean == pytest.approx(whole.modes.series[mode].mean)
        assert growing.modes.by_timestep[mode].as_dict() == whole.modes.by_timestep[mode].as_dict()
    assert len(growing.modes.recent["t2v"]) == RECENT_STEPS


def test_a_history_without_modes_has_no_per_mode_data_and_odd_modes_are_left_out(tmp_path):
    F.make_run(tmp_path, world_size=1, steps=20)   # an older run: no modes anywhere
    state = MonitorState(tmp_path, clock=lambda: F.NOW)
    out = state.metrics(points=100)["ranks"]["0"]
    assert out["loss_by_mode"] == {} and out["loss_by_timestep_by_mode"] == {} and out["val_loss_by_mode"] == {}
    assert len(out["loss"]) == 20 and sum(out["loss_by_timestep"]["count"]) == 0   # the rest as before
    assert state.refresh()["ranks"][0]["loss_by_mode"] == {}
    odd = [{"step": 21, "timestep_losses": [0.1, 0.2], "modes": "t2i"},                    # not a list
           {"step": 22, "timestep_losses": [0.1, float("nan"), True, 0.4], "modes": ["t2i", "i2v", "i2v", 7]},
           {"step": 23, "timestep_losses": [0.5], "modes": ["a-very-long-mode-name"]},
           {"step": 24, "timestep_losses": [0.5] * 12, "modes": [f"mode{i}\x1b[2J" for i in range(12)]},
           {"step": 25, "timesteps": [10 ** 400, 10.0], "timestep_losses": [0.5, 10 ** 400], "modes": ["t2i"] * 2}]
    F.write_raw(tmp_path / "training_gpu0.jsonl", (tmp_path / "training_gpu0.jsonl").read_text() + lines(odd))
    out = state.metrics(points=100)["ranks"]["0"]["loss_by_mode"]
    assert [p["value"] for p in out["t2i"]] == [0.1, 0.5] and "i2v" not in out   # NaN, a bool: no loss
    bins = state.metrics(points=100)["ranks"]["0"]["loss_by_timestep_by_mode"]["t2i"]
    assert sum(bins["count"]) == 0   # a timestep or loss too large for a float is none (it crashed the reader)
    assert len(out) == MAX_MODES and "a-very-long-" in out                   # a name is cut to 12 characters,
    assert "mode5[2J" in out and "mode6[2J" not in out                       # made printable, and no more kept
    json.dumps(out, allow_nan=False)


def write_mode_run(log_dir, now, steps=30):
    """Two ranks: rank 0 trains t2i and i2v every step, rank 1 i2v and t2v. The last 20 steps' losses are
    constant, the first 10 far off: the terminal's figure is the mean of the last 20 steps per mode."""
    losses = {0: {"t2i": 0.4123, "i2v": 0.5331}, 1: {"i2v": 0.5012, "t2v": 0.6012}}
    for rank, by_mode in losses.items():
        records = [{"step": s, "epoch": 0, "loss": 0.5, "lr": 1e-4, "step_time_s": 2.0, "samples": 2,
                    "time": now - 100 + s, "timesteps": [100.0, 700.0], "modes": list(by_mode),
                    "timestep_losses": [v if s > steps - RECENT_STEPS else 0.9 for v in by_mode.values()]}
                   for s in range(1, steps + 1)]
        records.append({"step": steps, "kind": "val", "val_loss": 0.55, "val_loss_by_mode": {"t2i": 0.5, "i2v": 0.6}})
        F.write_raw(log_dir / f"training_gpu{rank}.jsonl", lines(records))
        F.write_status(log_dir, rank, world_size=2, step=steps, now=now,
                       val_loss_by_mode={"t2i": 0.5, "i2v": 0.6}, plan={"modes_per_epoch": {"t2i": 30, "i2v": 30}})
    return losses


@pytest.mark.slow
def test_the_api_serves_the_loss_per_mode_beside_the_existing_series(tmp_path):
    losses = write_mode_run(tmp_path, time.time())
    srv = start_server(tmp_path, "--no-view")
    try:
        status, _, body = srv.json("/api/training/metrics?rank=0&points=100")
        r0 = body["ranks"]["0"]
        assert status == 200 and len(r0["loss"]) == 30 and sum(r0["loss_by_timestep"]["count"]) == 60
        assert list(r0["loss_by_mode"]) == ["t2i", "i2v"]
        assert [p["step"] for p in r0["loss_by_mode"]["t2i"]] == list(range(1, 31))
        assert r0["loss_by_mode"]["t2i"][-1]["value"] == 0.4123 and r0["loss_by_mode"]["i2v"][0]["value"] == 0.9
        by_bin = r0["loss_by_timestep_by_mode"]
        assert by_bin["t2i"]["count"][2] == 30 and sum(by_bin["t2i"]["count"]) == 30   # t=100: the third bin
        assert by_bin["i2v"]["count"][14] == 30 and by_bin["i2v"]["edges"] == r0["loss_by_timestep"]["edges"]
        assert r0["val_loss_by_mode"] == {"t2i": [{"step": 30, "value": 0.5, "min": 0.5, "max": 0.5, "n": 1}],
                                          "i2v": [{"step": 30, "value": 0.6, "min": 0.6, "max": 0.6, "n": 1}]}
        status, _, body = srv.json("/api/training/metrics?rank=1&points=100")
        assert list(body["ranks"]["1"]["loss_by_mode"]) == ["i2v", "t2v"]
        status, _, snap = srv.json("/api/training/status")
        ranks = {r["rank"]: r for r in snap["ranks"]}
        assert {rank: ranks[rank]["loss_by_mode"] for rank in (0, 1)} == losses
        assert ranks[0]["val_loss_by_mode"] == {"t2i": 0.5, "i2v": 0.6}            # the status file's, as written
        assert ranks[0]["plan"]["modes_per_epoch"] == {"t2i": 30, "i2v": 30}
    finally:
        stop_server(srv)


@pytest.mark.parametrize("columns", [200, 80])
def test_the_terminal_shows_each_ranks_recent_loss_per_mode_only_for_a_run_with_modes(tmp_path, capsys, monkeypatch,
                                                                                      columns):
    monkeypatch.setenv("COLUMNS", str(columns))
    write_mode_run(tmp_path, time.time())
    assert monitor.main([str(tmp_path), "--once"]) == 0
    out = capsys.readouterr().out
    assert max(len(line) for line in out.splitlines()) <= columns
    row0, row1 = (next(line for line in out.splitlines() if f"rank {rank} " in line) for rank in (0, 1))
    assert row0.split() == ["loss", "by", "mode", "(last", f"{RECENT_STEPS}", "steps)", "rank", "0",
                            "t2i", "0.4123", "i2v", "0.5331"], out   # 4 significant digits, as the loss column
    assert row1.split() == ["rank", "1", "i2v", "0.5012", "t2v", "0.6012"], out
    assert row0.index("i2v") == row1.index("i2v")   # a column per mode: each mode under itself
    older = F.make_run(tmp_path / "older", world_size=2, steps=30, now=time.time())   # a history without modes
    assert monitor.main([str(older), "--once"]) == 0
    assert "loss by mode" not in capsys.readouterr().out
