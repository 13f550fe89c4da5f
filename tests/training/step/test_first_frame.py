"""The first frame as Wan2.2-TI2V conditions on it, through the training's own step (``WanTI2VLoraModule`` ->
``batch_loss`` -> ``dit_forward``), recorded where it enters the DiT: an i2v sample's latent frame 0 enters clean (not
noised), its tokens carry timestep 0 and it is out of the loss; a t2v clip and a t2i image are noised everywhere and
carry one timestep on every token. (DiffSynth 2.0 shipped a step that noised the clean first frame; 1.1.8 writes the
clean latent into the noise, so ``add_noise`` mixes it with itself.) In fp32, and in fp16 with the fp32 residual
stream, where the timesteps are embedded in fp32."""

from __future__ import annotations

import pytest
import torch

from diffsynth_mbc.training.step import batch_loss as batch_loss_module
from tiny_step import make_module

# fp16: DiffSynth's (1 - sigma) x + sigma x for the clean frame rounds to within this of x (relative, 2^-10 and slack)
CLEAN_TOLERANCE = {torch.float32: 1e-6, torch.float16: 2e-3}


class EnteringTheDiT:
    """What ``dit_forward`` is given (latents, timesteps, which samples are conditioned), the timesteps the DiT
    embeds (the sinusoid's positions: one per token, or one per sample), and the prediction, kept for its gradient."""

    def __init__(self, monkeypatch):
        self.calls, self.positions = [], []
        forward, sinusoid = batch_loss_module.dit_forward, batch_loss_module.sinusoidal_embedding_1d

        def recording_forward(dit, latents, timesteps, context, runner, conditioned):
            prediction = forward(dit, latents, timesteps, context, runner, conditioned)
            prediction.retain_grad()
            self.calls.append({"latents": latents.detach().clone(), "timesteps": timesteps.detach().clone(),
                               "conditioned": list(conditioned), "prediction": prediction})
            return prediction

        def recording_sinusoid(dim, position):
            self.positions.append(position.detach().clone())
            return sinusoid(dim, position)

        monkeypatch.setattr(batch_loss_module, "dit_forward", recording_forward)
        monkeypatch.setattr(batch_loss_module, "sinusoidal_embedding_1d", recording_sinusoid)


def module_for(dtype):
    return make_module(dtype=dtype, fp32_residual=dtype != torch.float32)


def relative_gap(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max() / b.float().abs().max())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_an_i2v_samples_frame_0_enters_clean_at_timestep_0_and_out_of_the_loss(entries, monkeypatch, dtype):
    videos, _ = entries
    module = module_for(dtype)
    seen = EnteringTheDiT(monkeypatch)
    torch.manual_seed(4)
    module([dict(videos[0], mode="i2v")]).backward()
    call, = seen.calls
    clean = videos[0]["input_latents"][None].to(dtype)
    latents, timestep = call["latents"], float(call["timesteps"][0])
    assert call["conditioned"] == [True] and 0 < timestep < 1000
    assert relative_gap(latents[:, :, 0], clean[:, :, 0]) < CLEAN_TOLERANCE[dtype]     # frame 0: the clean latent
    assert relative_gap(latents[:, :, 1:], clean[:, :, 1:]) > 0.05                     # frames 1..: noised
    positions, = seen.positions
    tokens_per_frame = latents.shape[3] * latents.shape[4] // 4                         # patch 1 x 2 x 2
    assert positions.numel() == latents.shape[2] * tokens_per_frame                     # one timestep per token
    assert positions.dtype == (torch.float32 if dtype == torch.float16 else dtype)     # embedded in fp32
    assert bool((positions[:tokens_per_frame] == 0).all())                              # frame 0's tokens: 0
    assert bool((positions[tokens_per_frame:] == timestep).all())                       # every other: the sample's
    gradient = call["prediction"].grad
    assert torch.count_nonzero(gradient[:, :, 0]) == 0 and torch.count_nonzero(gradient[:, :, 1:]) > 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("kind, mode", [("videos", "t2v"), ("images", "t2i")])
def test_a_t2v_clip_and_a_t2i_image_are_noised_everywhere_at_one_timestep(entries, monkeypatch, dtype, kind, mode):
    samples = entries[0] if kind == "videos" else entries[1]
    module = module_for(dtype)
    seen = EnteringTheDiT(monkeypatch)
    torch.manual_seed(4)
    module([dict(samples[0], mode=mode)]).backward()
    call, = seen.calls
    clean = samples[0]["input_latents"][None].to(dtype)
    assert call["conditioned"] == [False]
    assert relative_gap(call["latents"][:, :, 0], clean[:, :, 0]) > 0.05                 # frame 0 noised too
    positions, = seen.positions
    assert positions.tolist() == [float(call["timesteps"][0])]    # one timestep for the sample: every token's
    assert torch.count_nonzero(call["prediction"].grad[:, :, 0]) > 0                   # frame 0 in the loss


def test_in_a_batch_mixing_i2v_and_t2v_only_the_i2v_samples_frame_0_carries_timestep_0(entries, monkeypatch):
    videos, _ = entries
    module = module_for(torch.float32)
    seen = EnteringTheDiT(monkeypatch)
    torch.manual_seed(4)
    module([dict(videos[0], mode="i2v"), dict(videos[1], mode="t2v")]).backward()
    call, = seen.calls
    assert call["conditioned"] == [True, False]
    latents = call["latents"]
    tokens_per_frame = latents.shape[3] * latents.shape[4] // 4
    positions = seen.positions[0].reshape(2, -1)
    steps = call["timesteps"]
    assert bool((positions[0, :tokens_per_frame] == 0).all())
    assert bool((positions[0, tokens_per_frame:] == steps[0]).all())
    assert bool((positions[1] == steps[1]).all())                  # the t2v clip: its timestep on every token
    clean = torch.stack([videos[0]["input_latents"], videos[1]["input_latents"]])
    assert relative_gap(latents[0, :, 0], clean[0, :, 0]) < 1e-6      # the i2v sample's frame 0: clean
    assert relative_gap(latents[1, :, 0], clean[1, :, 0]) > 0.05      # the t2v clip's: noised
    gradient = call["prediction"].grad
    assert torch.count_nonzero(gradient[0, :, 0]) == 0 and torch.count_nonzero(gradient[1, :, 0]) > 0
