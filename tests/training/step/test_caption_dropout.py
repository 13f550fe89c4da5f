"""Captions on the tiny model, in-process: a trigger word reaches the encoder from the media and from the latent
cache (a cache encoded with another one is refused), and a dropped caption trains the same objective either way."""

import copy
import json
import shutil

import pytest
import torch

from diffsynth_mbc.data.cache.dataset import CachedLatentDataset, CacheMismatchError, open_training_dataset
from diffsynth_mbc.data.dataset import MBCVideoDataset
from diffsynth_mbc.data.demo import prepare
from diffsynth_mbc.models.pipeline import build_demo_pipeline
from diffsynth_mbc.training.lora.module import WanTI2VLoraModule
from diffsynth_mbc.training.options import TrainOptions
from diffsynth_mbc.training.step.caption_dropout import CaptionDropout
from e2e_helpers import build_demo_cache

SEED = 42
PREFIX = "mbcstyle"
TOLERANCE = {"rtol": 1e-5, "atol": 1e-6}


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("captions")
    metadata = prepare(root, num_videos=2, num_images=1)
    cache_dir = root / "cache"
    build_demo_cache(root, metadata, cache_dir, "--caption_prefix", PREFIX, seed=SEED)
    media = MBCVideoDataset(str(root / "catalog"), str(metadata), num_frames=9, height=64, width=64,
                            caption_prefix=PREFIX)
    return root, media, CachedLatentDataset(cache_dir)


def training_options(root, cache_dir, **overrides):
    values = {"cache": cache_dir and str(cache_dir), "height": 64, "width": 64, "num_frames": 9, "dataset_repeat": 1,
              "dataset_base_path": str(root / "catalog"),
              "dataset_metadata_path": str(root / "metadata" / "metadata.csv"),
              "demo": True, "seed": SEED, "model_dir": None, "model_id": None, "caption_dropout": 0.0,
              "caption_prefix": PREFIX, "caption_suffix": "", **overrides}
    return TrainOptions(**values)


def make_module(load_encoders: bool) -> WanTI2VLoraModule:
    pipe = build_demo_pipeline(device="cpu", torch_dtype=torch.float32, seed=SEED, load_encoders=load_encoders)
    torch.manual_seed(0)
    return WanTI2VLoraModule(pipe, lora_rank=4, use_gradient_checkpointing=False)


def test_the_trigger_word_is_in_every_prompt_and_the_cache_keyed_on_it(data, tmp_path):
    root, media, cached = data
    plain = MBCVideoDataset(str(root / "catalog"), str(root / "metadata" / "metadata.csv"), num_frames=9,
                            height=64, width=64)
    assert [row["prompt"] for row in media.data] == [f"{PREFIX} {row['prompt']}" for row in plain.data]
    assert [row["prompt"] for row in cached.entries] == [media.data[row["row"] - 1]["prompt"] for row in cached.entries]
    assert open_training_dataset(training_options(root, cached.cache_dir)).rows == 3
    with pytest.raises(CacheMismatchError, match=r"its captions were encoded with --caption_prefix 'mbcstyle'; this "
                                                 r"run has --caption_prefix ''"):
        open_training_dataset(training_options(root, cached.cache_dir, caption_prefix=""))
    with pytest.raises(CacheMismatchError, match=r"--caption_suffix ''; this run has --caption_suffix 'x'"):
        open_training_dataset(training_options(root, cached.cache_dir, caption_suffix="x"))
    # Without the option, a run from the media is the run of before: the metadata's captions, untouched.
    untouched = open_training_dataset(training_options(root, None, caption_prefix="", caption_suffix=""))
    assert untouched.data == plain.data


def test_a_cache_without_the_empty_prompt_is_refused_for_dropout_and_a_rerun_adds_it(data, tmp_path):
    root, _, cached = data
    old = tmp_path / "old-cache"
    shutil.copytree(cached.cache_dir, old)
    index = json.loads((old / "cache.json").read_text())
    empty_file = old / index.pop("empty_prompt")["text"]
    empty_file.unlink()
    (old / "cache.json").write_text(json.dumps(index))   # as a cache built before the option existed
    assert open_training_dataset(training_options(root, old)).rows == 3   # no dropout: fine
    with pytest.raises(CacheMismatchError, match=r"--caption_dropout 0.1 trains on the empty prompt, whose embedding "
                                                 r"the latent cache .* does not hold .*rerun `python -m "
                                                 r"diffsynth_mbc.cache`"):
        open_training_dataset(training_options(root, old, caption_dropout=0.1))
    build_demo_cache(root, root / "metadata" / "metadata.csv", old, "--caption_prefix", PREFIX, seed=SEED)
    summary = json.loads((old / "summary.json").read_text())
    assert (summary["written"], summary["text_written"]) == (0, 0)   # only the empty prompt was encoded
    reopened = open_training_dataset(training_options(root, old, caption_dropout=0.1))
    torch.testing.assert_close(reopened.empty_context(), cached.empty_context(), rtol=0, atol=0)


def test_no_dropout_leaves_every_batch_as_it_was():
    batch = [{"prompt": "a clip", "cached": True, "context": torch.ones(2, 3)}, {"prompt": "an image"}]
    before = copy.deepcopy(batch)
    off = CaptionDropout(0.0, SEED, 0)
    assert all(off.apply(batch, epoch, index) == 0 for epoch in range(3) for index in range(50))
    assert batch[0]["prompt"] == before[0]["prompt"] and batch[0]["context"] is batch[0]["context"]
    assert batch[1] == before[1] and off.dropped == 0


def test_a_dropped_caption_trains_the_same_from_the_media_and_from_the_cache(data):
    _, media, cached = data
    encoding, from_cache = make_module(load_encoders=True), make_module(load_encoders=False)
    always = CaptionDropout(1.0, SEED, 0, cached)
    rows = [0, cached.rows - 1]   # a video and the image
    for index in rows:
        entry = cached[index]
        clip = media[entry["row"] - 1]
        torch.manual_seed(100 + index)
        with torch.no_grad():
            kept = encoding([dict(clip)])
        dropped_clip, dropped_entry = dict(clip), dict(entry)
        assert always.apply([dropped_clip], 0, index) == 1 and always.apply([dropped_entry], 0, index) == 1
        assert dropped_clip["prompt"] == dropped_entry["prompt"] == ""
        torch.manual_seed(100 + index)
        expected = encoding.encode(dropped_clip)
        torch.manual_seed(100 + index)
        got = from_cache.inputs_from_cache(dropped_entry)
        torch.testing.assert_close(got["context"], expected["context"], **TOLERANCE)
        with torch.no_grad():
            torch.manual_seed(100 + index)
            from_media = encoding([dropped_clip])
            torch.manual_seed(100 + index)
            torch.testing.assert_close(from_cache([dropped_entry]), from_media, **TOLERANCE)
        assert not torch.allclose(from_media, kept)   # the caption mattered: dropping it changed the loss
    assert always.dropped == 2 * len(rows)
