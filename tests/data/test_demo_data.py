"""Demo media are real files that ffmpeg and PIL read back with the requested shape."""

from __future__ import annotations

import csv
import os
import time

import imageio.v2 as imageio
import pytest
from PIL import Image

from diffsynth_mbc.data.demo_data import make_demo_catalog, write_image, write_video


def test_write_video_has_the_frames_size_and_fps_asked_for(tmp_path):
    path = write_video(tmp_path / "clip.mp4", num_frames=5, width=48, height=32, fps=6, seed=1)
    reader = imageio.get_reader(path)
    try:
        assert reader.count_frames() == 5
        assert reader.get_meta_data()["fps"] == 6
        frames = [reader.get_data(i) for i in range(5)]
    finally:
        reader.close()
    assert all(frame.shape == (32, 48, 3) for frame in frames)
    assert len({frame.tobytes() for frame in frames}) == 5  # the pattern moves


def test_write_video_rejects_odd_sizes(tmp_path):
    with pytest.raises(ValueError, match="even"):
        write_video(tmp_path / "odd.mp4", num_frames=3, width=33, height=32)


@pytest.mark.parametrize("name, image_format", [("a.png", "PNG"), ("b.jpg", "JPEG"), ("c.JPEG", "JPEG")])
def test_write_image_format_follows_suffix(tmp_path, name, image_format):
    path = write_image(tmp_path / "sub" / name, width=40, height=24, seed=2)
    with Image.open(path) as image:
        assert image.format == image_format
        assert image.size == (40, 24)


def test_make_demo_catalog_is_fast_and_in_mbc_format(tmp_path):
    started = time.perf_counter()
    catalog = make_demo_catalog(tmp_path)
    assert time.perf_counter() - started < 5
    assert catalog == tmp_path / "catalog.csv"
    with open(catalog, encoding="utf-8", newline="") as handle:
        rows = list(csv.DictReader(handle))
    assert list(rows[0]) == ["file_path", "caption", "media_type"]
    assert [r["media_type"] for r in rows] == ["video"] * 6 + ["image"] * 6
    assert all((tmp_path / r["file_path"]).is_file() for r in rows)
    assert {r["file_path"].rsplit(".", 1)[1] for r in rows} == {"mp4", "png", "jpg"}
    captions = [r["caption"] for r in rows]
    assert len(set(captions)) == 12
    assert any("," in c and any("\uac00" <= ch <= "\ud7a3" for ch in c) for c in captions)  # Korean with commas
    assert any('"' in c for c in captions) and any("\n" in c for c in captions)


def test_preparing_the_demo_again_leaves_its_files_as_they_were(tmp_path):
    """A latent cache keys each file by its size and mtime: a demo written afresh made the cache of an earlier
    demo run stale. Files are replaced only when their bytes differ."""
    from diffsynth_mbc.data.demo import prepare

    prepare(tmp_path, num_videos=2, num_images=2)
    catalog = tmp_path / "catalog"
    files = sorted(p for p in catalog.rglob("*") if p.is_file())
    assert len(files) == 5                                              # 2 videos, 2 images, catalog.csv
    before = {p: (p.stat().st_mtime_ns, p.read_bytes()) for p in files}
    os.utime(files[0], ns=(1, 1))                                       # an mtime no rewrite could give back
    before[files[0]] = (1, before[files[0]][1])
    prepare(tmp_path, num_videos=2, num_images=2)
    assert sorted(p for p in catalog.rglob("*") if p.is_file()) == files   # no temp files left
    assert {p: (p.stat().st_mtime_ns, p.read_bytes()) for p in files} == before

    (catalog / "media" / "image_000.png").write_bytes(b"damaged")      # a file that differs is written again
    prepare(tmp_path, num_videos=2, num_images=2)
    assert (catalog / "media" / "image_000.png").read_bytes() == before[catalog / "media" / "image_000.png"][1]
