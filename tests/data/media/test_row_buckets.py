"""Each metadata row's bucket: from its file's size as displayed, read once per run into the run's size table;
the width/height columns are checked against it; missing files fall back to the columns, else the configured shape."""

import json
import os

import pytest

from diffsynth_mbc.data.demo_data import write_image, write_video
from diffsynth_mbc.data.media.row_buckets import bucket_keys, row_sizes
from diffsynth_mbc.data.media.size_table import fingerprint_key, load_table
from diffsynth_mbc.run_layout import SIZE_TABLE
from diffsynth_mbc.errors import MetadataError


def test_sizes_come_from_the_files_and_missing_files_from_their_columns(tmp_path, capsys):
    write_video(tmp_path / "portrait.mp4", 5, 72, 128)
    write_image(tmp_path / "square.png", 64, 64)
    rows = [{"video": "landscape.mp4", "media_type": "video", "width": "1280", "height": "720"},   # missing file
            {"video": "portrait.mp4", "media_type": "video"},
            {"video": "square.png", "media_type": "image", "width": "nan", "height": ""},
            {"video": "missing.mp4", "media_type": "video"}]
    assert row_sizes(rows, str(tmp_path)) == [(1280, 720), (72, 128), (64, 64), None]
    assert bucket_keys(rows, str(tmp_path), 64, 128) == ["video@128x64", "video@64x128", "image@96x96",
                                                         "video@128x64"]   # missing: the configured shape
    assert capsys.readouterr().err == ""   # two headers read: no progress, no note


def test_the_size_table_is_read_once_per_run_and_a_changed_file_is_read_again(tmp_path):
    media, out = tmp_path / "media", tmp_path / "out"
    media.mkdir()
    write_video(media / "clip.mp4", 5, 96, 64)
    write_image(media / "photo.png", 40, 30)
    rows = [{"video": "clip.mp4", "media_type": "video"}, {"video": "photo.png", "media_type": "image"}]
    table_path = str(out / SIZE_TABLE)
    assert row_sizes(rows, str(media), table_path=table_path) == [(96, 64), (40, 30)]
    assert not (out / SIZE_TABLE).exists()   # no output folder yet (a dry run, a plan before the first launch)
    out.mkdir()
    assert row_sizes(rows, str(media), table_path=table_path) == [(96, 64), (40, 30)]
    table = load_table(table_path)
    assert table == {fingerprint_key(str(media / "clip.mp4")): (96, 64),
                     fingerprint_key(str(media / "photo.png")): (40, 30)}
    # A file that changes has another fingerprint: it is read again, and its old entry leaves the table.
    write_image(media / "photo.png", 50, 20)
    os.utime(media / "photo.png", ns=(1, 2))
    assert row_sizes(rows, str(media), table_path=table_path) == [(96, 64), (50, 20)]
    assert sorted(load_table(table_path).values()) == [(50, 20), (96, 64)]


def test_a_damaged_size_table_is_said_once_and_read_again_from_the_files(tmp_path, capsys):
    write_image(tmp_path / "photo.png", 40, 30)
    (tmp_path / SIZE_TABLE).write_text('{"version": 2, "sha256": "00", "sizes": {"1:2:3:/x": [40, ')
    rows = [{"video": "photo.png", "media_type": "image"}]
    assert row_sizes(rows, str(tmp_path), table_path=str(tmp_path / SIZE_TABLE)) == [(40, 30)]
    assert capsys.readouterr().err.count("cannot be used") == 1
    assert list(load_table(str(tmp_path / SIZE_TABLE)).values()) == [(40, 30)]


def test_columns_that_are_not_the_files_size_are_refused_naming_the_rows(tmp_path):
    """A 320x180 file listed as 180x320 trained portrait; the columns were trusted without a look at the file."""
    write_video(tmp_path / "wide.mp4", 5, 320, 180)
    rows = [{"video": "wide.mp4", "media_type": "video", "width": "180", "height": "320"}]
    with pytest.raises(MetadataError, match=r"^metadata row 1 \(wide\.mp4\): the columns say 180x320, the file is "
                                            r"320x180 .*convert --probe"):
        row_sizes(rows, str(tmp_path))
    rows[0].update(width="320", height="180")
    assert row_sizes(rows, str(tmp_path)) == [(320, 180)]


def test_a_size_cell_that_is_no_size_is_refused_naming_the_row_and_the_column(tmp_path):
    """``inf`` and ``1e400`` raised OverflowError; ``-5`` and ``abc`` read as "no width/height columns"."""
    for width in ("inf", "1e400", "-5", "abc", "12.5", "0"):
        rows = [{"video": "a.mp4", "media_type": "video", "width": "640", "height": "360"},
                {"video": "b.mp4", "media_type": "video", "width": width, "height": "360"}]
        with pytest.raises(MetadataError, match=rf"^metadata row 2 \(b\.mp4\): width '{width}' is not a size in "
                                                r"pixels \(a whole number from 1 to 65536\)"):
            row_sizes(rows, str(tmp_path))
