"""The tests' catalogue builder writes what the project meets: for the same rows its metadata.csv is the converter's,
byte for byte, and its media files have the sizes and frame counts the rows say, as ``convert --probe`` reads them."""

from __future__ import annotations

from catalog_helpers import (FOUR_THREE, SQUARE, WITH_SIZES, clip, image, read_csv_records, street_clips,
                             write_catalog, write_media_catalogue, write_metadata)
from diffsynth_mbc.data.convert import main as convert

ROWS = (*street_clips(0, seed=0), clip("media/long.mp4", 96, 64, frames=17, seed=1, caption='a "long" clip, slow'),
        image("media/square.png", *SQUARE, seed=2), image("media/four_three.jpg", *FOUR_THREE, seed=3, caption="사진"))


def test_the_metadata_is_the_converters_and_the_files_are_the_rows_sizes(tmp_path):
    metadata = write_media_catalogue(tmp_path, ROWS)
    catalogue = write_catalog(tmp_path / "catalogue.csv", [(row.file, row.caption, row.kind) for row in ROWS])
    converted, probed = tmp_path / "converted", tmp_path / "probed"
    base = ["--base_path", str(tmp_path / "catalog")]
    assert convert([str(catalogue), *base, "--output", str(converted)]) == 0
    assert metadata.read_bytes() == (converted / "metadata.csv").read_bytes()

    assert convert([str(catalogue), *base, "--output", str(probed), "--probe"]) == 0
    read = read_csv_records(probed / "metadata.csv")
    assert [(r["video"], int(r["width"]), int(r["height"]), int(r["num_frames"])) for r in read] == \
        [(row.file, row.width, row.height, row.frames) for row in ROWS]
    sized = read_csv_records(write_metadata(tmp_path / "sized.csv", ROWS, WITH_SIZES))
    assert sized == [{column: r[column] for column in WITH_SIZES} for r in read]
