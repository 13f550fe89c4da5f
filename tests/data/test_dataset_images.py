"""Images train as they look: 16-bit greyscale PNGs are scaled to 8 bits, not clipped to white."""

from __future__ import annotations

import numpy as np
from PIL import Image

from catalog_helpers import DIFFSYNTH, image, write_metadata
from diffsynth_mbc.data.dataset import MBCVideoDataset


def load(tmp_path, name):
    metadata = write_metadata(tmp_path / "metadata.csv", [image(name, caption="x")], DIFFSYNTH)
    dataset = MBCVideoDataset(str(tmp_path), str(metadata), num_frames=17, height=64, width=64)
    frames = dataset[0]["video"]
    assert len(frames) == 1 and frames[0].mode == "RGB" and frames[0].size == (64, 64)
    return np.asarray(frames[0], dtype=np.int16)


def test_a_16_bit_greyscale_png_trains_as_its_8_bit_picture(tmp_path):
    name = "grey16.png"
    gradient = np.linspace(0, 65535, 48 * 80).reshape(48, 80).astype(np.uint16)
    Image.fromarray(gradient).save(tmp_path / name)
    assert Image.open(tmp_path / name).mode == "I;16"
    Image.fromarray(np.round(gradient / 257).astype(np.uint8), mode="L").save(tmp_path / "grey8.png")
    sixteen, eight = load(tmp_path, name), load(tmp_path, "grey8.png")
    assert abs(sixteen.mean() - 127.5) < 2                     # not 255: a white frame
    assert np.abs(sixteen - eight).max() <= 1


def test_8_bit_images_load_exactly_as_diffsynth_loads_them(tmp_path):
    rng = np.random.default_rng(0)
    Image.fromarray(rng.integers(0, 256, (40, 70, 3), dtype=np.uint8)).save(tmp_path / "rgb.png")
    Image.fromarray(rng.integers(0, 256, (40, 70, 4), dtype=np.uint8), mode="RGBA").save(tmp_path / "rgba.png")
    for name in ("rgb.png", "rgba.png"):
        metadata = write_metadata(tmp_path / "metadata.csv", [image(name, caption="x")], DIFFSYNTH)
        dataset = MBCVideoDataset(str(tmp_path), str(metadata), num_frames=17, height=64, width=64)
        reference = super(MBCVideoDataset, dataset).load_image(str(tmp_path / name))
        assert np.array_equal(np.asarray(dataset.load_image(str(tmp_path / name))[0]), np.asarray(reference[0]))


def test_a_phone_photo_turned_by_its_exif_trains_upright_as_convert_and_the_sheet_see_it(tmp_path):
    """Stored 320x160 with EXIF orientation 6 (turn 90 degrees clockwise to show): convert wrote 320x160 and it
    trained landscape, sideways, while --inspect and the contact sheet showed it upright 160x320."""
    import json

    from diffsynth_mbc.data.convert import main as convert
    from diffsynth_mbc.data.media.media_probe import probe_image

    stored = np.zeros((160, 320, 3), dtype=np.uint8)
    stored[:, :160] = (250, 0, 0)     # stored left half red: shown, after the turn, as the top half
    stored[:, 160:] = (0, 0, 250)
    exif = Image.Exif()
    exif[0x0112] = 6
    Image.fromarray(stored).save(tmp_path / "phone.jpg", exif=exif, quality=95)
    assert (probe_image(str(tmp_path / "phone.jpg")).width, probe_image(str(tmp_path / "phone.jpg")).height) == \
        (160, 320)
    (tmp_path / "catalogue.csv").write_text("file_path,caption,media_type\nphone.jpg,a phone photo,image\n")
    assert convert([str(tmp_path / "catalogue.csv"), "--base_path", str(tmp_path), "--output", str(tmp_path / "out"),
                    "--probe", "--height", "128", "--width", "64"]) == 0
    import csv

    row, = csv.DictReader(open(tmp_path / "out" / "metadata.csv", encoding="utf-8"))
    assert (row["width"], row["height"]) == ("160", "320"), row
    assert json.loads((tmp_path / "out" / "summary.json").read_text())["probe"]["width"] == {"160": 1}
    dataset = MBCVideoDataset(str(tmp_path), str(tmp_path / "out" / "metadata.csv"), num_frames=17, height=128,
                              width=64, buckets="aspect")
    frame = np.asarray(dataset[0]["video"][0], dtype=np.int16)
    assert frame.shape == (128, 64, 3)                               # portrait, as shown
    assert frame[:48, :, 0].mean() > 200 and frame[-48:, :, 2].mean() > 200   # red on top, blue below
