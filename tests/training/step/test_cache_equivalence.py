"""Training from the cache is training from the media: same inputs, same loss, same LoRA after 3 steps (fp32)."""

import pytest
import torch

from diffsynth_mbc.data.cache.dataset import CachedLatentDataset
from diffsynth_mbc.data.dataset import MBCVideoDataset
from diffsynth_mbc.data.demo import prepare
from diffsynth_mbc.models.pipeline import build_demo_pipeline
from diffsynth_mbc.training.lora.module import WanTI2VLoraModule
from diffsynth_mbc.training.step import batch_loss as batch_loss_module
from e2e_helpers import build_demo_cache

SEED = 42
TOLERANCE = {"rtol": 1e-5, "atol": 1e-6}


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("equivalence")
    metadata = prepare(root, num_videos=2, num_images=1)
    cache_dir = root / "cache"
    build_demo_cache(root, metadata, cache_dir, seed=SEED)
    media = MBCVideoDataset(str(root / "catalog"), str(metadata), num_frames=9, height=64, width=64)
    cached = CachedLatentDataset(cache_dir)
    assert cached.rows == 3
    return media, cached


def make_module(load_encoders: bool) -> WanTI2VLoraModule:
    pipe = build_demo_pipeline(device="cpu", torch_dtype=torch.float32, seed=SEED, load_encoders=load_encoders)
    torch.manual_seed(0)  # the LoRA's own random init
    return WanTI2VLoraModule(pipe, lora_rank=4)


@pytest.fixture(scope="module")
def modules():
    encoding = make_module(load_encoders=True)
    from_cache = make_module(load_encoders=False)  # the DiT only: no VAE, no text encoder
    assert from_cache.pipe.vae is None and from_cache.pipe.text_encoder is None
    return encoding, from_cache


def pairs(data):
    media, cached = data
    return [(media[cached[i]["row"] - 1], cached[i]) for i in range(cached.rows)]  # rows are 1-based


def test_cached_inputs_are_the_units_inputs(data, modules):
    encoding, from_cache = modules
    for step, (clip, entry) in enumerate(pairs(data)):
        torch.manual_seed(100 + step)
        expected = encoding.encode(clip)
        torch.manual_seed(100 + step)
        got = from_cache.inputs_from_cache(entry)
        for name in ("noise", "latents", "input_latents", "first_frame_latents", "context"):
            torch.testing.assert_close(got[name], expected[name].to(got[name].dtype), **TOLERANCE, msg=name)
        assert got["latents"] is got["noise"]  # the units hand the noise over as latents, first frame inside
        for name in ("height", "width", "num_frames", "fuse_vae_embedding_in_latents", "cfg_scale", "cfg_merge",
                     "tiled", "rand_device", "max_timestep_boundary", "min_timestep_boundary", "vace_scale",
                     "use_gradient_checkpointing", "prompt"):
            assert got[name] == expected[name], name
        assert set(expected) - set(got) == {"input_video", "input_image"}


def test_same_seed_same_loss(data, modules):
    encoding, from_cache = modules
    for step, (clip, entry) in enumerate(pairs(data)):
        torch.manual_seed(200 + step)
        expected = encoding.sample_loss(clip)
        torch.manual_seed(200 + step)
        got = from_cache.sample_loss(entry)
        assert expected.item() > 0
        torch.testing.assert_close(got, expected, **TOLERANCE)


@pytest.mark.parametrize("mode", ["t2v", "i2v"])
def test_each_video_mode_trains_the_same_loss_from_the_cache_as_from_the_media(data, modules, mode):
    """t2v from the cache keeps the noise whole as the units do without an input image; i2v writes the first frame."""
    encoding, from_cache = modules
    videos = [(clip, entry) for clip, entry in pairs(data) if len(clip["video"]) > 1]
    assert videos
    for step, (clip, entry) in enumerate(videos):
        torch.manual_seed(300 + step)
        expected = encoding.sample_loss(dict(clip, mode=mode))
        torch.manual_seed(300 + step)
        got = from_cache.sample_loss(dict(entry, mode=mode))
        torch.testing.assert_close(got, expected, **TOLERANCE)
        torch.manual_seed(300 + step)
        inputs = from_cache.inputs(dict(entry, mode=mode))
        assert inputs["mode"] == mode and ("fuse_vae_embedding_in_latents" in inputs) == (mode == "i2v")


def test_three_optimizer_steps_give_the_same_lora(data, modules):
    encoding, from_cache = modules
    initial = {k: v.clone() for k, v in from_cache.lora_state_dict().items()}
    for key, value in encoding.lora_state_dict().items():
        assert torch.equal(value, initial[key])
    optimizers = [torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=1e-2)
                  for m in (encoding, from_cache)]
    batch = pairs(data)
    for step in range(3):
        for module, optimizer, side in ((encoding, optimizers[0], 0), (from_cache, optimizers[1], 1)):
            torch.manual_seed(300 + step)
            loss = module([sample[side] for sample in (batch[step:] + batch[:step])[:2]])  # 2 samples a step
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
    got, expected = from_cache.lora_state_dict(), encoding.lora_state_dict()
    assert got.keys() == expected.keys()
    assert any(not torch.equal(got[key], initial[key]) for key in got)  # the steps changed the LoRA
    for key in got:
        torch.testing.assert_close(got[key], expected[key], **TOLERANCE, msg=key)


def test_validation_loss_at_a_quantile_uses_that_timestep_whatever_the_rng(data, modules):
    """Fixed-quantile validation: the timestep is the quantile's, not a random draw (even under another seed),
    so two evaluations of the same LoRA give the same loss; different quantiles differ."""
    _, from_cache = modules
    entry = data[1][0]
    pipe = from_cache.pipe
    seen, original = [], batch_loss_module.dit_forward

    def recording(dit, latents, timesteps, *args, **kwargs):
        seen.extend(float(t) for t in timesteps)
        return original(dit, latents, timesteps, *args, **kwargs)

    batch_loss_module.dit_forward = recording
    try:
        losses = {}
        for quantile in (0.1, 0.5, 0.9):
            values = []
            for seed in (1234, 1234, 99):   # the timestep is the quantile's: no RNG draw picks it
                torch.manual_seed(seed)
                values.append(float(from_cache.sample_loss(dict(entry), timestep_quantile=quantile)))
            assert values[0] == values[1]   # same noise, same timestep: same loss
            losses[quantile] = values[0]
    finally:
        batch_loss_module.dit_forward = original
    expected = [float(pipe.scheduler.timesteps[int(q * pipe.scheduler.num_train_timesteps)]) for q in (0.1, 0.5, 0.9)]
    assert sorted(set(seen), reverse=True) == pytest.approx(sorted(expected, reverse=True))
    assert len(set(losses.values())) == 3
