"""convert --probe --reject_short: clips shorter than the frames that train are rejected before training, with why."""

from __future__ import annotations

import json

import pandas as pd

from catalog_helpers import read_csv_records, write_catalog
from diffsynth_mbc.data.convert import main
from diffsynth_mbc.data.demo_data import write_video


def test_short_videos_are_rejected_with_their_count_at_the_source_fps_too(tmp_path):
    base = tmp_path / "data"
    write_video(base / "long.mp4", num_frames=21, width=64, height=48, fps=10)
    write_video(base / "short.mp4", num_frames=5, width=64, height=48, fps=10)
    catalog = write_catalog(base / "c.csv", [("long.mp4", "long", "video"), ("short.mp4", "short", "video")])
    common = [str(catalog), "--base-path", str(base), "--probe", "--min-frames", "17", "--height", "32",
              "--width", "64", "--reject-short"]

    assert main(common + ["--output", str(tmp_path / "a")]) == 0
    assert list(pd.read_csv(tmp_path / "a" / "metadata.csv")["video"]) == ["long.mp4"]
    assert [(r["file_path"], r["reason"]) for r in read_csv_records(tmp_path / "a" / "rejects.csv")] == [
        ("short.mp4", "short video (5 frames, fewer than --min_frames 17)")]
    probe = json.loads((tmp_path / "a" / "summary.json").read_text())["probe"]
    assert probe["rejected_short_videos"] == 1 and probe["unreadable"] == 0 and probe["flagged_short_videos"] == 0

    # At 5 fps the 21 frames of a 10 fps clip are 11: short too.
    assert main(common + ["--output", str(tmp_path / "b"), "--source-fps", "5"]) == 1
    reasons = {r["file_path"]: r["reason"] for r in read_csv_records(tmp_path / "b" / "rejects.csv")}
    assert reasons["long.mp4"] == "short video (11 frames at --source_fps 5 (21 at 10 fps), fewer than --min_frames 17)"

    # Without --reject_short they are flagged, as before; without --probe the flags are a usage error.
    assert main(common[:-1] + ["--output", str(tmp_path / "c")]) == 0
    assert len(pd.read_csv(tmp_path / "c" / "metadata.csv")) == 2
    assert main([str(catalog), "--base-path", str(base), "--output", str(tmp_path / "d"), "--reject-short"]) == 2
