"""The tiny model trained through the Python API with --timestep_sampling / --loss_weighting: with --objective
diffsynth the default is DiffSynth's loss bit for bit, a scheme trains at the timesteps it draws, and every draw is
logged with its loss and mode."""

from __future__ import annotations

import pytest
import torch

from diffsynth_mbc.training.options import resolve_options
from diffsynth_mbc.training.step import batch_loss as batch_loss_module
from diffsynth_mbc.training.step.timestep_sampling import TimestepSampler, sampler_from_options
from tiny_step import make_module

REQUIRED = ["--dataset_base_path", "data", "--dataset_metadata_path", "data/metadata.csv"]


def diffsynth_loss(module, sample, seed):
    torch.manual_seed(seed)
    inputs = module.inputs_from_cache(dict(sample))
    models = {name: getattr(module.pipe, name) for name in module.pipe.in_iteration_models}
    return module.pipe.training_loss(**models, **inputs)


def test_the_default_timestep_options_with_objective_diffsynth_train_diffsynths_loss_bit_for_bit(entries):
    videos, images = entries
    options = resolve_options(REQUIRED + ["--objective", "diffsynth"])
    module = make_module(objective=options.objective)
    module.timestep_sampler = sampler_from_options(options, module.pipe.scheduler.shift)
    module.loss_weighting = options.loss_weighting
    for sample in (videos[0], images[0]):
        torch.manual_seed(7)
        ours = module(dict(sample))
        theirs = diffsynth_loss(module, sample, 7)
        assert torch.equal(ours, theirs.reshape(ours.shape)), (float(ours), float(theirs))


def test_loss_weighting_none_is_the_mse_without_diffsynths_weight(entries):
    videos, _ = entries
    module = make_module(loss_weighting="none", objective="diffsynth")
    torch.manual_seed(7)
    ours = module(dict(videos[1]))
    (timestep, logged, mode), = module.draws.take()
    assert mode == "i2v"
    weight = module.pipe.scheduler.training_weight(torch.tensor(timestep))
    assert float(weight) != pytest.approx(1.0)           # the check below could not tell them apart otherwise
    theirs = diffsynth_loss(module, videos[1], 7)
    torch.testing.assert_close(ours * weight, theirs.reshape(ours.shape), rtol=1e-6, atol=0)
    assert logged == pytest.approx(float(ours), rel=1e-6)


def test_a_scheme_trains_at_the_timesteps_it_draws_and_logs_each_with_its_loss(entries, monkeypatch):
    videos, images = entries
    module = make_module(max_timestep_boundary=0.6, min_timestep_boundary=0.3,
                         timestep_sampler=TimestepSampler("logit_normal", logit_mean=0.5, strata=3))
    seen = []
    original = batch_loss_module.dit_forward

    def recording(dit, latents, timesteps, *args, **kwargs):
        seen.extend(timesteps.float().tolist())
        return original(dit, latents, timesteps, *args, **kwargs)

    monkeypatch.setattr(batch_loss_module, "dit_forward", recording)
    torch.manual_seed(11)
    loss = module([dict(s) for s in images] + [dict(videos[0])])   # two shape groups: 3 images, 1 video
    logged = module.draws.take()
    assert [t for t, _, _ in logged] == pytest.approx(seen) and len(logged) == 4
    assert [mode for _, _, mode in logged] == ["t2i"] * 3 + ["i2v"]
    timesteps = module.pipe.scheduler.timesteps
    allowed = {round(float(t), 3) for t in timesteps[300:600]}
    assert all(round(t, 3) in allowed for t in seen), seen
    image_mean = sum(value for _, value, _ in logged[:3]) / 3
    assert float(loss) == pytest.approx((image_mean * 3 + logged[3][1]) / 4, rel=1e-5)
    assert module.draws.take() == []          # taken once


def test_the_draw_log_stays_bounded_when_nobody_takes_it(entries):
    videos, _ = entries
    module = make_module()
    module.draws.MAX = 3
    for _ in range(5):
        module(dict(videos[0]))
    assert len(module.draws.take()) == 3
