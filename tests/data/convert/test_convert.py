"""The converter end to end on real small catalogues with real mp4/png/jpg files."""

from __future__ import annotations

import hashlib
import inspect
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

from catalog_helpers import read_csv_records, write_catalog
from diffsynth_mbc.data.convert import catalogue_rows as cat
from diffsynth_mbc.data.convert import main
from diffsynth_mbc.data.demo_data import make_demo_catalog, write_image, write_video

REPO_ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def demo(tmp_path_factory) -> Path:
    """6 videos (9 frames, 64x64, 8 fps) and 6 images with catalog.csv; tests must not change it."""
    root = tmp_path_factory.mktemp("demo")
    make_demo_catalog(root)
    return root


def convert(*args) -> int:
    return main([str(a) for a in args])


def load_summary(out: Path) -> dict:
    return json.loads((out / "summary.json").read_text(encoding="utf-8"))


def assert_every_row_accounted(out: Path) -> None:
    summary = load_summary(out)
    for name, accounting in summary["accounting"].items():
        assert (accounting["written"] + accounting["rejected"] + accounting.get("not_in_subset", 0)
                == accounting["input"] == summary["input_rows"][name])
    rejects = read_csv_records(out / "rejects.csv")
    assert len(rejects) == sum(summary["rejected_rows"].values())
    assert len({(r["catalog"], r["row"]) for r in rejects}) == len(rejects)
    if summary["subset"]:
        left_out = read_csv_records(out / "not_in_subset.csv")
        assert len(left_out) == sum(summary["not_in_subset_rows"].values())
        assert not {(r["catalog"], r["row"]) for r in left_out} & {(r["catalog"], r["row"]) for r in rejects}


def test_demo_catalog_converts_and_pandas_reads_captions_back_exactly(demo, tmp_path):
    catalog = demo / "catalog.csv"
    before = catalog.read_bytes()
    out = tmp_path / "out"
    assert convert(catalog, "--base-path", demo, "--output", out) == 0

    written = pd.read_csv(out / "metadata.csv")  # the way DiffSynth reads it
    source = pd.read_csv(catalog)
    assert list(written.columns) == ["video", "prompt", "media_type"]
    assert list(written["video"]) == list(source["file_path"])
    assert list(written["prompt"]) == list(source["caption"])
    assert list(written["media_type"]) == ["video"] * 6 + ["image"] * 6
    assert read_csv_records(out / "rejects.csv") == []
    assert sorted(os.listdir(out)) == ["metadata.csv", "rejects.csv", "summary.json"]  # no temp files left

    summary = load_summary(out)
    assert summary["input_rows"] == {"train": 12}
    assert summary["written_rows"] == {"train": 12, "val": 0}
    assert summary["media_types"]["train"] == {"video": 6, "image": 6}
    assert summary["inputs"]["train"]["sha256"] == hashlib.sha256(before).hexdigest()
    assert summary["arguments"]["base_path"] == str(demo)
    assert summary["files_checked"] is True and summary["probe"] is None
    assert catalog.read_bytes() == before


def test_messy_catalogue_every_reason_and_exact_captions(demo, tmp_path):
    outside = tmp_path / "outside.mp4"
    outside.write_bytes(b"")
    korean = '서울 "야경", 한강\n다리 위, 차들이 지나간다'
    rows = [
        ("media/video_000.mp4", korean, "Video", "x"),  # 1 ok
        ("media/image_000.png", "A cat, sitting", "IMAGE", ""),  # 2 ok
        ("media/video_000.mp4", "again", "video", ""),  # 3 duplicate of row 1
        ("../outside.mp4", "traversal", "video", ""),  # 4 outside
        (str(outside), "absolute elsewhere", "video", ""),  # 5 outside
        ("media/image_001.jpg", "", "image", ""),  # 6 empty caption
        ("media/video_001.mp4", "x", "clip", ""),  # 7 unknown media type
        ("media/image_002.png", "x", "video", ""),  # 8 extension contradicts media_type
        ("media/nope.mp4", "x", "video", ""),  # 9 missing file
        (str(demo / "media/image_003.jpg"), " 이미지 ", " Image ", ""),  # 10 ok, absolute inside
    ]
    catalog = tmp_path / "messy.csv"
    write_catalog(catalog, rows, header=(" file_path", "caption ", " Media_Type ", "camera"), line_end="\r\n", bom=True)
    # blank lines: one after the header, one between rows 4 and 5 (neither is a data row)
    text = catalog.read_bytes().replace(b"camera\r\n", b"camera\r\n\r\n", 1)
    text = text.replace(b"traversal,video,\r\n", b"traversal,video,\r\n,,,\r\n")
    catalog.write_bytes(text)
    before = catalog.read_bytes()
    out = tmp_path / "out"

    assert convert(catalog, "--base-path", demo, "--output", out) == 0

    written = pd.read_csv(out / "metadata.csv")
    assert list(written["video"]) == ["media/video_000.mp4", "media/image_000.png", "media/image_003.jpg"]
    assert list(written["prompt"]) == [korean, "A cat, sitting", " 이미지 "]
    assert list(written["media_type"]) == ["video", "image", "image"]
    rejects = {int(r["row"]): r for r in read_csv_records(out / "rejects.csv")}
    assert {row: r["reason"].split(" (")[0] for row, r in rejects.items()} == {
        3: "duplicate of an earlier row", 4: "path outside --base_path", 5: "path outside --base_path",
        6: "empty caption", 7: "unknown media_type", 8: "extension contradicts media_type", 9: "missing file",
    }
    assert rejects[3]["reason"] == "duplicate of an earlier row (row 1)"
    assert rejects[4]["file_path"] == "../outside.mp4" and rejects[4]["catalog"] == "train"
    assert int(rejects[5]["line"]) == 9  # header 1, blank 2, row 1 spans 3-4, rows 2-4 on 5-7, ",,," on 8
    summary = load_summary(out)
    assert summary["blank_lines_skipped"] == {"train": 2}
    assert summary["inputs"]["train"]["columns"] == ["file_path", "caption", "Media_Type", "camera"]
    assert summary["rejects_by_reason"]["train"]["path outside --base_path"] == 2
    assert_every_row_accounted(out)
    assert catalog.read_bytes() == before


def test_media_filter_accounts_for_unselected_rows(demo, tmp_path):
    out = tmp_path / "out"
    assert convert(demo / "catalog.csv", "--base-path", demo, "--output", out, "--media", "video") == 0
    assert set(pd.read_csv(out / "metadata.csv")["media_type"]) == {"video"}
    rejects = read_csv_records(out / "rejects.csv")
    assert [r["reason"] for r in rejects] == ["not selected (--media video)"] * 6
    assert [int(r["row"]) for r in rejects] == list(range(7, 13))
    assert_every_row_accounted(out)


def test_subset_is_stratified_deterministic_and_says_when_it_takes_all(demo, tmp_path):
    def subset_rows(seed, size=4):
        out = tmp_path / f"out-{seed}-{size}"
        assert convert(demo / "catalog.csv", "--base-path", demo, "--output", out,
                       "--subset", size, "--seed", seed) == 0
        assert_every_row_accounted(out)
        return out, list(pd.read_csv(out / "metadata.csv")["video"])

    out, first = subset_rows(0)
    assert sum(p.endswith(".mp4") for p in first) == 2 and len(first) == 4
    assert subset_rows(0)[1] == first
    assert len({tuple(subset_rows(seed)[1]) for seed in range(1, 5)} | {tuple(first)}) > 1
    assert read_csv_records(out / "rejects.csv") == []               # the 8 rows left out are no rejects
    assert len(read_csv_records(out / "not_in_subset.csv")) == 8
    assert load_summary(out)["subset"]["took_all"] is False

    out, everything = subset_rows(0, size=100)
    assert len(everything) == 12
    assert load_summary(out)["subset"] == {
        "requested": 100, "available": 12, "taken": 12, "took_all": True,
        "available_by_media_type": {"video": 6, "image": 6}, "taken_by_media_type": {"video": 6, "image": 6},
    }


def test_validation_catalogue_rows_and_duplicates(demo, tmp_path):
    base = tmp_path / "data"
    shutil.copytree(demo / "media", base / "media")
    train = write_catalog(base / "train.csv", [
        ("media/video_000.mp4", "train video", "video"),
        ("media/image_000.png", "train image", "image"),
    ])
    write_image(base / "val_only.jpg", 32, 32)
    val = write_catalog(base / "val.csv", [
        ("media/video_000.mp4", "also used for validation", "video"),
        ("val_only.jpg", "val image", "image"),
        ("val_missing.png", "gone", "image"),
    ])
    out = tmp_path / "out"
    assert convert(train, "--base-path", base, "--output", out, "--val-catalog", val) == 0
    assert list(pd.read_csv(out / "metadata.csv")["video"]) == ["media/image_000.png"]
    assert list(pd.read_csv(out / "metadata_val.csv")["video"]) == ["media/video_000.mp4", "val_only.jpg"]
    rejects = read_csv_records(out / "rejects.csv")
    assert [(r["catalog"], r["row"], r["reason"].split(" (")[0]) for r in rejects] == [
        ("train", "1", "duplicate of validation row"),
        ("val", "3", "missing file"),
    ]
    summary = load_summary(out)
    assert summary["written_rows"] == {"train": 1, "val": 2}
    assert set(summary["inputs"]) == {"train", "val"}
    assert_every_row_accounted(out)


def test_val_fraction_split_is_stratified_disjoint_and_deterministic(demo, tmp_path):
    outs = []
    for name in ("a", "b"):
        out = tmp_path / name
        assert convert(demo / "catalog.csv", "--base-path", demo, "--output", out, "--val-fraction", "0.34") == 0
        outs.append(out)
    train = pd.read_csv(outs[0] / "metadata.csv")
    val = pd.read_csv(outs[0] / "metadata_val.csv")
    assert list(val["media_type"]).count("video") == 2 and list(val["media_type"]).count("image") == 2
    assert len(train) == 8 and not set(train["video"]) & set(val["video"])
    assert (outs[0] / "metadata_val.csv").read_bytes() == (outs[1] / "metadata_val.csv").read_bytes()
    assert load_summary(outs[0])["split"]["val"] == {"video": 2, "image": 2}
    assert_every_row_accounted(outs[0])


def test_stale_validation_metadata_is_removed(demo, tmp_path):
    out = tmp_path / "out"
    assert convert(demo / "catalog.csv", "--base-path", demo, "--output", out, "--val-fraction", "0.5") == 0
    assert (out / "metadata_val.csv").exists()
    assert convert(demo / "catalog.csv", "--base-path", demo, "--output", out) == 0
    assert not (out / "metadata_val.csv").exists()


def test_probe_records_sizes_flags_and_rejects_unreadable_media(tmp_path):
    base = tmp_path / "data"
    write_video(base / "long.mp4", num_frames=21, width=64, height=48, fps=10)
    write_video(base / "short.mp4", num_frames=5, width=64, height=48, fps=10)
    write_image(base / "pic.png", 80, 64)
    (base / "broken.mp4").write_bytes(b"\x00\x00\x00\x18ftypmp42 not really a video")
    (base / "broken.png").write_bytes(b"\x89PNG\r\n\x1a\n truncated")
    catalog = write_catalog(base / "c.csv", [
        ("long.mp4", "long", "video"), ("short.mp4", "short", "video"), ("pic.png", "pic", "image"),
        ("broken.mp4", "broken video", "video"), ("broken.png", "broken image", "image"),
    ])
    out = tmp_path / "out"
    assert convert(catalog, "--base-path", base, "--output", out, "--probe", "--workers", 2,
                   "--min-frames", 17, "--height", 32, "--width", 64) == 0

    written = pd.read_csv(out / "metadata.csv")
    assert list(written.columns) == ["video", "prompt", "media_type", "width", "height", "num_frames", "fps"]
    assert written[["video", "width", "height", "num_frames"]].values.tolist() == [
        ["long.mp4", 64, 48, 21], ["short.mp4", 64, 48, 5], ["pic.png", 80, 64, 1]]
    assert list(written["fps"][:2]) == [10.0, 10.0] and pd.isna(written["fps"][2])
    rejects = {r["file_path"]: r["reason"] for r in read_csv_records(out / "rejects.csv")}
    assert set(rejects) == {"broken.mp4", "broken.png"}
    assert all(reason.startswith("unreadable media (") and len(reason) > 25 for reason in rejects.values())
    probe = load_summary(out)["probe"]
    assert probe["flagged_short_videos"] == 1 and probe["flagged_small_media"] == 0 and probe["unreadable"] == 2
    assert probe["video_num_frames"] == {"5": 1, "21": 1}
    assert probe["width"] == {"64": 2, "80": 1} and probe["fps"] == {"10": 2}
    assert_every_row_accounted(out)

    # the training defaults (17 frames, 1280x704) flag everything here as small
    assert convert(catalog, "--base-path", base, "--output", out, "--probe") == 0
    assert load_summary(out)["probe"]["flagged_small_media"] == 3


def test_no_check_files_writes_rows_for_absent_storage(tmp_path):
    catalog = write_catalog(tmp_path / "c.csv", [("remote/a.mp4", "on the NAS", "video")])
    out = tmp_path / "out"
    assert convert(catalog, "--base-path", tmp_path / "not-mounted", "--output", out, "--no-check-files") == 0
    assert list(pd.read_csv(out / "metadata.csv")["video"]) == ["remote/a.mp4"]
    summary = load_summary(out)
    assert summary["files_checked"] is False and "not checked" in summary["note"]
    assert convert(catalog, "--base-path", tmp_path, "--output", out) == 1  # checked: the file is missing


def test_exit_1_when_nothing_is_written_but_files_explain_why(tmp_path, capsys):
    catalog = write_catalog(tmp_path / "c.csv", [("a.mp4", "", "video"), ("b.png", "x", "sound")])
    out = tmp_path / "out"
    assert convert(catalog, "--base-path", tmp_path, "--output", out) == 1
    assert pd.read_csv(out / "metadata.csv").empty
    assert len(read_csv_records(out / "rejects.csv")) == 2
    assert "no rows written" in capsys.readouterr().err
    assert_every_row_accounted(out)


@pytest.mark.parametrize("content, extra_args, message", [
    (b"file_path,caption\na.mp4,x\n", [], "missing required column 'media_type'"),
    ("file_path,caption,media_type\na.mp4,한국,video\n".encode("euc-kr"), [], "not UTF-8 (line 2"),
    (b'file_path,caption,media_type\na.mp4,"open,video\n', [], "malformed CSV at line 2"),
    (b"file_path,caption,media_type\n", ["--val-fraction", "1.5"], "--val_fraction must be between 0 and 1"),
    (b"file_path,caption,media_type\n", ["--subset", "0"], "--subset must be at least 1"),
    (b"file_path,caption,media_type\n", ["--val-fraction", "0.1", "--val-catalog", "v.csv"], "not allowed with"),
    (b"file_path,caption,media_type\n", ["--media", "audio"], "invalid choice"),
])
def test_usage_and_catalogue_errors_exit_2(tmp_path, capsys, content, extra_args, message):
    catalog = tmp_path / "cat.csv"
    catalog.write_bytes(content)
    status = convert(catalog, "--base-path", tmp_path, "--output", tmp_path / "out", *extra_args)
    err = " ".join(capsys.readouterr().err.split())
    assert status == 2
    assert message in err
    assert not (tmp_path / "out").exists()


def test_missing_catalogue_exits_2_naming_it(tmp_path, capsys):
    assert convert(tmp_path / "nope.csv", "--base-path", tmp_path, "--output", tmp_path / "out") == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "nope.csv" in err and "file not found" in err


def test_on_an_80_column_terminal_a_long_path_in_an_error_stays_whole(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "80")
    missing = tmp_path / ("a-folder-with-a-long-name-" * 4) / "catalogue.csv"
    assert convert(missing, "--base-path", tmp_path, "--output", tmp_path / "out") == 2
    assert f"{missing}: file not found" in capsys.readouterr().err   # one piece, to copy


def test_refuses_to_overwrite_the_input_catalogue(demo, tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    catalog = out / "metadata.csv"  # a catalogue that happens to sit where the output would go
    shutil.copy(demo / "catalog.csv", catalog)
    before = catalog.read_bytes()
    assert convert(catalog, "--base-path", demo, "--output", out) == 2
    assert "would overwrite the input catalogue" in " ".join(capsys.readouterr().err.split())
    assert catalog.read_bytes() == before and sorted(os.listdir(out)) == ["metadata.csv"]


def test_real_command_line(demo, tmp_path):
    out = tmp_path / "out"
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    result = subprocess.run(
        [sys.executable, "-m", "diffsynth_mbc.convert", str(demo / "catalog.csv"), "--base-path", str(demo),
         "--output", str(out), "--subset", "6", "--probe"],
        capture_output=True, text=True, env=env, cwd=tmp_path, timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout == ""
    assert "MBC catalogue conversion" in result.stderr and "videos have fewer than 17 frames" in result.stderr
    assert len(pd.read_csv(out / "metadata.csv")) == 6


def test_the_table_piped_to_a_file_is_never_cut(demo, tmp_path):
    """Not a terminal, rich drew the table at 80 columns and broke every long reason over several lines."""
    rows = [("media/video_000.mp4", "ok", "video"), ("media/image_002.png", "x", "video"),
            ("media/nope.mp4", "x", "video"), ("media/video_001.mp4", "x", "clip"),
            ("media/image_001.jpg", "", "image")]
    catalog = tmp_path / "catalog.csv"
    write_catalog(catalog, rows)
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("COLUMNS", None)
    log = tmp_path / "convert.log"
    with open(log, "w") as stderr:
        result = subprocess.run([sys.executable, "-m", "diffsynth_mbc.convert", str(catalog), "--base-path", str(demo),
                                 "--output", str(tmp_path / "out")], stdout=subprocess.DEVNULL, stderr=stderr, env=env,
                                cwd=tmp_path, timeout=120)
    text = log.read_text()
    assert result.returncode == 0, text
    header, = [line for line in text.splitlines() if "catalogue" in line and "input rows" in line]
    assert "written (train / val)" in header and "rejects by reason" in header, text
    body = [line for line in text.splitlines() if line.startswith("│")]
    for reason in ("empty caption: 1", "extension contradicts media_type: 1", "missing file: 1",
                   "unknown media_type: 1"):
        assert sum(reason in line for line in body) == 1, (reason, text)
    assert len(body) == 4 and "…" not in text        # one line per reason, the train row's first


# --- DiffSynth's own loader -----------------------------------------------------------------------


@pytest.fixture(scope="module")
def diffsynth_video_dataset():
    utils = pytest.importorskip("diffsynth.trainers.utils")
    return utils.VideoDataset


def test_extension_lists_match_diffsynth(diffsynth_video_dataset):
    defaults = inspect.signature(diffsynth_video_dataset.__init__).parameters
    assert set(defaults["image_file_extension"].default) == cat.IMAGE_EXTENSIONS
    assert set(defaults["video_file_extension"].default) == cat.VIDEO_EXTENSIONS


def test_diffsynth_video_dataset_loads_the_written_metadata(demo, tmp_path, diffsynth_video_dataset):
    out = tmp_path / "out"
    assert convert(demo / "catalog.csv", "--base-path", demo, "--output", out, "--probe") == 0
    dataset = diffsynth_video_dataset(
        base_path=str(demo), metadata_path=str(out / "metadata.csv"), num_frames=9, height=32, width=32,
        data_file_keys=("video",), repeat=1,
    )
    source = pd.read_csv(demo / "catalog.csv")
    assert len(dataset) == 12
    video_item, image_item = dataset[0], dataset[6]
    assert len(video_item["video"]) == 9 and len(image_item["video"]) == 1
    assert all(frame.size == (32, 32) and frame.mode == "RGB" for frame in video_item["video"] + image_item["video"])
    assert video_item["prompt"] == source["caption"][0] and image_item["prompt"] == source["caption"][6]
    # extra columns ride along untouched; the loader only opens the keys in data_file_keys
    assert video_item["media_type"] == "video" and video_item["num_frames"] == 9 and video_item["width"] == 64
    assert pd.isna(image_item["fps"])


def test_captions_with_nul_or_control_characters_are_rejected_with_a_reason(tmp_path):
    for name in ("a.mp4", "b.mp4", "c.mp4"):
        (tmp_path / name).write_bytes(b"x")
    catalog = write_catalog(tmp_path / "c.csv", [("a.mp4", "\x00", "video"), ("b.mp4", "fine\x00tail", "video"),
                                                 ("c.mp4", "two\nlines\tand a tab", "video")])
    out = tmp_path / "out"
    assert convert(catalog, "--base-path", tmp_path, "--output", out) == 0
    rejects = read_csv_records(out / "rejects.csv")
    assert [r["row"] for r in rejects] == ["1", "2"]
    assert all("caption contains control characters" in r["reason"] and "\\x00" in r["reason"] for r in rejects)
    assert list(pd.read_csv(out / "metadata.csv")["video"]) == ["c.mp4"]
    assert_every_row_accounted(out)


def test_an_empty_split_is_refused_and_nothing_is_written(tmp_path, capsys):
    for name in ("a.mp4", "b.mp4"):
        (tmp_path / name).write_bytes(b"x")
    catalog = write_catalog(tmp_path / "c.csv", [("a.mp4", "one", "video"), ("b.mp4", "two", "video")])
    out = tmp_path / "out"
    assert convert(catalog, "--base-path", tmp_path, "--output", out, "--val-fraction", "0.99") == 2
    assert "leaves 0 training and 2 validation rows" in capsys.readouterr().err
    assert not out.exists()


def test_an_output_that_cannot_be_written_is_exit_2_naming_it_and_publishes_nothing(demo, tmp_path, capsys):
    (tmp_path / "afile").write_text("not a folder")
    assert convert(demo / "catalog.csv", "--base-path", demo, "--output", tmp_path / "afile" / "sub") == 2
    assert str(tmp_path / "afile" / "sub") in capsys.readouterr().err.replace("\n", "")

    out = tmp_path / "out"
    assert convert(demo / "catalog.csv", "--base-path", demo, "--output", out, "--subset", "4") == 0
    before = {name: (out / name).read_bytes() for name in ("metadata.csv", "rejects.csv", "summary.json")}
    (out / "rejects.csv").unlink()
    (out / "rejects.csv").mkdir()                 # rejects.csv cannot be written in this run
    before.pop("rejects.csv")
    assert convert(demo / "catalog.csv", "--base-path", demo, "--output", out) == 2
    assert f"cannot write {out / 'rejects.csv'}" in capsys.readouterr().err.replace("\n", "")
    # metadata.csv once was already replaced by the new run while summary.json described the old one.
    assert {name: (out / name).read_bytes() for name in before} == before
    assert sorted(p.name for p in out.iterdir()) == ["metadata.csv", "not_in_subset.csv", "rejects.csv", "summary.json"]
