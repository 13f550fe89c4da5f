"""Each metadata row's bucket: from its width/height columns, else its file's header; missing files fall back."""

from diffsynth_mbc.data.demo_data import write_image, write_video
from diffsynth_mbc.data.media.row_buckets import bucket_keys, row_sizes


def test_sizes_come_from_the_columns_else_the_files_and_the_fallback_is_said_once(tmp_path, capsys):
    write_video(tmp_path / "portrait.mp4", 5, 72, 128)
    write_image(tmp_path / "square.png", 64, 64)
    rows = [{"video": "landscape.mp4", "media_type": "video", "width": "1280", "height": "720"},   # columns win
            {"video": "portrait.mp4", "media_type": "video"},
            {"video": "square.png", "media_type": "image", "width": "nan", "height": ""},
            {"video": "missing.mp4", "media_type": "video"}]
    assert row_sizes(rows, str(tmp_path)) == [(1280, 720), (72, 128), (64, 64), None]
    assert bucket_keys(rows, str(tmp_path), 64, 128) == ["video@128x64", "video@64x128", "image@96x96",
                                                         "video@128x64"]   # missing: the configured shape
    said = capsys.readouterr().err
    assert said.count("3 of 4 metadata rows have no width/height columns") == 1


def test_a_size_cell_that_is_no_size_is_refused_naming_the_row_and_the_column(tmp_path):
    """``inf`` and ``1e400`` raised OverflowError; ``-5`` and ``abc`` read as "no width/height columns"."""
    import pytest

    from diffsynth_mbc.errors import MetadataError

    for width in ("inf", "1e400", "-5", "abc", "12.5", "0"):
        rows = [{"video": "a.mp4", "media_type": "video", "width": "640", "height": "360"},
                {"video": "b.mp4", "media_type": "video", "width": width, "height": "360"}]
        with pytest.raises(MetadataError, match=rf"^metadata row 2 \(b\.mp4\): width '{width}' is not a size in "
                                                r"pixels \(a whole number from 1 to 65536\)"):
            row_sizes(rows, str(tmp_path))
