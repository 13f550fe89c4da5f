"""Which timesteps a training step draws (``--timestep_sampling``). Torch only, no diffsynth.

DiffSynth 1.1.8 draws a timestep *index* uniformly from ``[int(min_boundary * 1000), int(max_boundary * 1000))``
of its training schedule (Wan: 1000 noise levels ``sigma``, shifted by 5 towards high noise); ``diffsynth`` here is
exactly that draw, one ``torch.randint`` per sample. The other schemes draw a noise level ``sigma`` in [0, 1] from
a distribution of their own (by its inverse CDF from a uniform draw):

- ``uniform``: ``sigma = u``;
- ``shift``: ``sigma = S u / (1 + (S - 1) u)`` (``--timestep_shift S``; S > 1 favours high noise);
- ``logit_normal``: ``sigma = sigmoid(M + STD z)``, z standard normal (``--logit_mean M --logit_std STD``);
- ``sigmoid``: ``sigma = sigmoid(K z)`` (``--sigmoid_scale K``).

The boundaries keep the distribution's shape: its draw is mapped linearly into the noise levels the boundaries
allow (``sigma_range``), never clipped to the edges. The level is then trained at the nearest of the schedule's
1000 levels, so DiffSynth's ``add_noise`` and ``training_weight`` (which look the nearest one up) see it as they
see their own draws. ``strata`` N > 1 draws each group of N uniforms one from each of N equal parts of [0, 1),
shuffled, so that every N draws cover the range (less variance than independent draws on small batches).
"""

from __future__ import annotations


import torch

SCHEMES = ("diffsynth", "uniform", "shift", "logit_normal", "sigmoid")
WEIGHTINGS = ("diffsynth", "none")
TRAIN_STEPS = 1000   # DiffSynth's training schedule: the boundaries are fractions of these indices


def boundary_ids(min_boundary: float, max_boundary: float, steps: int = TRAIN_STEPS) -> tuple[int, int]:
    """The index range [low, high) that DiffSynth draws from for these boundaries."""
    return int(min_boundary * steps), int(max_boundary * steps)


def shifted(x, shift: float):
    """The flow-matching shift ``S x / (1 + (S - 1) x)`` (DiffSynth's scheduler applies it with S = 5)."""
    return shift * x / (1 + (shift - 1) * x)


def sigma_range(min_boundary: float, max_boundary: float, schedule_shift: float) -> tuple[float, float]:
    """(lowest, highest) noise level the boundaries allow: index fraction b is ``shifted(1 - b)`` in the schedule
    (index 0 is pure noise)."""
    return shifted(1.0 - max_boundary, schedule_shift), shifted(1.0 - min_boundary, schedule_shift)


def sigma_from_uniform(u: torch.Tensor, scheme: str, *, shift: float = 5.0, logit_mean: float = 0.0,
                       logit_std: float = 1.0, sigmoid_scale: float = 1.0) -> torch.Tensor:
    """The scheme's noise level in [0, 1] for uniform draws ``u`` in [0, 1) (its inverse CDF)."""
    u = u.double()
    if scheme == "uniform":
        return u
    if scheme == "shift":
        return shifted(u, shift)
    if scheme in ("logit_normal", "sigmoid"):
        mean, std = (logit_mean, logit_std) if scheme == "logit_normal" else (0.0, sigmoid_scale)
        # ndtri(0) is -inf: sigmoid(-inf) = 0, a valid level.
        return torch.sigmoid(mean + std * torch.special.ndtri(u))
    raise ValueError(f"unknown timestep sampling scheme {scheme!r}; one of {', '.join(SCHEMES)}")


def scheme_cdf(sigma: torch.Tensor, scheme: str, *, shift: float = 5.0, logit_mean: float = 0.0,
               logit_std: float = 1.0, sigmoid_scale: float = 1.0) -> torch.Tensor:
    """P(level <= sigma) of the scheme over [0, 1] (the analytic distribution the draws must follow)."""
    s = sigma.double().clamp(0.0, 1.0)
    if scheme == "uniform":
        return s
    if scheme == "shift":
        return s / (shift - (shift - 1) * s)
    if scheme in ("logit_normal", "sigmoid"):
        mean, std = (logit_mean, logit_std) if scheme == "logit_normal" else (0.0, sigmoid_scale)
        return torch.special.ndtr((torch.logit(s) - mean) / std)
    raise ValueError(f"unknown timestep sampling scheme {scheme!r}; one of {', '.join(SCHEMES)}")


def nearest_ids(sigmas: torch.Tensor, levels: torch.Tensor, low: int, high: int) -> torch.Tensor:
    """Index of the schedule level nearest to each of ``levels`` among ``sigmas[low:high]`` (``sigmas`` falls
    with the index, as DiffSynth's does)."""
    allowed = sigmas[low:high].double()
    # searchsorted wants ascending values: the cell edges of the reversed levels.
    ascending = allowed.flip(0)
    edges = (ascending[1:] + ascending[:-1]) / 2
    position = torch.searchsorted(edges, levels.double(), right=False)
    return (high - 1 - position).long()


class TimestepSampler:
    """Draws each training sample's timestep index; ``draw`` is called once per DiT forward with its samples.

    ``diffsynth`` without strata: one ``torch.randint`` per sample, as DiffSynth does (same random stream, so the
    same run bit for bit). Everything draws from torch's global generator, which checkpoints save and restore.
    A stratified group left unfinished when a run stops is not saved: a resumed run starts a new group.
    """

    def __init__(self, scheme: str = "diffsynth", *, shift: float = 5.0, logit_mean: float = 0.0,
                 logit_std: float = 1.0, sigmoid_scale: float = 1.0, strata: int = 1, schedule_shift: float = 5.0):
        if scheme not in SCHEMES:
            raise ValueError(f"unknown timestep sampling scheme {scheme!r}; one of {', '.join(SCHEMES)}")
        if int(strata) < 1:
            raise ValueError(f"strata must be 1 or more, got {strata!r}")
        self.scheme = scheme
        self.params = {"shift": float(shift), "logit_mean": float(logit_mean), "logit_std": float(logit_std),
                       "sigmoid_scale": float(sigmoid_scale)}
        self.strata = int(strata)
        self.schedule_shift = float(schedule_shift)
        self._pending: list[float] = []   # the rest of the current stratified group

    @property
    def is_diffsynth_default(self) -> bool:
        return self.scheme == "diffsynth" and self.strata == 1

    def uniforms(self, count: int) -> torch.Tensor:
        """``count`` draws in [0, 1): independent, or the next ones of stratified groups of ``strata``."""
        if self.strata == 1:
            return torch.rand(count, dtype=torch.float64)
        out = []
        while len(out) < count:
            if not self._pending:
                order = torch.randperm(self.strata)
                jitter = torch.rand(self.strata, dtype=torch.float64)
                self._pending = ((order.double() + jitter) / self.strata).tolist()
            out.append(self._pending.pop())
        return torch.tensor(out, dtype=torch.float64)

    def draw_ids(self, sigmas: torch.Tensor, bounds: list[tuple[float, float]]) -> list[int]:
        """One index per sample into the schedule ``sigmas`` (1000 levels, falling), each within its sample's
        (min_boundary, max_boundary)."""
        steps = len(sigmas)
        if self.is_diffsynth_default:
            ids = []
            for low_b, high_b in bounds:
                low, high = boundary_ids(low_b, high_b, steps)
                ids.append(int(torch.randint(low, high, (1,))))
            return ids
        u = self.uniforms(len(bounds))
        ids = torch.empty(len(bounds), dtype=torch.long)
        groups: dict[tuple[float, float], list[int]] = {}
        for k, pair in enumerate(bounds):
            groups.setdefault((float(pair[0]), float(pair[1])), []).append(k)
        for (low_b, high_b), where in groups.items():
            low, high = boundary_ids(low_b, high_b, steps)
            index = torch.tensor(where, dtype=torch.long)
            if self.scheme == "diffsynth":   # stratified index draw over [low, high)
                ids[index] = (low + torch.floor(u[index] * (high - low)).long()).clamp(max=high - 1)
                continue
            lo, hi = sigma_range(low_b, high_b, self.schedule_shift)
            levels = lo + (hi - lo) * sigma_from_uniform(u[index], self.scheme, **self.params)
            ids[index] = nearest_ids(sigmas, levels, low, high)
        return ids.tolist()


def sampler_from_options(options, schedule_shift: float) -> TimestepSampler:
    """The run's sampler from its options (``--timestep_sampling`` and the scheme's parameters)."""
    return TimestepSampler(options.timestep_sampling, shift=options.timestep_shift, logit_mean=options.logit_mean,
                           logit_std=options.logit_std, sigmoid_scale=options.sigmoid_scale,
                           strata=options.timestep_strata, schedule_shift=schedule_shift)


class DrawLog:
    """The (timestep, loss, mode) of each sample trained since the loop last took them, for the per-rank history.

    Kept as tensors (no device sync per forward); ``take`` turns them into numbers once per step. Bounded: a
    caller that never takes them (DiffSynth's own loop) keeps only the newest ``MAX`` forwards."""

    MAX = 256

    def __init__(self):
        self._pending: list[tuple[torch.Tensor, torch.Tensor, list[str]]] = []

    def add(self, timesteps: torch.Tensor, losses: list[torch.Tensor], modes: list[str],
            shapes: list[list[int]] | None = None) -> None:
        """One forward's draws; ``shapes``: each sample's [frames, height, width] in pixels."""
        self._pending.append((timesteps.detach().reshape(-1), torch.stack([loss.detach().reshape(()) for loss
                                                                            in losses]), list(modes),
                              list(shapes) if shapes is not None else [None] * len(modes)))
        del self._pending[:-self.MAX]

    def take(self, with_shapes: bool = False) -> list[tuple]:
        """Every (timestep, loss, mode) since the last take, in order (with ``with_shapes``: (timestep, loss,
        mode, [frames, height, width])); the log is then empty."""
        draws = []
        for timesteps, losses, modes, shapes in self._pending:
            columns = (timesteps.float().cpu().tolist(), losses.float().cpu().tolist(), modes)
            draws += zip(*columns, shapes) if with_shapes else zip(*columns)
        self._pending = []
        return draws
