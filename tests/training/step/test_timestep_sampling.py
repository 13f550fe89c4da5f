"""--timestep_sampling: 100K draws of each scheme follow its analytic distribution (Kolmogorov-Smirnov), the
boundaries keep the distribution's shape, strata cover the range, the default is DiffSynth's own draw."""

from __future__ import annotations

import math

import pytest
import torch

from diffsynth_mbc.training.step.timestep_sampling import (SCHEMES, TimestepSampler, nearest_ids, scheme_cdf, shifted,
                                                           sigma_from_uniform, sigma_range)

DRAWS = 100_000
ALPHA = 0.001
PARAMS = {"uniform": {}, "shift": {"shift": 3.0}, "logit_normal": {"logit_mean": 0.4, "logit_std": 0.8},
          "sigmoid": {"sigmoid_scale": 1.7}}
# The Wan training schedule as DiffSynth 1.1.8 builds it: FlowMatchScheduler(shift=5, sigma_min=0,
# extra_one_step=True).set_timesteps(1000, training=True).
SIGMAS = shifted(torch.linspace(1.0, 0.0, 1001)[:-1], 5.0)


def kolmogorov_p(statistic: float, n: int) -> float:
    """P(D >= statistic) for n draws of a continuous distribution (scipy's kstest where installed, else the
    asymptotic Kolmogorov distribution with Stephens' small-sample correction)."""
    try:
        from scipy.stats import kstwo
    except ImportError:
        root = math.sqrt(n)
        lam = (root + 0.12 + 0.11 / root) * statistic
        return max(0.0, min(1.0, 2 * sum((-1) ** (k - 1) * math.exp(-2 * k * k * lam * lam) for k in range(1, 101))))
    return float(kstwo.sf(statistic, n))


def ks_continuous(draws: torch.Tensor, cdf) -> float:
    """Largest distance between the draws' empirical CDF and ``cdf``."""
    x, _ = torch.sort(draws.double())
    n = len(x)
    expected = cdf(x)
    upper = (torch.arange(1, n + 1, dtype=torch.float64) / n - expected).max()
    lower = (expected - torch.arange(0, n, dtype=torch.float64) / n).max()
    return float(max(upper, lower))


def ks_on_the_schedule(ids: list[int], cdf, low: int, high: int) -> float:
    """Distance between the trained levels' empirical CDF and the exact one of ``cdf`` snapped to the nearest
    schedule level among ids [low, high): P(level <= sigmas[i]) = cdf(edge between levels i - 1 and i)."""
    counts = torch.bincount(torch.tensor(ids), minlength=len(SIGMAS)).double()
    assert counts[:low].sum() == 0 and counts[high:].sum() == 0, "a draw left the boundaries"
    # levels fall with the index: P(level <= sigmas[i]) = P(id >= i)
    empirical = counts.flip(0).cumsum(0).flip(0)[low:high] / len(ids)
    edges = (SIGMAS[low:high - 1].double() + SIGMAS[low + 1:high].double()) / 2
    exact = torch.cat([torch.ones(1, dtype=torch.float64), cdf(edges)])
    return float((empirical - exact).abs().max())


def critical(n: int) -> float:
    """The D above which the KS test rejects at ALPHA (conservative for a discrete distribution)."""
    return math.sqrt(-math.log(ALPHA / 2) / 2) / math.sqrt(n)


def test_the_schedule_here_is_diffsynths():
    from diffsynth.pipelines.wan_video_new import WanVideoPipeline

    pipe = WanVideoPipeline(device="cpu", torch_dtype=torch.float32)
    pipe.scheduler.set_timesteps(1000, training=True)
    torch.testing.assert_close(pipe.scheduler.sigmas, SIGMAS, rtol=0, atol=1e-6)
    assert pipe.scheduler.shift == 5


@pytest.mark.parametrize("scheme", [s for s in SCHEMES if s != "diffsynth"])
def test_100k_draws_follow_the_schemes_distribution(scheme):
    torch.manual_seed(1)
    draws = sigma_from_uniform(torch.rand(DRAWS, dtype=torch.float64), scheme, **PARAMS[scheme])
    statistic = ks_continuous(draws, lambda s: scheme_cdf(s, scheme, **PARAMS[scheme]))
    assert kolmogorov_p(statistic, DRAWS) > ALPHA, (scheme, statistic)
    # ... and what trains, the nearest of the schedule's 1000 levels, follows it snapped to those levels.
    torch.manual_seed(2)
    ids = TimestepSampler(scheme, **PARAMS[scheme]).draw_ids(SIGMAS, [(0.0, 1.0)] * DRAWS)
    assert ks_on_the_schedule(ids, lambda s: scheme_cdf(s, scheme, **PARAMS[scheme]), 0, 1000) < critical(DRAWS)


def test_the_test_tells_one_scheme_from_another():
    torch.manual_seed(3)
    draws = sigma_from_uniform(torch.rand(DRAWS, dtype=torch.float64), "shift", shift=3.0)
    statistic = ks_continuous(draws, lambda s: scheme_cdf(s, "shift", shift=3.3))
    assert kolmogorov_p(statistic, DRAWS) < ALPHA
    ids = TimestepSampler("logit_normal", logit_mean=0.4).draw_ids(SIGMAS, [(0.0, 1.0)] * DRAWS)
    assert ks_on_the_schedule(ids, lambda s: scheme_cdf(s, "logit_normal", logit_mean=0.5), 0, 1000) > critical(DRAWS)


def test_diffsynth_is_a_uniform_index_drawn_as_diffsynth_draws_it():
    torch.manual_seed(4)
    ids = TimestepSampler().draw_ids(SIGMAS, [(0.25, 0.75)] * 2000)
    torch.manual_seed(4)
    theirs = [int(torch.randint(250, 750, (1,))) for _ in range(2000)]   # WanVideoPipeline.training_loss's draw
    assert ids == theirs
    many = TimestepSampler().draw_ids(SIGMAS, [(0.25, 0.75)] * DRAWS)
    counts = torch.bincount(torch.tensor(many), minlength=1000)[250:750].double()
    empirical = counts.cumsum(0) / DRAWS
    exact = torch.arange(1, 501, dtype=torch.float64) / 500
    assert float((empirical - exact).abs().max()) < critical(DRAWS)


@pytest.mark.parametrize("scheme", ["uniform", "logit_normal", "shift"])
def test_the_boundaries_keep_the_shape_rescaled_not_clipped(scheme):
    low_b, high_b = 0.2, 0.7
    lo, hi = sigma_range(low_b, high_b, 5.0)
    assert lo == pytest.approx(float(SIGMAS[700]), abs=1e-6) and hi == pytest.approx(float(SIGMAS[200]), abs=1e-6)
    torch.manual_seed(5)
    ids = TimestepSampler(scheme, **PARAMS[scheme]).draw_ids(SIGMAS, [(low_b, high_b)] * DRAWS)
    rescaled = lambda s: scheme_cdf((s - lo) / (hi - lo), scheme, **PARAMS[scheme])   # noqa: E731
    assert ks_on_the_schedule(ids, rescaled, 200, 700) < critical(DRAWS)
    # No pile at the edges: the first and last allowed levels get what the shape gives them, not the tails.
    counts = torch.bincount(torch.tensor(ids), minlength=1000).double() / DRAWS
    for edge, inner in ((200, 201), (699, 698)):
        assert counts[edge] < 3 * counts[inner] + 5e-4, (edge, float(counts[edge]), float(counts[inner]))


def test_strata_cover_the_range_in_every_group_and_keep_the_distribution():
    sampler = TimestepSampler("logit_normal", strata=8)
    torch.manual_seed(6)
    u = torch.cat([sampler.uniforms(3) for _ in range(8)])   # groups run across calls: 24 draws, 3 groups
    for group in u.reshape(3, 8):
        assert sorted(int(x * 8) for x in group) == list(range(8))
    ids = sampler.draw_ids(SIGMAS, [(0.0, 1.0)] * (DRAWS // 8 * 8))
    assert ks_on_the_schedule(ids, lambda s: scheme_cdf(s, "logit_normal"), 0, 1000) < critical(len(ids))
    stratified_index = TimestepSampler("diffsynth", strata=4).draw_ids(SIGMAS, [(0.0, 1.0)] * 400)
    for group in torch.tensor(stratified_index).reshape(100, 4):
        assert sorted(int(i) // 250 for i in group) == [0, 1, 2, 3]


def test_nearest_ids_is_the_schedulers_own_nearest_level():
    levels = torch.rand(5000, dtype=torch.float64)
    ids = nearest_ids(SIGMAS, levels, 0, 1000)
    expected = (SIGMAS.double()[None, :] - levels[:, None]).abs().argmin(dim=1)
    assert torch.equal(ids, expected)
    clipped = nearest_ids(SIGMAS, levels, 100, 300)
    assert int(clipped.min()) >= 100 and int(clipped.max()) <= 299


def test_unknown_scheme_and_strata_are_refused():
    with pytest.raises(ValueError, match="beta"):
        TimestepSampler("beta")
    with pytest.raises(ValueError, match="strata"):
        TimestepSampler("uniform", strata=0)
