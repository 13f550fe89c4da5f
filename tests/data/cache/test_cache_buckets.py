"""The latent cache under ``--buckets aspect``: each entry at its bucket's shape, the training's batch keys, a cache of
the other mode refused, and a cached sample equal to encoding the same clip (fp32, the tiny demo model)."""

import json
import shutil
from pathlib import Path

import pytest
import torch

from catalog_helpers import ONE_OF_EACH_SHAPE, write_media_catalogue
from diffsynth_mbc.data.cache import cli as cache
from diffsynth_mbc.data.cache.dataset import CachedLatentDataset, CacheMismatchError, open_training_dataset
from diffsynth_mbc.data.cache.index import entry_key
from diffsynth_mbc.data.dataset import MBCVideoDataset
from diffsynth_mbc.data.media.buckets import Bucket
from diffsynth_mbc.models.pipeline import build_demo_pipeline
from diffsynth_mbc.training.lora.module import WanTI2VLoraModule
from diffsynth_mbc.training.options import TrainOptions

SEED = 42
HEIGHT, WIDTH, FRAMES = 64, 128, 9
# the bucket each row of ONE_OF_EACH_SHAPE goes to among bucket_set(64, 128)
BUCKETS = [Bucket(64, 128), Bucket(128, 64), Bucket(96, 96), Bucket(96, 96)]
EXPECTED_KEYS = ["video@128x64", "video@64x128", "image@96x96", "image@96x96"]


def build(root: Path, metadata: Path, cache_dir: Path, buckets: str) -> dict:
    assert cache.main(["--demo", "--seed", str(SEED), "--dataset_base_path", str(root / "catalog"),
                       "--dataset_metadata_path", str(metadata), "--height", str(HEIGHT), "--width", str(WIDTH),
                       "--num_frames", str(FRAMES), "--cache_dir", str(cache_dir), "--dataset_num_workers", "0",
                       "--dtype", "fp32", "--buckets", buckets]) == 0
    return json.loads((cache_dir / "summary.json").read_text())


@pytest.fixture(scope="module")
def catalogue(tmp_path_factory):
    root = tmp_path_factory.mktemp("buckets-cache")
    metadata = write_media_catalogue(root, ONE_OF_EACH_SHAPE)
    build(root, metadata, root / "aspect", "aspect")
    build(root, metadata, root / "off", "off")
    return root, metadata


def options(root: Path, metadata: Path, cache_dir, buckets: str) -> TrainOptions:
    return TrainOptions(cache=str(cache_dir), height=HEIGHT, width=WIDTH, num_frames=FRAMES, dataset_repeat=1,
                        dataset_base_path=str(root / "catalog"), dataset_metadata_path=str(metadata), demo=True,
                        seed=SEED, model_dir=None, model_id=None, buckets=buckets)


def test_each_entry_is_stored_at_its_buckets_shape(catalogue):
    root, _ = catalogue
    index = json.loads((root / "aspect" / "cache.json").read_text())
    assert index["settings"]["buckets"] == "aspect" and not index["failed"]
    shapes = {row["file"]: row["latent_shape"] for row in index["rows"]}
    assert shapes == {row.file: [48, (FRAMES - 1) // 4 + 1 if row.kind == "video" else 1, bucket.height // 16,
                                 bucket.width // 16] for row, bucket in zip(ONE_OF_EACH_SHAPE, BUCKETS)}
    assert shapes["media/landscape.mp4"] == [48, 3, 4, 8] and shapes["media/portrait.mp4"] == [48, 3, 8, 4]
    # off: everything at 64x128, and no setting written (caches built before buckets read as off)
    off = json.loads((root / "off" / "cache.json").read_text())
    assert "buckets" not in off["settings"]
    assert {row["file"]: row["latent_shape"][2:] for row in off["rows"]} == {
        row.file: [4, 8] for row in ONE_OF_EACH_SHAPE}


def test_cached_batch_keys_are_the_media_datasets(catalogue):
    root, metadata = catalogue
    media = MBCVideoDataset(str(root / "catalog"), str(metadata), num_frames=FRAMES, height=HEIGHT, width=WIDTH,
                            buckets="aspect")
    assert media.batch_keys() == EXPECTED_KEYS
    assert CachedLatentDataset(root / "aspect").batch_keys() == EXPECTED_KEYS
    opened = open_training_dataset(options(root, metadata, root / "aspect", "aspect"))
    assert isinstance(opened, CachedLatentDataset) and opened.batch_keys() == EXPECTED_KEYS
    assert CachedLatentDataset(root / "off").batch_keys() == ["video", "video", "image", "image"]
    for row in range(opened.rows):   # the sample's size is its key's bucket
        sample, bucket = opened[row], BUCKETS[row]
        assert (sample["height"], sample["width"]) == (bucket.height, bucket.width)


def test_a_cache_of_the_other_bucket_mode_is_refused_naming_the_option(catalogue):
    root, metadata = catalogue
    with pytest.raises(CacheMismatchError, match=r"--buckets: the cache was built with off, this run asks for aspect "
                                                 r"\(rebuild the cache with --buckets aspect\)"):
        open_training_dataset(options(root, metadata, root / "off", "aspect"))
    with pytest.raises(CacheMismatchError, match=r"--buckets: the cache was built with aspect, this run asks for off "
                                                 r"\(rebuild the cache with --buckets off\)"):
        open_training_dataset(options(root, metadata, root / "aspect", "off"))
    assert open_training_dataset(options(root, metadata, root / "off", "off")).rows == len(ONE_OF_EACH_SHAPE)


def test_the_bucket_is_part_of_the_entry_key(catalogue, tmp_path):
    """An aspect build over an off cache encodes every row again (even the landscape clip, whose bucket is the
    configured size); a second aspect build reuses them all. Off keys are those of caches built before buckets."""
    root, metadata = catalogue
    cache_dir = tmp_path / "cache"
    shutil.copytree(root / "off", cache_dir)
    summary = build(root, metadata, cache_dir, "aspect")
    rows = len(ONE_OF_EACH_SHAPE)
    assert (summary["written"], summary["skipped"], summary["text_skipped"]) == (rows, 0, rows)
    summary = build(root, metadata, cache_dir, "aspect")
    assert (summary["written"], summary["skipped"]) == (0, rows)
    assert json.loads((cache_dir / "cache.json").read_text())["rows"] == \
        json.loads((root / "aspect" / "cache.json").read_text())["rows"]
    settings = {"height": HEIGHT, "width": WIDTH, "num_frames": FRAMES, "vae": "v", "dtype": "float32"}
    fingerprint = {"path": "/x.mp4", "size": 1, "mtime_ns": 2}
    assert entry_key(fingerprint, settings) == entry_key(fingerprint, settings, None)
    assert len({entry_key(fingerprint, settings, bucket) for bucket in (None, Bucket(64, 128), Bucket(128, 64))}) == 3


def test_a_cached_sample_is_the_encoding_of_the_same_clip(catalogue):
    """Training from the aspect cache gives the inputs and the loss of encoding each clip at its bucket."""
    root, metadata = catalogue
    media = MBCVideoDataset(str(root / "catalog"), str(metadata), num_frames=FRAMES, height=HEIGHT, width=WIDTH,
                            buckets="aspect")
    cached = CachedLatentDataset(root / "aspect")
    modules = []
    for load_encoders in (True, False):
        pipe = build_demo_pipeline(device="cpu", torch_dtype=torch.float32, seed=SEED, load_encoders=load_encoders)
        torch.manual_seed(0)
        modules.append(WanTI2VLoraModule(pipe, lora_rank=4))
    encoding, from_cache = modules
    for position in range(cached.rows):
        entry = cached[position]
        clip = media[entry["row"] - 1]
        bucket = BUCKETS[position]
        assert clip["video"][0].size == (bucket.width, bucket.height)
        torch.manual_seed(100 + position)
        expected = encoding.encode(clip)
        torch.manual_seed(100 + position)
        got = from_cache.inputs_from_cache(entry)
        for name in ("noise", "latents", "input_latents", "first_frame_latents", "context"):
            torch.testing.assert_close(got[name], expected[name].to(got[name].dtype), rtol=1e-5, atol=1e-6, msg=name)
        assert (got["height"], got["width"], got["num_frames"]) == \
            (expected["height"], expected["width"], expected["num_frames"])
        torch.manual_seed(200 + position)
        loss = encoding.sample_loss(clip)
        torch.manual_seed(200 + position)
        torch.testing.assert_close(from_cache.sample_loss(entry), loss, rtol=1e-5, atol=1e-6)
