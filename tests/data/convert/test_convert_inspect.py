"""convert --probe --inspect on real media: each defect flagged with its reason and nothing on the clean rows,
--exclude moving exactly those rows to rejects.csv, a second run reusing what it measured, flagged.html.

The catalogue (``tests/inspect_media.py``): a clean clip, a hard cut at frame 8, a black clip, a frozen clip, a
letterboxed clip, a re-encoded copy of the clean clip, a recompressed copy of an image, and the look-alikes that
must not be flagged (a fade, a pan, a night scene, a talking head, two pictures). The training size is 160x96 so
that the 192x108 clips are neither small nor much cropped (no --probe flag mixes in).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pandas as pd
import pytest

from catalog_helpers import read_csv_records, write_catalog
from diffsynth_mbc.data.convert import main
from diffsynth_mbc.data.inspect.duplicates import DUPLICATE_BITS
from diffsynth_mbc.data.inspect.measures import CUT_MIN_RATIO
from inspect_media import make_media

ROWS = ("clean", "cut", "black", "frozen", "letterbox", "clean_copy", "picture", "picture_copy", "fade", "pan",
        "night", "talking", "other_picture")
FLAGGED = {"cut": "scene_cut", "black": "black", "frozen": "frozen", "letterbox": "letterbox",
           "clean_copy": "duplicate", "picture_copy": "duplicate"}


@pytest.fixture(scope="module")
def catalogue(tmp_path_factory) -> Path:
    base = tmp_path_factory.mktemp("inspect")
    media = make_media(base / "media")
    rows = [(os.path.relpath(media[name][0], base), f"the {name} row", media[name][1]) for name in ROWS]
    write_catalog(base / "catalogue.csv", rows)
    return base


def convert(base: Path, out: Path, *extra) -> int:
    return main([str(base / "catalogue.csv"), "--base_path", str(base), "--output", str(out), "--probe",
                 "--inspect", "--height", "96", "--width", "160", *map(str, extra)])


def name_of(file_path: str) -> str:
    return Path(file_path).stem


@pytest.fixture(scope="module")
def inspected(catalogue, tmp_path_factory):
    """One run with two worker processes; its output folder."""
    out = tmp_path_factory.mktemp("inspected") / "out"
    assert convert(catalogue, out, "--workers", 2) == 0
    return out


def test_each_defect_is_flagged_with_its_reason_and_nothing_on_the_clean_rows(inspected):
    flagged = read_csv_records(inspected / "flagged.csv")
    assert {name_of(r["file_path"]): r["reason"] for r in flagged} == FLAGGED
    assert len(flagged) == len(FLAGGED)                           # one finding each, no probe flag mixed in
    by_name = {name_of(r["file_path"]): r for r in flagged}
    path_of = {name_of(r["video"]): r["video"] for _, r in pd.read_csv(inspected / "metadata.csv").iterrows()}
    assert by_name["cut"]["detail"].startswith("hard cut at source frame 8 (0:00.33), window frame 8 of 17: ")
    assert float(by_name["cut"]["value"]) > float(by_name["cut"]["threshold"]) == CUT_MIN_RATIO
    for copy, original in (("clean_copy", "clean"), ("picture_copy", "picture")):
        row = ROWS.index(original) + 1
        assert by_name[copy]["duplicate_of"] == f"row {row}: {path_of[original]}"
        assert float(by_name[copy]["value"]) <= float(by_name[copy]["threshold"]) == DUPLICATE_BITS
    assert all(r["excluded"] == "" for r in flagged)
    metadata = pd.read_csv(inspected / "metadata.csv")
    assert [name_of(v) for v in metadata["video"]] == list(ROWS)    # flagged, still written
    summary = json.loads((inspected / "summary.json").read_text())["inspect"]
    assert summary["flagged_rows"] == {"scene_cut": 1, "black": 1, "frozen": 1, "letterbox": 1, "pillarbox": 0,
                                       "duplicate": 2}
    assert (summary["rows"], summary["measured"], summary["reused"], summary["workers"]) == (len(ROWS), len(ROWS), 0, 2)
    assert summary["window"]["num_frames"] == 17 and summary["thresholds"]["duplicate"]["hash_bits_at_most"] == 8


def test_the_contact_sheet_groups_the_flagged_rows_with_their_frames(inspected):
    page = (inspected / "flagged.html").read_text()
    for name, reason in FLAGGED.items():
        assert f"media/{name}." in page and f'data-reason="{reason}"' in page
    assert page.count("data:image/jpeg;base64,") >= 5 * 8 + 1       # 8 frames per clip, 1 for the image
    assert "http://" not in page and "https://" not in page


def test_exclude_all_moves_exactly_the_flagged_rows_to_rejects(catalogue, inspected, tmp_path, capsys):
    out = tmp_path / "out"
    assert convert(catalogue, out, "--workers", 1, "--exclude", "all") == 0
    rejects = read_csv_records(out / "rejects.csv")
    assert {name_of(r["file_path"]): r["reason"].split(" ")[0] for r in rejects} == FLAGGED
    assert [name_of(v) for v in pd.read_csv(out / "metadata.csv")["video"]] == [n for n in ROWS if n not in FLAGGED]
    assert all(r["excluded"] == "yes" for r in read_csv_records(out / "flagged.csv"))
    summary = json.loads((out / "summary.json").read_text())
    assert summary["accounting"]["train"] == {"input": len(ROWS), "written": len(ROWS) - len(FLAGGED),
                                              "rejected": len(FLAGGED)}
    assert summary["rejects_by_reason"]["train"] == {"black": 1, "duplicate": 2, "frozen": 1, "letterbox": 1,
                                                     "scene_cut": 1}
    err = " ".join(capsys.readouterr().err.split())
    assert "moved to rejects.csv by --exclude: scene_cut 1, black 1, frozen 1, letterbox 1, duplicate 2" in err

    assert convert(catalogue, out, "--exclude", "black,duplicate") == 0
    assert {name_of(r["file_path"]) for r in read_csv_records(out / "rejects.csv")} == {
        "black", "clean_copy", "picture_copy"}


def test_a_second_run_reuses_what_it_measured_and_remeasures_a_changed_file(catalogue, tmp_path, capsys):
    out = tmp_path / "out"
    assert convert(catalogue, out) == 0
    assert json.loads((out / "summary.json").read_text())["inspect"]["measured"] == len(ROWS)
    first = (out / "flagged.csv").read_bytes()
    assert convert(catalogue, out) == 0
    summary = json.loads((out / "summary.json").read_text())["inspect"]
    assert (summary["measured"], summary["reused"]) == (0, len(ROWS))
    assert (out / "flagged.csv").read_bytes() == first
    touched = next((catalogue / "media").glob("pan.*"))
    stat = touched.stat()
    os.utime(touched, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    try:
        assert convert(catalogue, out) == 0
    finally:
        os.utime(touched, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    summary = json.loads((out / "summary.json").read_text())["inspect"]
    assert (summary["measured"], summary["reused"]) == (1, len(ROWS) - 1)

    # a stored line without a measure, another with NaN: those two rows are measured again, said once (they used to
    # fail every later run with KeyError or ValueError until the file was deleted)
    assert convert(catalogue, out) == 0   # the pan row back at its own time: measured again, once
    store = out / "inspect_measures.jsonl"
    lines = [json.loads(line) for line in store.read_text().splitlines()]
    del lines[0]["measures"]["motion"]
    lines[1]["measures"]["cut_score"] = float("nan")
    store.write_text("".join(json.dumps(line) + "\n" for line in lines))
    capsys.readouterr()
    assert convert(catalogue, out) == 0
    summary = json.loads((out / "summary.json").read_text())["inspect"]
    assert (summary["measured"], summary["reused"], summary["store_lines_measured_again"]) == (2, len(ROWS) - 2, 2)
    err = " ".join(capsys.readouterr().err.split())
    assert err.count("2 stored line(s) of ") == 1 and "lacked a measure or held a non-number" in err
    assert convert(catalogue, out) == 0   # and the store is whole again
    assert json.loads((out / "summary.json").read_text())["inspect"]["reused"] == len(ROWS)


@pytest.mark.parametrize("flags, message", [
    (["--inspect"], "--inspect need --probe"),
    (["--probe", "--exclude", "black"], "--exclude and --frame_sampling need --inspect"),
    (["--probe", "--inspect", "--exclude", "black,blurry"], "--exclude black,blurry: blurry is not one of scene_cut"),
])
def test_inspect_usage_errors_name_the_flag(catalogue, tmp_path, capsys, flags, message):
    arguments = [str(catalogue / "catalogue.csv"), "--base_path", str(catalogue), "--output", str(tmp_path / "o")]
    assert main(arguments + flags) == 2
    assert message in " ".join(capsys.readouterr().err.split())
    assert not (tmp_path / "o").exists()


def test_a_strip_spreads_over_the_window_and_shows_both_sides_of_a_cut():
    from diffsynth_mbc.data.convert.flagged_sheet import strip_indices

    assert strip_indices(17) == [0, 2, 5, 7, 9, 11, 14, 16]
    assert strip_indices(17, cut_frame=8) == [0, 3, 6, 7, 8, 10, 13, 16]
    assert strip_indices(17, cut_frame=1) == [0, 1, 3, 6, 10, 13, 16]   # frame 0 is both
    assert strip_indices(5) == [0, 1, 2, 3, 4] and strip_indices(1) == [0]
    assert strip_indices(17, most=4) == [0, 5, 11, 16]


def test_a_validation_row_repeating_a_training_row_is_named_with_its_catalogue(catalogue, tmp_path):
    media = {Path(p).stem: p for p in (catalogue / "media").iterdir()}
    val = catalogue / "validation.csv"
    write_catalog(val, [(os.path.relpath(media["clean_copy"], catalogue), "held out", "video"),
                        (os.path.relpath(media["talking"], catalogue), "held out too", "video")])
    train = catalogue / "train_only.csv"
    write_catalog(train, [(os.path.relpath(media[name], catalogue), name, "video") for name in ("clean", "pan")])
    out = tmp_path / "out"
    assert main([str(train), "--val_catalog", str(val), "--base_path", str(catalogue), "--output", str(out),
                 "--probe", "--inspect", "--height", "96", "--width", "160"]) == 0
    (flag,) = read_csv_records(out / "flagged.csv")
    assert (flag["catalog"], flag["row"], flag["reason"]) == ("val", "1", "duplicate")
    assert flag["duplicate_of"] == f"row 1 of the train catalogue: {os.path.relpath(media['clean'], catalogue)}"


def test_on_a_terminal_a_bar_counts_the_rows_with_the_time_left(catalogue, tmp_path):
    import io

    from rich.console import Console

    from diffsynth_mbc.data.convert.inspect_rows import _run
    from diffsynth_mbc.data.inspect.measure_store import MeasureStore
    from diffsynth_mbc.data.inspect.run_inspection import MEASURES_VERSION, InspectItem
    from diffsynth_mbc.data.inspect.window import InspectWindow

    screen = io.StringIO()
    console = Console(file=screen, force_terminal=True, width=120)
    items = [InspectItem(str(path), "video", 20, 24.0) for path in sorted((catalogue / "media").glob("*.mp4"))[:3]]
    with MeasureStore(tmp_path / "store.jsonl", MEASURES_VERSION) as store:
        results = _run(items, InspectWindow(), 1, store, console)
    assert [r.measures is not None for r in results] == [True] * 3
    drawn = screen.getvalue()
    assert "inspecting windows" in drawn and "3/3" in drawn and "left:" in drawn


def test_the_window_is_the_trainings_num_frames_under_either_name(catalogue, tmp_path):
    out = tmp_path / "out"
    assert convert(catalogue, out, "--num_frames", 9, "--frame_sampling", "uniform") == 0
    window = json.loads((out / "summary.json").read_text())["inspect"]["window"]
    assert (window["num_frames"], window["sampling"]) == (9, "uniform")
    assert {name_of(r["file_path"]): r["reason"] for r in read_csv_records(out / "flagged.csv")} == FLAGGED


def test_exclude_reads_all_and_repeated_reasons_once_and_names_each_unknown_one_once():
    from diffsynth_mbc.data.inspect.reasons import REASONS, parse_exclude

    assert parse_exclude("all,all") == REASONS and parse_exclude("black,all") == REASONS
    assert parse_exclude("black,black,frozen") == ("black", "frozen")
    with pytest.raises(ValueError, match=r"^--exclude blurry,blurry,fuzzy: blurry, fuzzy are not one of scene_cut"):
        parse_exclude("blurry,blurry,fuzzy")
    with pytest.raises(ValueError, match=r"^--exclude ,: no reason is not one of"):
        parse_exclude(",")


def spoil_idat(png: bytes) -> bytes:
    """The PNG with its compressed pixels overwritten and the chunk's CRC made right again: PIL's verify() (the
    probe's check) passes, decoding fails."""
    import struct
    import zlib

    start = png.index(b"IDAT") - 4
    length = struct.unpack(">I", png[start:start + 4])[0]
    body = b"IDAT" + bytes([0xFF]) * length
    return png[:start + 4] + body + struct.pack(">I", zlib.crc32(body)) + png[start + 12 + length:]


def test_a_row_inspect_cannot_decode_leaves_flagged_csv_and_the_small_media_count(tmp_path):
    """Its header reads (so --probe flagged it small), its pixels do not: rejected as unreadable, it is not a file
    written, so nothing of it stays in flagged.csv or in summary.json's flagged_small_media."""
    from PIL import Image

    base = tmp_path / "media"
    base.mkdir()
    Image.new("RGB", (64, 48), (90, 120, 30)).save(base / "good.png")
    Image.effect_noise((64, 48), 40).convert("RGB").save(base / "broken.png")
    (base / "broken.png").write_bytes(spoil_idat((base / "broken.png").read_bytes()))
    write_catalog(base / "catalogue.csv", [("good.png", "a good one", "image"), ("broken.png", "torn", "image")])
    out = tmp_path / "out"
    assert main([str(base / "catalogue.csv"), "--base_path", str(base), "--output", str(out), "--probe", "--inspect",
                 "--height", "96", "--width", "160"]) == 0
    rejects = read_csv_records(out / "rejects.csv")
    assert [(r["file_path"], r["reason"].split(" (")[0]) for r in rejects] == [("broken.png", "unreadable media")]
    assert {r["file_path"] for r in read_csv_records(out / "flagged.csv")} == {"good.png"}
    summary = json.loads((out / "summary.json").read_text())
    assert summary["probe"]["flagged_small_media"] == 1
