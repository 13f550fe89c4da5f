"""Each training mode's target and loss on the tiny model from DiffSynth's classes (``training/step/objective.py``):
t2i and t2v are DiffSynth's own objective without a first-frame condition, bit for bit; i2v is DiffSynth's
conditioned objective with frame 0 out of the MSE; an image's loss is of the order of a video's."""

from __future__ import annotations

import pytest
import torch

from diffsynth_mbc.training.step import batch_loss as batch_loss_module
from diffsynth_mbc.training.step.batch_loss import batch_loss, sample_mse
from tiny_step import make_module


def models_of(module) -> dict:
    return {name: getattr(module.pipe, name) for name in module.pipe.in_iteration_models}


def diffsynth_unconditioned_loss(module, sample, seed):
    """DiffSynth 1.1.8's ``training_loss`` on the sample without an input image: its own text-to-video objective."""
    torch.manual_seed(seed)
    inputs = module.inputs_from_cache(dict(sample), conditioned=False)
    return module.pipe.training_loss(**models_of(module), **inputs)


def diffsynth_i2v_loss_without_frame_0(module, sample, seed):
    """DiffSynth's conditioned objective, step by step as its ``training_loss`` does it, with the MSE over latent
    frames 1.. only."""
    pipe = module.pipe
    torch.manual_seed(seed)
    inputs = module.inputs_from_cache(dict(sample))
    timestep_id = torch.randint(0, pipe.scheduler.num_train_timesteps, (1,))
    timestep = pipe.scheduler.timesteps[timestep_id].to(dtype=pipe.torch_dtype, device=pipe.device)
    inputs["latents"] = pipe.scheduler.add_noise(inputs["input_latents"], inputs["noise"], timestep)
    target = pipe.scheduler.training_target(inputs["input_latents"], inputs["noise"], timestep)
    prediction = pipe.model_fn(**models_of(module), **inputs, timestep=timestep)
    loss = torch.nn.functional.mse_loss(prediction[:, :, 1:].float(), target[:, :, 1:].float())
    return loss * pipe.scheduler.training_weight(timestep)


@pytest.mark.parametrize("kind, mode", [("images", "t2i"), ("videos", "t2v")])
def test_an_unconditioned_mode_is_diffsynths_objective_without_an_input_image_bit_for_bit(entries, kind, mode):
    videos, images = entries
    sample = (images if kind == "images" else videos)[0]
    module = make_module()
    torch.manual_seed(7)
    ours = module(dict(sample, mode=mode))
    theirs = diffsynth_unconditioned_loss(module, sample, 7)
    assert torch.equal(ours, theirs.reshape(ours.shape)), (float(ours), float(theirs))
    (_, _, logged_mode), = module.draws.take()
    assert logged_mode == mode


def test_i2v_is_diffsynths_conditioned_objective_with_frame_0_out_of_the_loss(entries):
    videos, _ = entries
    module = make_module()
    torch.manual_seed(7)
    ours = module(dict(videos[0]))            # a video's default mode
    theirs = diffsynth_i2v_loss_without_frame_0(module, videos[0], 7)
    torch.testing.assert_close(ours, theirs.reshape(ours.shape), rtol=0, atol=0)
    (_, _, mode), = module.draws.take()
    assert mode == "i2v"


def test_each_modes_target_and_the_frames_its_loss_reads(entries):
    videos, images = entries
    module = make_module()
    image_x0 = images[0]["input_latents"][None].float()
    t2i = module.inputs({**images[0]})
    assert t2i["mode"] == "t2i" and "fuse_vae_embedding_in_latents" not in t2i
    target = (t2i["noise"] - t2i["input_latents"]).float()
    assert torch.equal(t2i["input_latents"].float(), image_x0)
    assert target.pow(2).mean() > 0.5            # the whole image is noised and trained (DiffSynth's: exactly 0)
    i2v = module.inputs({**videos[0]})
    per_frame = (i2v["noise"] - i2v["input_latents"]).float().pow(2).mean(dim=(0, 1, 3, 4))
    assert per_frame[0] == 0 and bool((per_frame[1:] > 0.5).all())   # frame 0 is the clean condition
    assert i2v["first_frame_in_loss"] is False
    t2v = module.inputs({**videos[0], "mode": "t2v"})
    per_frame = (t2v["noise"] - t2v["input_latents"]).float().pow(2).mean(dim=(0, 1, 3, 4))
    assert bool((per_frame > 0.5).all())          # every frame noised, every frame a target

    # The mask: the i2v MSE does not read frame 0 of the prediction, t2v's reads every frame.
    prediction = torch.randn_like(i2v["input_latents"].float(), requires_grad=True)
    target = torch.randn_like(prediction)
    sample_mse(prediction, target, skip_first_frame=True).backward()
    assert torch.count_nonzero(prediction.grad[:, :, 0]) == 0 and torch.count_nonzero(prediction.grad[:, :, 1:]) > 0
    expected = (prediction[:, :, 1:] - target[:, :, 1:]).pow(2).mean()
    torch.testing.assert_close(sample_mse(prediction, target, skip_first_frame=True), expected)
    prediction.grad = None
    sample_mse(prediction, target).backward()
    assert torch.count_nonzero(prediction.grad[:, :, 0]) > 0


def test_a_mode_a_sample_cannot_train_in_is_refused(entries):
    videos, images = entries
    module = make_module()
    with pytest.raises(ValueError, match="cannot train t2i"):
        module(dict(videos[0], mode="t2i"))
    with pytest.raises(ValueError, match="cannot train i2v"):
        module(dict(images[0], mode="i2v"))
    with pytest.raises(ValueError, match="--objective diffsynth trains every sample i2v"):
        make_module(objective="diffsynth")(dict(videos[0], mode="t2v"))


def test_conditioned_and_unconditioned_samples_of_one_shape_share_one_forward(entries, monkeypatch):
    videos, _ = entries
    module = make_module()
    forwards = []
    original = batch_loss_module.dit_forward

    def recording(dit, latents, timesteps, context, runner, conditioned):
        forwards.append(list(conditioned))
        return original(dit, latents, timesteps, context, runner, conditioned)

    monkeypatch.setattr(batch_loss_module, "dit_forward", recording)
    modes = ["i2v", "t2v", "i2v"]
    torch.manual_seed(3)
    inputs = [module.inputs(dict(sample, mode=mode)) for sample, mode in zip(videos, modes)]
    ids = [100, 500, 900]
    together, each = batch_loss(module.pipe, inputs, module.blocks, ids)
    one_by_one = [batch_loss(module.pipe, [item], module.blocks, [i])[0] for item, i in zip(inputs, ids)]
    assert forwards[0] == [True, False, True] and len(forwards) == 4   # one forward for the batch of three
    torch.testing.assert_close(torch.stack(each), torch.stack(one_by_one), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(together, torch.stack(one_by_one).mean(), rtol=1e-5, atol=1e-6)


def mean_losses(module, samples, draws=20) -> float:
    total = 0.0
    for seed in range(draws):
        torch.manual_seed(seed)
        total += sum(float(module(dict(sample))) for sample in samples)
    return total / (draws * len(samples))


@pytest.mark.parametrize("objective", ["modes", "diffsynth"])
def test_an_images_loss_is_of_the_order_of_a_videos_unless_it_trains_diffsynths_zero_target(entries, objective):
    """With the loss unweighted, an image (t2i) and a video (i2v) lose alike; DiffSynth's objective gives the image
    a target of zero, and its loss is only what the model outputs at timestep 0 (about 0.3x a clip's, measured)."""
    videos, images = entries
    module = make_module(loss_weighting="none", objective=objective)
    with torch.no_grad():
        ratio = mean_losses(module, images) / mean_losses(module, videos)
    if objective == "modes":
        assert 0.6 < ratio < 1.6, ratio
    else:
        assert ratio < 0.5, ratio
