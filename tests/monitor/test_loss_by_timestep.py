"""Loss by timestep: the per-rank history's (timestep, loss) pairs binned over [0, 1000) with an EMA per bin,
read incrementally by the monitor and served with the down-sampled series."""

from __future__ import annotations

import json
import math

import pytest

import monitor_fixtures as F
from diffsynth_mbc.monitor.history import HistoryFile
from diffsynth_mbc.monitor.state import MonitorState
from diffsynth_mbc.monitor.timestep_bins import ALPHA, BINS, LAG, MARK_EVERY, LossByTimestep
from diffsynth_mbc.training.reporting.progress import ProgressLogger
from diffsynth_mbc.training.reporting.status_writer import RankStatusWriter


def test_each_pair_lands_in_its_bin_and_the_bin_keeps_an_ema():
    bins = LossByTimestep()
    bins.add([10.0, 20.0, 999.9, 1000.0], [1.0, 3.0, 0.5, 0.7])
    out = bins.as_dict()
    assert len(out["edges"]) == BINS + 1 and out["edges"][0] == 0 and out["edges"][-1] == 1000
    assert out["count"][0] == 2 and out["count"][-1] == 2 and sum(out["count"]) == 4
    assert out["ema"][0] == pytest.approx(1.0 + ALPHA * (3.0 - 1.0))
    assert out["ema"][-1] == pytest.approx(0.5 + ALPHA * (0.7 - 0.5))
    assert out["ema"][1:-1] == [None] * (BINS - 2)


def test_each_bin_keeps_its_average_as_it_was_lag_samples_earlier():
    """The trend is read from the run, not from one snapshot: beside its average, a bin says what its average was
    LAG to LAG + MARK_EVERY - 1 of its samples earlier (none before it has that many), from a few marks."""
    bins, averages = LossByTimestep(), [None]   # averages[n]: bin 3's average after its n-th sample
    for n in range(1, 3 * LAG + 1):
        bins.add([160.0], [1.0 / n])   # a falling loss in bin [150, 200)
        averages.append(bins.ema[3])
        out = bins.as_dict()
        assert out["ema"][3] == pytest.approx(averages[n], rel=1e-5) and out["count"][3] == n
        if n < LAG + MARK_EVERY:
            assert out["earlier"][3] is None and out["earlier_count"][3] is None, n
            continue
        then = out["earlier_count"][3]
        assert LAG <= n - then < LAG + MARK_EVERY and then % MARK_EVERY == 0, (n, then)
        assert out["earlier"][3] == pytest.approx(averages[then], rel=1e-5) and out["earlier"][3] > out["ema"][3]
        assert len(bins.marks[3]) <= LAG // MARK_EVERY + 1   # a few marks a bin, however long the run
    assert out["earlier"][:3] == [None] * 3 and out["lag"] == LAG and out["mark_every"] == MARK_EVERY


def test_nonsense_pairs_are_left_out():
    bins = LossByTimestep()
    bins.add([float("nan"), -1.0, 1500.0, "5", 100.0, 200.0], [1.0, 1.0, 1.0, 1.0, float("inf"), True])
    bins.add("500", [1.0])
    bins.add([500.0], None)
    assert sum(bins.as_dict()["count"]) == 0


def _write(path, records, mode="a"):
    with open(path, mode, encoding="utf-8") as handle:
        handle.write("".join(json.dumps(r) + "\n" for r in records))


def _records(steps, seed=0):
    out = []
    for step in steps:
        t = [(step * 37.0 + k * 311.0 + seed) % 1000 for k in range(3)]
        out.append({"step": step, "loss": 0.1, "step_time_s": 1.0, "timesteps": t,
                    "timestep_losses": [0.5 + math.sin(x) / 4 for x in t]})
    return out


def test_the_history_is_read_incrementally_and_gives_the_same_as_reading_it_whole(tmp_path):
    path = tmp_path / "training_gpu0.jsonl"
    _write(path, _records(range(1, 301)), "w")
    growing = HistoryFile(path)
    growing.poll()
    consumed = growing.offset
    _write(path, _records(range(301, 601)))
    growing.poll()
    assert growing.offset > consumed   # the second poll read on from where the first stopped
    whole = HistoryFile(path)
    whole.poll()
    assert growing.by_timestep.as_dict() == whole.by_timestep.as_dict()
    assert sum(whole.by_timestep.count) == 1800


def test_metrics_serve_each_ranks_loss_by_timestep(tmp_path):
    log_dir = F.make_run(tmp_path, world_size=2, steps=10)
    _write(log_dir / "training_gpu1.jsonl", _records(range(11, 21), seed=5))
    data = MonitorState(log_dir, clock=lambda: F.NOW).metrics(points=100)
    zero, one = data["ranks"]["0"]["loss_by_timestep"], data["ranks"]["1"]["loss_by_timestep"]
    assert sum(zero["count"]) == 0 and zero["ema"] == [None] * BINS   # a history without timesteps: empty bins
    assert sum(one["count"]) == 30 and any(v is not None for v in one["ema"])


def test_a_step_record_carries_each_samples_timestep_loss_and_mode(tmp_path):
    status = RankStatusWriter(tmp_path / "logs", "run-t", 0, 0, 1)
    logger = ProgressLogger(str(tmp_path / "out"), status, steps_per_epoch=2, num_epochs=1, samples_per_step=2)
    logger.on_train_begin()
    logger.on_step_end(None, None, loss=0.4, lr=1e-4, samples=2,
                       timestep_draws=[(912.3456, 0.41234567, "t2i"), (87.0, 0.38, "i2v")])
    logger.on_step_end(None, None, loss=0.4, lr=1e-4, samples=2)
    status.close()
    lines = [json.loads(line) for line in (tmp_path / "logs" / "training_gpu0.jsonl").read_text().splitlines()]
    first, second = [line for line in lines if "kind" not in line]
    assert first["timesteps"] == [912.35, 87.0] and first["timestep_losses"] == [0.412346, 0.38]
    assert first["modes"] == ["t2i", "i2v"]
    assert "timesteps" not in second and "modes" not in second
