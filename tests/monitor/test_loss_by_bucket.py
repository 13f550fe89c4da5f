"""Samples and loss per shape bucket (``--buckets aspect``): each step record's ``shapes`` (one ``[frames, height,
width]`` per sample, beside ``timesteps``, ``timestep_losses`` and ``modes``) read incrementally into a count and a
mean loss per bucket and rank, served by the metrics API. Histories from before buckets (no ``shapes``) keep working."""

from __future__ import annotations

import json

import pytest

import monitor_fixtures as F
from diffsynth_mbc.monitor.buckets import MAX_BUCKETS, BucketLosses, bucket_name
from diffsynth_mbc.monitor.history import HistoryFile
from diffsynth_mbc.monitor.state import MonitorState

VIDEO, IMAGE, WIDE = [49, 960, 960], [1, 960, 960], [33, 704, 1280]   # a video and an image of one size
# Hand-written records as the training writes them: step 2 is an older record (no shapes), steps 4 and 5 are
# malformed (a shape short, a mode short) and count nowhere among the buckets.
RECORDS = [
    {"step": 1, "loss": 0.4, "timesteps": [900.0, 100.0, 500.0], "timestep_losses": [0.4, 0.6, 0.2],
     "modes": ["t2v", "t2i", "i2v"], "shapes": [VIDEO, IMAGE, WIDE]},
    {"step": 2, "loss": 0.3, "timesteps": [10.0, 990.0], "timestep_losses": [0.3, 0.3], "modes": ["t2i", "t2v"]},
    {"step": 3, "loss": 0.5, "timesteps": [40.0, 960.0], "timestep_losses": [0.8, 0.1], "modes": ["t2v", "t2i"],
     "shapes": [VIDEO, IMAGE]},
    {"step": 4, "loss": 0.5, "timesteps": [40.0, 960.0], "timestep_losses": [0.5, 0.5], "modes": ["t2v", "t2v"],
     "shapes": [VIDEO]},
    {"step": 5, "loss": 0.5, "timesteps": [40.0, 960.0], "timestep_losses": [0.5, 0.5], "modes": ["t2v"],
     "shapes": [VIDEO, VIDEO]},
    {"step": 5, "kind": "val", "val_loss": 0.6},
]
WANT = {"1280x704": {"samples": 1, "loss": 0.2}, "960x960": {"samples": 2, "loss": pytest.approx(0.6)},
        "960x960 image": {"samples": 2, "loss": pytest.approx(0.35)}}


def lines(records) -> str:
    return "".join(json.dumps(r) + "\n" for r in records)


def test_a_bucket_is_width_by_height_and_an_image_is_told_from_a_video_of_its_size():
    assert bucket_name([33, 704, 1280]) == "1280x704" and bucket_name([1, 960, 960]) == "960x960 image"
    assert bucket_name([49.0, 480, 832]) == "832x480"   # a whole number written as a float is one
    for odd in ([0, 480, 832], [1, -480, 832], [1, 480], [1, 480, 832, 3], "1x480x832", [True, 480, 832],
                [1, 480.5, 832], [1, 480, 10 ** 400], [1, 480, float("inf")], None, {"frames": 1}):
        assert bucket_name(odd) is None, odd


def test_each_bucket_counts_its_samples_and_means_their_losses_old_and_malformed_records_aside(tmp_path):
    path = F.write_raw(tmp_path / "training_gpu0.jsonl", lines(RECORDS))
    history = HistoryFile(path)
    history.poll()
    out = history.buckets.as_dict()
    assert out == WANT and list(out) == sorted(WANT)   # ordered by name
    assert sum(history.by_timestep.count) == 11 and history.loss.count == 5   # the rest reads every record as before
    json.dumps(out, allow_nan=False)


def test_samples_without_a_shape_or_a_finite_loss_are_left_out_and_names_are_bounded():
    buckets = BucketLosses()
    buckets.add("not a list", [0.1])
    buckets.add([VIDEO, VIDEO], [0.1, 0.2], timesteps=[1.0])          # timesteps of another length: the whole record
    buckets.add([VIDEO, VIDEO], [0.1, 0.2], modes="t2v")               # modes not a list: the whole record
    assert buckets.as_dict() == {}
    buckets.add([VIDEO, [1, "a", 3], IMAGE, WIDE, VIDEO], [float("nan"), 0.5, True, 10 ** 400, 0.3])
    assert buckets.as_dict() == {"960x960": {"samples": 1, "loss": 0.3}}   # NaN, a bool, a huge int: no loss
    buckets.add([[1, 16 * (i + 1), 16] for i in range(MAX_BUCKETS + 10)], [0.5] * (MAX_BUCKETS + 10))
    assert len(buckets.as_dict()) == MAX_BUCKETS


def bucket_record(step: int) -> dict:
    """Three samples a step in four buckets that take turns; the losses drift with the step."""
    shapes = [[1, 704, 1280], [49, 704, 1280], [33, 960, 960] if step % 2 else [1, 960, 960]]
    losses = [round(0.2 + 0.1 * k + step / 100_000, 6) for k in range(3)]
    return {"step": step, "loss": sum(losses) / 3, "timesteps": [100.0, 500.0, 900.0], "timestep_losses": losses,
            "modes": ["t2i", "t2v", "t2v" if step % 2 else "t2i"], "shapes": shapes}


def test_read_incrementally_it_is_what_a_whole_read_gives(tmp_path):
    path = tmp_path / "training_gpu0.jsonl"
    growing = HistoryFile(path, max_points=64)
    for start in range(1, 2001, 500):   # four appends, each read on from where the last poll stopped
        with open(path, "a", encoding="utf-8") as handle:
            handle.write(lines(bucket_record(s) for s in range(start, start + 500)))
        growing.poll()
    whole = HistoryFile(path, max_points=64)
    whole.poll()
    assert growing.buckets.samples == whole.buckets.samples == {
        "1280x704 image": 2000, "1280x704": 2000, "960x960": 1000, "960x960 image": 1000}
    got, want = growing.buckets.as_dict(), whole.buckets.as_dict()
    assert list(got) == list(want) and all(got[b]["loss"] == pytest.approx(want[b]["loss"]) for b in want)
    assert got["1280x704"]["loss"] == pytest.approx(0.3 + 1000.5 / 100_000)


def test_the_metrics_carry_each_ranks_buckets_and_nothing_for_a_history_without_shapes(tmp_path):
    F.make_run(tmp_path, world_size=2, steps=20)   # an older run: no shapes anywhere
    state = MonitorState(tmp_path, clock=lambda: F.NOW)
    out = state.metrics(points=100)["ranks"]
    assert out["0"]["loss_by_bucket"] == {} == out["1"]["loss_by_bucket"] and len(out["0"]["loss"]) == 20
    F.write_raw(tmp_path / "training_gpu0.jsonl", (tmp_path / "training_gpu0.jsonl").read_text() + lines(RECORDS))
    rank1 = [{"step": 21, "timesteps": [5.0, 6.0], "timestep_losses": [0.9, 0.7], "shapes": [IMAGE, IMAGE]}]
    F.write_raw(tmp_path / "training_gpu1.jsonl", (tmp_path / "training_gpu1.jsonl").read_text() + lines(rank1))
    out = state.metrics(points=100)["ranks"]
    assert out["0"]["loss_by_bucket"] == WANT
    assert out["1"]["loss_by_bucket"] == {"960x960 image": {"samples": 2, "loss": pytest.approx(0.8)}}
    assert state.metrics(rank=1, points=100, since=100)["ranks"]["1"]["loss_by_bucket"]["960x960 image"][
        "samples"] == 2   # over the run, whatever since
