"""A metadata CSV that DiffSynth's pandas would stop on (a quote never closed, a row with more cells than the header)
is refused by every reader with one line naming the file and the line, never a pandas traceback."""

from __future__ import annotations

import io
import re
import subprocess
import sys

import pandas as pd
import pytest

from diffsynth_mbc.data.cache.dataset import open_training_dataset
from diffsynth_mbc.data.dataset_list import parse_datasets, write_combined
from diffsynth_mbc.data.metadata_csv import read_metadata
from diffsynth_mbc.errors import MetadataError
from diffsynth_mbc.training.options import resolve_options

UNCLOSED = ('video,prompt,media_type\n'
            'a.png,a red square,image\n'
            'b.png,"a caption whose quote is never closed,image\n'
            'c.png,a blue square,image\n')
MESSAGE = ": line 3: a quote (\") opens a value that is never closed"


def metadata(tmp_path, text=UNCLOSED):
    (tmp_path / "media").mkdir(exist_ok=True)
    path = tmp_path / "metadata.csv"
    path.write_text(text, encoding="utf-8")
    return path


def run(module, *args):
    return subprocess.run([sys.executable, "-m", f"diffsynth_mbc.{module}", *map(str, args)], capture_output=True,
                          text=True, timeout=300)


def test_the_cache_names_the_file_and_line_with_exit_2(tmp_path):
    path = metadata(tmp_path)
    result = run("cache", "--demo", "--dataset_base_path", tmp_path / "media", "--dataset_metadata_path", path,
                 "--height", 64, "--width", 64, "--num_frames", 5, "--cache_dir", tmp_path / "cache")
    assert result.returncode == 2, result.stderr[-3000:]
    assert "Traceback" not in result.stderr and "ParserError" not in result.stderr
    assert f"error: --dataset_metadata_path {path}{MESSAGE}" in result.stderr
    assert path.read_text(encoding="utf-8") == UNCLOSED and not (tmp_path / "cache").exists()


def test_the_plan_names_it_instead_of_counting_one_row_too_few(tmp_path):
    path = metadata(tmp_path)
    result = run("plan", "--gpus", 1, "--dataset_base_path", tmp_path / "media", "--dataset_metadata_path", path,
                 "--output_path", tmp_path / "out")
    assert result.returncode == 2 and f"error: {path}{MESSAGE}" in result.stderr, result.stderr[-3000:]


def test_the_training_dataset_names_it(tmp_path):
    path = metadata(tmp_path)
    options = resolve_options(["--demo", "--dataset_base_path", str(tmp_path / "media"), "--dataset_metadata_path",
                               str(path), "--height", "64", "--width", "64", "--num_frames", "5"])
    with pytest.raises(MetadataError, match="^" + re.escape(f"--dataset_metadata_path {path}{MESSAGE}")):
        open_training_dataset(options)


def test_a_catalogue_of_datasets_names_it(tmp_path):
    path = metadata(tmp_path)
    catalogues = parse_datasets([{"base_path": str(tmp_path / "media"), "metadata_path": str(path), "name": "news"}])
    with pytest.raises(MetadataError, match="^" + re.escape(f"datasets[0] (news): metadata_path {path}{MESSAGE}")):
        write_combined(catalogues, tmp_path / "out")


def test_a_row_with_more_cells_than_the_header_is_named(tmp_path):
    path = metadata(tmp_path, "video,prompt,media_type\na.png,a cat,image\nb.png,a dog, sitting,image\n")
    with pytest.raises(MetadataError, match=r"metadata\.csv: line 3: 4 cells, the header has 3 \(video, prompt, "
                                            r"media_type\); a caption with a comma must be quoted"):
        read_metadata(path)


def test_what_pandas_reads_is_read_the_same(tmp_path):
    text = ('\ufeffvideo,prompt,media_type\n'
            'a.png,"two\nlines, a comma and ""quotes""",image\n'
            '\n'
            'b.mp4,"quoted"then bare,video\n'
            'c.png,short row\n')
    path = metadata(tmp_path, text)
    expected = pd.read_csv(io.StringIO(text.lstrip("\ufeff"))).astype(object).where(lambda frame: frame.notna(), None)
    assert read_metadata(path) == expected.to_dict("records")
