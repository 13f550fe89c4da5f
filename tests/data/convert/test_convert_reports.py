"""What the converter reports beyond the row accounting: rejects.csv safe to open in a spreadsheet,
captions that are empty in all but name, captions the text encoder will cut."""

from __future__ import annotations

import json

import pandas as pd

from catalog_helpers import read_csv_records, write_catalog
from diffsynth_mbc.data import convert as converter

FORMULAS = ['=HYPERLINK("http://example.com/x","click").mp4', "+cmd|' /C calc'!A0", "@SUM(1+1)*cmd|' /C calc'!A0.png",
            "-2+3+cmd|' /C calc'!A0.mp4", "\t=1+1.mp4"]


def convert(*args) -> int:
    return converter.main([str(a) for a in args])


def test_rejects_csv_neutralises_formulas_and_metadata_stays_raw(tmp_path):
    (tmp_path / "a.mp4").write_bytes(b"x")
    rows = [(path, "a caption", "video") for path in FORMULAS] + [("a.mp4", "=SUM(A1:A9) is a caption", "video"),
                                                                  ("b.mp4", "x", "=1+1")]
    catalog = write_catalog(tmp_path / "c.csv", rows)
    out = tmp_path / "out"
    assert convert(catalog, "--base-path", tmp_path, "--output", out) == 0
    rejects = read_csv_records(out / "rejects.csv")
    assert [r["file_path"] for r in rejects[:len(FORMULAS)]] == ["'" + path for path in FORMULAS]
    assert all(not cell.startswith(("=", "+", "-", "@", "\t", "\r")) for r in rejects for cell in r.values())
    assert "'=1+1'" in rejects[-1]["reason"]          # inside the text, not at its start: left as it is
    assert list(pd.read_csv(out / "metadata.csv")["prompt"]) == ["=SUM(A1:A9) is a caption"]


def test_spreadsheet_safe_leaves_ordinary_cells_alone():
    assert [converter.spreadsheet_safe(c) for c in ("media/a.mp4", 3, "missing file (x)", "", "안녕")] == \
        ["media/a.mp4", "3", "missing file (x)", "", "안녕"]
    assert converter.spreadsheet_safe("@x") == "'@x" and converter.spreadsheet_safe("\r=1") == "'\r=1"


def test_a_caption_of_only_invisible_characters_is_rejected_as_empty(tmp_path):
    for name in ("a.mp4", "b.mp4", "c.mp4", "d.mp4"):
        (tmp_path / name).write_bytes(b"x")
    catalog = write_catalog(tmp_path / "c.csv", [
        ("a.mp4", "\u200b\u200b", "video"), ("b.mp4", " \u200b \ufeff\u2060 ", "video"), ("c.mp4", "\u3164", "video"),
        ("d.mp4", "\u200b뉴스\u200b", "video")])
    out = tmp_path / "out"
    assert convert(catalog, "--base-path", tmp_path, "--output", out) == 0
    rejects = read_csv_records(out / "rejects.csv")
    assert [(r["row"], r["reason"]) for r in rejects] == [
        (row, "empty caption (only zero-width or other invisible characters)") for row in ("1", "2", "3")]
    assert list(pd.read_csv(out / "metadata.csv")["prompt"]) == ["\u200b뉴스\u200b"]


def long_caption_catalog(tmp_path, captions):
    for index in range(len(captions)):
        (tmp_path / f"{index}.mp4").write_bytes(b"x")
    return write_catalog(tmp_path / "c.csv", [(f"{i}.mp4", caption, "video") for i, caption in enumerate(captions)])


def test_captions_over_512_tokens_are_counted_and_named_by_a_stated_estimate(tmp_path, capsys):
    captions = ["뉴스 " * 300, "short caption", "x" * 510, "x" * 511, "  spaced   out  " * 20]
    out = tmp_path / "out"
    assert convert(long_caption_catalog(tmp_path, captions), "--base-path", tmp_path, "--output", out) == 0
    summary = json.loads((out / "summary.json").read_text())["captions"]
    assert summary["over_limit"] == 2 and summary["over_limit_rows"] == {"train": [1, 4]}
    assert summary["token_limit"] == 512 and summary["counted_by"].startswith("estimate")
    err = " ".join(capsys.readouterr().err.split())
    assert "2 captions may be longer than the text encoder's 512 tokens and will be cut there (train rows 1, 4;" in err
    assert len(pd.read_csv(out / "metadata.csv")) == 5                    # a warning: the rows are still written


def test_with_the_tokenizer_captions_are_counted_as_diffsynths_prompter_counts(tmp_path, capsys):
    from diffsynth_mbc.models.pipeline import _write_demo_tokenizer

    tokenizer = _write_demo_tokenizer(tmp_path / "umt5")       # word-level: one token per word, plus the end token
    captions = [" ".join(["news"] * 511), " ".join(["news"] * 512), "anchor\u00a0 in\n the   studio"]
    out = tmp_path / "out"
    assert convert(long_caption_catalog(tmp_path, captions), "--base-path", tmp_path, "--output", out,
                   "--tokenizer", tokenizer) == 0
    summary = json.loads((out / "summary.json").read_text())["captions"]
    assert summary["over_limit_rows"] == {"train": [2]} and summary["longest"] == 513
    assert summary["counted_by"].startswith(f"tokenizer in {tokenizer}")
    assert "1 captions are longer than the text encoder's 512 tokens" in " ".join(capsys.readouterr().err.split())

    assert convert(long_caption_catalog(tmp_path, captions), "--base-path", tmp_path, "--output", out,
                   "--tokenizer", tmp_path / "nowhere") == 2
    assert f"--tokenizer {tmp_path / 'nowhere'}: not a folder" in " ".join(capsys.readouterr().err.split())


# ---------------------------------------------------------------------------------------------
# What the summary says about rows left out, a wrong base path and what --probe found


def media_catalog(base, count, media_type="video"):
    base.mkdir(parents=True, exist_ok=True)
    suffix = ".mp4" if media_type == "video" else ".png"
    for index in range(count):
        (base / f"{index}{suffix}").write_bytes(b"x")
    return write_catalog(base / "c.csv", [(f"{i}{suffix}", f"caption {i}", media_type) for i in range(count)])


def test_rows_left_out_of_the_subset_are_listed_apart_from_the_rejects(tmp_path, capsys):
    catalog = media_catalog(tmp_path / "data", 10)
    with open(catalog, "a", encoding="utf-8") as handle:
        handle.write("gone.mp4,a real reject,video\n")
    out = tmp_path / "out"
    assert convert(catalog, "--base-path", tmp_path / "data", "--output", out, "--subset", 3) == 0
    rejects = read_csv_records(out / "rejects.csv")
    assert [(r["row"], r["reason"].split(" (")[0]) for r in rejects] == [("11", "missing file")]
    left_out = read_csv_records(out / "not_in_subset.csv")
    assert len(left_out) == 7 and {r["catalog"] for r in left_out} == {"train"}
    assert len(pd.read_csv(out / "metadata.csv")) == 3
    written_rows = {str(int(path.split(".")[0]) + 1) for path in pd.read_csv(out / "metadata.csv")["video"]}
    assert {r["row"] for r in left_out} | written_rows | {"11"} == {str(r) for r in range(1, 12)}
    summary = json.loads((out / "summary.json").read_text())
    assert summary["rejected_rows"] == {"train": 1} and summary["not_in_subset_rows"] == {"train": 7}
    assert summary["accounting"]["train"] == {"input": 11, "written": 3, "rejected": 1, "not_in_subset": 7}
    assert "not in subset" not in summary["rejects_by_reason"]["train"]
    err = " ".join(capsys.readouterr().err.split())
    assert "7 rows not taken by --subset 3 are listed in not_in_subset.csv" in err

    # a later run without --subset leaves no list of an earlier subset behind
    assert convert(catalog, "--base-path", tmp_path / "data", "--output", out) == 0
    assert not (out / "not_in_subset.csv").exists()


def test_a_wrong_base_path_is_named_with_where_a_row_was_looked_for(tmp_path, capsys):
    catalog = media_catalog(tmp_path / "data" / "clips", 4)
    wrong = tmp_path / "data"                       # the files are under data/clips
    out = tmp_path / "out"
    assert convert(catalog, "--base-path", wrong, "--output", out) == 1
    err = " ".join(capsys.readouterr().err.split())
    assert f"all 4 train rows' files are missing: is --base_path right? It resolves to {wrong};" in err
    assert f"row 1 (0.mp4) was looked for at {wrong / '0.mp4'}" in err
    assert json.loads((out / "summary.json").read_text())["base_path_hint"].startswith("all 4 train rows")

    # a few missing files among many found ones are ordinary rejects, with no hint
    (tmp_path / "data" / "clips" / "0.mp4").unlink()
    assert convert(catalog, "--base-path", tmp_path / "data" / "clips", "--output", out) == 0
    assert "--base_path right" not in capsys.readouterr().err
    assert json.loads((out / "summary.json").read_text())["base_path_hint"] is None


def test_probe_warnings_name_the_files_and_list_them_all(tmp_path, capsys):
    from diffsynth_mbc.data.demo_data import write_video

    base = tmp_path / "data"
    rows = []
    for index, frames in enumerate((21, 5, 6, 7, 8)):
        write_video(base / f"clip{index}.mp4", num_frames=frames, width=64, height=32, fps=10)
        rows.append((f"clip{index}.mp4", f"clip {index}", "video"))
    catalog = write_catalog(base / "c.csv", rows)
    out = tmp_path / "out"
    assert convert(catalog, "--base-path", base, "--output", out, "--probe", "--workers", 2,
                   "--height", 32, "--width", 64) == 0   # the clips' own shape: neither small nor cropped
    err = " ".join(capsys.readouterr().err.split())
    assert ("warning: 4 videos have fewer than 17 frames: clip1.mp4 (5 frames), clip2.mp4 (6 frames), "
            "clip3.mp4 (7 frames) and 1 more; all are listed in flagged.csv") in err
    flagged = read_csv_records(out / "flagged.csv")
    assert [(r["row"], r["file_path"], r["reason"], r["detail"]) for r in flagged] == [
        (str(i + 1), f"clip{i}.mp4", "short video", f"{frames} frames, fewer than --min_frames 17")
        for i, frames in ((1, 5), (2, 6), (3, 7), (4, 8))]
    assert len(pd.read_csv(out / "metadata.csv")) == 5                 # flagged, not rejected

    assert convert(catalog, "--base-path", base, "--output", out) == 0
    assert not (out / "flagged.csv").exists()


def test_without_probe_the_summary_says_what_probe_would_have_checked(tmp_path, capsys):
    catalog = media_catalog(tmp_path / "data", 2)
    out = tmp_path / "out"
    assert convert(catalog, "--base-path", tmp_path / "data", "--output", out) == 0
    err = " ".join(capsys.readouterr().err.split())
    assert "media files were not opened: --probe would decode each one" in err
    assert "truncated" in err and "fewer than 17 frames" in err
    note = json.loads((out / "summary.json").read_text())["not_probed"]
    assert note.startswith("media files were not opened")
    assert convert(catalog, "--base-path", tmp_path / "data", "--output", out, "--probe") == 1  # not real videos
    assert json.loads((out / "summary.json").read_text())["not_probed"] is None


def test_file_names_with_terminal_escapes_are_shown_not_obeyed(tmp_path, capsys):
    """A catalogue's names reach the terminal in messages: ESC[2J would clear it and an OSC sequence retitle it.
    Every name is printed without its control characters, as the monitor prints files (item 23 of round 4)."""
    clear, title = "\x1b[2J", "\x1b]0;owned\x07"
    rows = [(f"{clear}gone{i}.mp4", "a caption", "video") for i in range(4)] + [(f"{title}x.png", "c", "image")]
    catalog = write_catalog(tmp_path / "c.csv", rows)
    assert convert(catalog, "--base-path", tmp_path, "--output", tmp_path / "out") == 1   # every file missing
    err = capsys.readouterr().err
    assert "gone0.mp4" in err and "[2Jgone0.mp4" in err   # the name is there, its ESC is not
    assert "\x1b" not in err and "\x07" not in err
    assert read_csv_records(tmp_path / "out" / "rejects.csv")[0]["file_path"] == f"{clear}gone0.mp4"   # the file: raw


def test_an_image_over_pils_pixel_limit_is_said_once_in_our_words_not_as_pils_warning(tmp_path, capsys):
    """A 10000x10000 PNG printed PIL's DecompressionBombWarning at each stage that opened it."""
    import warnings

    from PIL import Image

    Image.new("RGB", (10_000, 10_000), (10, 20, 30)).save(tmp_path / "big.png")
    Image.new("RGB", (64, 48), (10, 20, 30)).save(tmp_path / "small.png")
    catalog = write_catalog(tmp_path / "c.csv", [("big.png", "a big one", "image"), ("small.png", "small", "image")])
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        assert convert(catalog, "--base-path", tmp_path, "--output", tmp_path / "out", "--probe", "--workers", "1") == 0
    assert not [w for w in seen if issubclass(w.category, Image.DecompressionBombWarning)]
    err = " ".join(capsys.readouterr().err.split())
    assert err.count("more than 89,478,485 pixels") == 1 and "big.png (10000x10000)" in err
    probe = json.loads((tmp_path / "out" / "summary.json").read_text())["probe"]
    assert (probe["over_pil_pixel_limit_count"], probe["over_pil_pixel_limit"]) == (1, ["big.png (10000x10000)"])


def test_a_clip_turned_45_degrees_by_its_display_matrix_is_rejected_naming_the_rotation(tmp_path):
    """It passed triage, then every draw of it in training fell back to DiffSynth's reader (~10 s each)."""
    import subprocess

    import imageio_ffmpeg

    from diffsynth_mbc.data.demo_data import write_video

    write_video(tmp_path / "upright.mp4", 9, 64, 48)
    subprocess.run([imageio_ffmpeg.get_ffmpeg_exe(), "-y", "-loglevel", "error", "-display_rotation", "45", "-i",
                    str(tmp_path / "upright.mp4"), "-c", "copy", str(tmp_path / "tilted.mp4")], check=True)
    catalog = write_catalog(tmp_path / "c.csv", [("upright.mp4", "a clip", "video"), ("tilted.mp4", "tilted", "video")])
    assert convert(catalog, "--base-path", tmp_path, "--output", tmp_path / "out", "--probe", "--min_frames", "5") == 0
    reject, = read_csv_records(tmp_path / "out" / "rejects.csv")
    assert reject["file_path"] == "tilted.mp4" and "turns the picture 45 degrees" in reject["reason"], reject
    assert [row["video"] for row in read_csv_records(tmp_path / "out" / "metadata.csv")] == ["upright.mp4"]
