"""Validation encodes each sample once for all its timestep quantiles: bit for bit the losses of encoding it again
at each quantile (what it did before), with the VAE run once per sample instead of once per quantile."""

import pytest
import torch

from diffsynth_mbc.data.dataset import MBCVideoDataset
from diffsynth_mbc.data.demo import prepare
from diffsynth_mbc.models.pipeline import build_demo_pipeline
from diffsynth_mbc.training.lora.module import WanTI2VLoraModule

QUANTILES = (0.1, 0.5, 0.9)


@pytest.fixture(scope="module")
def clips_and_module(tmp_path_factory):
    root = tmp_path_factory.mktemp("validation-encoding")
    metadata = prepare(root, num_videos=2, num_images=1)
    media = MBCVideoDataset(str(root / "catalog"), str(metadata), num_frames=9, height=64, width=64)
    module = WanTI2VLoraModule(build_demo_pipeline(device="cpu", torch_dtype=torch.float32, seed=3), lora_rank=4)
    with torch.no_grad():   # a LoRA that is not zero, so the losses depend on it as after some training
        for name, parameter in module.named_parameters():
            if "lora_B" in name:
                parameter.normal_(std=0.05)
    return [media[index] for index in range(len(media))], module


def vae_encodes(module):
    """Count the VAE's encodes (the real method runs)."""
    calls, encode = [], module.pipe.vae.encode

    def counted(*args, **kwargs):
        calls.append(1)
        return encode(*args, **kwargs)

    module.pipe.vae.encode = counted
    return calls


@pytest.mark.parametrize("video_mode", ["i2v", "t2v"])
def test_one_encoding_gives_every_quantile_the_losses_of_encoding_again(clips_and_module, video_mode):
    clips, module = clips_and_module
    for seed, clip in enumerate(clips):
        sample = dict(clip, mode="t2i" if len(clip["video"]) == 1 else video_mode)
        encodes = vae_encodes(module)
        try:
            with torch.no_grad():
                before = []
                for quantile in QUANTILES:   # the validation as it was: seeded and encoded again per quantile
                    torch.manual_seed(seed)
                    before.append(float(module.sample_loss(dict(sample), timestep_quantile=quantile)))
                encoded_before = len(encodes)
                torch.manual_seed(seed)
                inputs = module.inputs(dict(sample))
                after = [float(module.inputs_loss(inputs, timestep_quantile=q)) for q in QUANTILES]
        finally:
            del module.pipe.vae.encode
        assert after == before, sample["mode"]
        assert len(set(after)) == len(QUANTILES)   # the quantiles do differ
        assert encoded_before == len(QUANTILES) * (len(encodes) - encoded_before) > 0, sample["mode"]
