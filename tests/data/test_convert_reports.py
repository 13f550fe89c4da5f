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
