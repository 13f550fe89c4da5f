"""The converter takes one file once, whatever path names it: a linked folder, '..', a hard link."""

from __future__ import annotations

import os
import subprocess
import sys

import pandas as pd

from catalog_helpers import read_csv_records, write_catalog
from diffsynth_mbc.data.demo_data import write_image


def run_convert(*args):
    return subprocess.run([sys.executable, "-m", "diffsynth_mbc.convert", *map(str, args)],
                          capture_output=True, text=True, timeout=300)


def test_a_file_named_through_a_linked_folder_is_written_once_and_the_second_row_rejected(tmp_path):
    base = tmp_path / "data"
    write_image(base / "clips" / "x.png", 32, 32)
    write_image(base / "clips" / "y.png", 32, 32, seed=1)
    os.symlink("clips", base / "alias")                      # alias/x.png is clips/x.png
    os.link(base / "clips" / "y.png", base / "y-again.png")  # a hard link: the same file too
    catalog = write_catalog(tmp_path / "catalog.csv", [
        ("clips/x.png", "a red square", "image"),
        ("alias/x.png", "another caption for the same file", "image"),
        ("clips/../alias/x.png", "and a third", "image"),
        ("clips/y.png", "a blue square", "image"),
        ("y-again.png", "the blue square again", "image"),
    ])
    before = catalog.read_bytes()
    out = tmp_path / "out"
    result = run_convert(catalog, "--base_path", base, "--output", out)
    assert result.returncode == 0, result.stderr
    written = pd.read_csv(out / "metadata.csv")
    assert list(written["video"]) == ["clips/x.png", "clips/y.png"]
    assert list(written["prompt"]) == ["a red square", "a blue square"]
    rejects = {int(r["row"]): r["reason"] for r in read_csv_records(out / "rejects.csv")}
    assert rejects == {
        2: "duplicate of an earlier row (row 1: alias/x.png is the same file as clips/x.png)",
        3: "duplicate of an earlier row (row 1: clips/../alias/x.png is the same file as clips/x.png)",
        5: "duplicate of an earlier row (row 4: y-again.png is the same file as clips/y.png)",
    }
    assert catalog.read_bytes() == before


def test_a_validation_file_named_another_way_in_the_training_catalogue_is_kept_out_of_it(tmp_path):
    base = tmp_path / "data"
    write_image(base / "clips" / "x.png", 32, 32)
    write_image(base / "clips" / "z.png", 32, 32, seed=2)
    os.symlink("clips", base / "alias")
    train = write_catalog(tmp_path / "train.csv", [("alias/x.png", "train", "image"), ("clips/z.png", "z", "image")])
    val = write_catalog(tmp_path / "val.csv", [("clips/x.png", "validation", "image")])
    out = tmp_path / "out"
    result = run_convert(train, "--base_path", base, "--output", out, "--val_catalog", val)
    assert result.returncode == 0, result.stderr
    assert list(pd.read_csv(out / "metadata.csv")["video"]) == ["clips/z.png"]
    assert list(pd.read_csv(out / "metadata_val.csv")["video"]) == ["clips/x.png"]
    assert [(r["catalog"], r["row"], r["reason"]) for r in read_csv_records(out / "rejects.csv")] == [
        ("train", "1", "duplicate of validation row (validation row 1: alias/x.png is the same file as clips/x.png)")]
