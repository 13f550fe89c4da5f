"""Images train as they look: 16-bit greyscale PNGs are scaled to 8 bits, not clipped to white."""

from __future__ import annotations

import numpy as np
from PIL import Image

from diffsynth_mbc.data.dataset import MBCVideoDataset


def load(tmp_path, name):
    metadata = tmp_path / "metadata.csv"
    metadata.write_text(f"video,prompt\n{name},x\n")
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
        metadata = tmp_path / "metadata.csv"
        metadata.write_text(f"video,prompt\n{name},x\n")
        dataset = MBCVideoDataset(str(tmp_path), str(metadata), num_frames=17, height=64, width=64)
        reference = super(MBCVideoDataset, dataset).load_image(str(tmp_path / name))
        assert np.array_equal(np.asarray(dataset.load_image(str(tmp_path / name))[0]), np.asarray(reference[0]))
