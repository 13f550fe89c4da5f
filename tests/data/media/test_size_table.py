"""The size table is not trusted as written: a table edited since it was written (a swapped orientation) or an entry
that is no size is read again from the files, and a file swapped for another of the same byte size and mtime
(``cp -p``, ``touch -r``) has another fingerprint (its inode change time). A table written before the change time
was in the fingerprint is read, its entries read again from the files."""

import hashlib
import json
import os
import shutil

import numpy as np
import pytest
from PIL import Image

from diffsynth_mbc.data.demo_data import write_image
from diffsynth_mbc.data.media.row_buckets import row_sizes
from diffsynth_mbc.data.media.size_table import fingerprint_key, load_table, save_table
from diffsynth_mbc.run_layout import SIZE_TABLE


def bitmap(path, width, height, seed=0):
    """An uncompressed BMP: 32x24 and 24x32 have the same byte size (rows padded to 4 bytes: 96 x 24 = 72 x 32)."""
    pixels = np.random.default_rng(seed).integers(0, 255, (height, width, 3), dtype=np.uint8)
    Image.fromarray(pixels).save(path)


@pytest.fixture
def sized(tmp_path):
    """Two photos sized once into the run's table: (rows, media folder, table path)."""
    media, out = tmp_path / "media", tmp_path / "out"
    media.mkdir()
    out.mkdir()
    write_image(media / "wide.png", 80, 40, seed=1)
    write_image(media / "tall.png", 40, 80, seed=2)
    rows = [{"video": "wide.png", "media_type": "image"}, {"video": "tall.png", "media_type": "image"}]
    table = str(out / SIZE_TABLE)
    assert row_sizes(rows, str(media), table_path=table) == [(80, 40), (40, 80)]
    return rows, media, table


def rewrite_entries(table: str, entries: dict, checksum: bool) -> None:
    """Entries of the table set by hand; ``checksum``: its checksum made again over them, as a writer would."""
    with open(table, encoding="utf-8") as handle:
        saved = json.load(handle)
    saved["sizes"].update(entries)
    sizes = json.dumps(saved["sizes"], separators=(",", ":"))
    if checksum:
        saved["sha256"] = hashlib.sha256(sizes.encode()).hexdigest()
    with open(table, "w", encoding="utf-8") as handle:
        handle.write(f'{{"version": 2, "sha256": "{saved["sha256"]}", "sizes":{sizes}}}')


def test_a_table_edited_since_it_was_written_is_read_again(sized, capsys):
    """A swapped orientation in the table put a landscape photo in a portrait bucket, with exit 0."""
    rows, media, table = sized
    rewrite_entries(table, {fingerprint_key(str(media / "wide.png")): [40, 80]}, checksum=False)
    assert row_sizes(rows, str(media), table_path=table) == [(80, 40), (40, 80)]
    said = capsys.readouterr().err
    assert f"the size table {table} was changed since it was written" in said and said.count("note:") == 1
    assert sorted(load_table(table).values()) == [(40, 80), (80, 40)]   # written again, whole


@pytest.mark.parametrize("entry", [[10**30, 1], [True, True], [0, 5], [40.0, 80.0], [70000, 10], "80x40", [80]])
def test_an_entry_that_is_no_size_is_read_again_from_its_file(sized, capsys, entry):
    """``[10**30, 1]`` and ``[true, true]`` were taken as sizes (a bool is an int) and moved the row to another
    bucket; one entry that was no size made the whole table unusable."""
    rows, media, table = sized
    rewrite_entries(table, {fingerprint_key(str(media / "wide.png")): entry}, checksum=True)
    assert row_sizes(rows, str(media), table_path=table) == [(80, 40), (40, 80)]
    said = capsys.readouterr().err
    assert f"1 entry of the size table {table} is no size" in said and "cannot be used" not in said
    assert load_table(table) == {fingerprint_key(str(media / "wide.png")): (80, 40),
                                 fingerprint_key(str(media / "tall.png")): (40, 80)}


def test_a_file_swapped_for_one_of_the_same_size_and_mtime_is_read_again(tmp_path):
    """``touch -r`` then ``cp -p`` (``shutil.copy2``) give the new file the old one's byte size and mtime: only
    the inode change time tells the two apart."""
    media, out = tmp_path / "media", tmp_path / "out"
    media.mkdir()
    out.mkdir()
    bitmap(media / "photo.bmp", 32, 24, seed=1)
    bitmap(tmp_path / "portrait.bmp", 24, 32, seed=2)
    rows = [{"video": "photo.bmp", "media_type": "image"}]
    table = str(out / SIZE_TABLE)
    assert row_sizes(rows, str(media), table_path=table) == [(32, 24)]
    before = (media / "photo.bmp").stat()
    os.utime(tmp_path / "portrait.bmp", ns=(before.st_atime_ns, before.st_mtime_ns))   # touch -r photo portrait
    shutil.copy2(tmp_path / "portrait.bmp", media / "photo.bmp")                      # cp -p portrait photo
    after = (media / "photo.bmp").stat()
    assert (after.st_size, after.st_mtime_ns) == (before.st_size, before.st_mtime_ns)
    assert row_sizes(rows, str(media), table_path=table) == [(24, 32)]
    assert list(load_table(table).values()) == [(24, 32)]


def test_a_table_written_before_the_change_time_was_kept_is_read_with_its_entries_read_again(tmp_path, capsys):
    """Version 1 keyed each file by ``size:mtime:path``: its entries cannot be trusted any more, but the table is
    no error; it is written again in the new version."""
    bitmap(tmp_path / "photo.bmp", 32, 24)
    info = (tmp_path / "photo.bmp").stat()
    old_key = f"{info.st_size}:{info.st_mtime_ns}:{tmp_path / 'photo.bmp'}"
    table = tmp_path / SIZE_TABLE
    table.write_text(json.dumps({"version": 1, "sizes": {old_key: [24, 32]}}))   # a wrong size: never used
    rows = [{"video": "photo.bmp", "media_type": "image"}]
    assert row_sizes(rows, str(tmp_path), table_path=str(table)) == [(32, 24)]
    said = capsys.readouterr().err
    assert "cannot be used" not in said and "error" not in said and said.count("note:") == 1
    saved = json.loads(table.read_text())
    assert saved["version"] == 2 and list(saved["sizes"].values()) == [[32, 24]]


def test_what_save_table_writes_is_read_back_whole(tmp_path):
    table = str(tmp_path / SIZE_TABLE)
    sizes = {"1:2:3:/a:b.png": (80, 40), "4:5:6:/c.mp4": None}
    save_table(table, sizes)
    assert load_table(table) == sizes


def test_a_files_key_names_it_by_its_resolved_path_however_the_row_spells_it(tmp_path, monkeypatch):
    """Each folder is resolved once for all its files: a linked folder, a linked file, ``..`` after a linked folder,
    a relative path and a missing file each get the key of the file ``realpath`` finds (or None)."""
    from diffsynth_mbc.data.media.size_table import fingerprint_keys

    real, elsewhere = tmp_path / "real", tmp_path / "elsewhere" / "deep"
    real.mkdir()
    elsewhere.mkdir(parents=True)
    write_image(real / "a.png", 8, 8)
    write_image(tmp_path / "elsewhere" / "b.png", 8, 8, seed=1)
    (tmp_path / "linked").symlink_to(real)
    (tmp_path / "linked-deep").symlink_to(elsewhere)
    (real / "c.png").symlink_to(tmp_path / "elsewhere" / "b.png")
    monkeypatch.chdir(tmp_path)
    paths = [str(real / "a.png"), str(tmp_path / "linked" / "a.png"), "linked/a.png", "real/c.png",
             "linked-deep/../b.png", str(real / "missing.png"), str(real), "a.png"]
    resolved = [os.path.realpath(path) for path in paths]
    keys = fingerprint_keys(paths)
    assert [key.split(":", 3)[-1] if key else None for key in keys] == resolved[:5] + [None] * 3
    assert resolved[4] == str(tmp_path / "elsewhere" / "b.png")   # .. after the linked folder: where it points
    assert keys[0] == keys[1] == keys[2] == fingerprint_key(str(real / "a.png"))
