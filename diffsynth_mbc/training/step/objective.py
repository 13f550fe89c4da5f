"""What each sample trains (``--objective``, ``--i2v_probability``). Pure Python: no torch, no diffsynth.

Wan2.2-TI2V-5B conditions on a clean first latent frame: that frame is the VAE latent of the first image, its
tokens get timestep 0 and its flow-matching target ``noise - x0`` is zero. DiffSynth 1.1.8 conditions every
training sample that way and keeps frame 0 in the MSE, so an image (one latent frame: all of it the condition)
trains towards a target of zero, and frame 0 of a clip dilutes the rest. Here each sample trains in one mode:

- ``t2i``: an image, with no condition: every token noised at the drawn timestep, the target everywhere;
- ``i2v``: a video conditioned on its first frame, frame 0 left out of the loss (the mean over the other
  frames' elements);
- ``t2v``: a video with no condition: every frame noised, every frame in the loss.

Images are always ``t2i``; a video is ``i2v`` with probability ``--i2v_probability`` (default 1.0), else ``t2v``.
The choice is a pure function of (seed, rank, epoch, batch in the epoch, place in the batch), as caption dropout's
is: no random number generator is drawn from, so the noise and timesteps do not move with it, and a resumed run
chooses exactly what the uninterrupted run chose. ``--objective diffsynth`` trains DiffSynth 1.1.8's objective bit
for bit instead: every sample conditioned on its first frame (``i2v``), frame 0 in the loss.
"""

from __future__ import annotations

from diffsynth_mbc.data.sample_draws import draw

T2I, I2V, T2V = "t2i", "i2v", "t2v"
MODES = (T2I, I2V, T2V)
OBJECTIVES = ("modes", "diffsynth")


def check_objective(objective: str, i2v_probability: float) -> None:
    if objective not in OBJECTIVES:
        raise ValueError(f"--objective must be one of {', '.join(OBJECTIVES)}, got {objective!r}")
    if not 0.0 <= i2v_probability <= 1.0:
        raise ValueError(f"--i2v_probability must be between 0 and 1, got {i2v_probability!r}")


def mode_of(objective: str, i2v_probability: float, is_image: bool, video_draw) -> str:
    """The mode of one sample. ``video_draw`` is called (for a number in [0, 1)) only when the choice needs it: a
    video under ``modes`` with a probability strictly between 0 and 1."""
    if objective == "diffsynth":
        return I2V
    if is_image:
        return T2I
    if i2v_probability >= 1.0:
        return I2V
    if i2v_probability <= 0.0:
        return T2V
    return I2V if video_draw() < i2v_probability else T2V


def training_mode(objective: str, i2v_probability: float, is_image: bool, seed: int, rank: int, epoch: int,
                  batch: int, place: int) -> str:
    """The mode of the sample at ``place`` of the rank's ``batch``-th batch of ``epoch``."""
    return mode_of(objective, i2v_probability, is_image,
                   lambda: draw("i2v", seed, rank, epoch, batch, place))


def validation_mode(objective: str, i2v_probability: float, is_image: bool, seed: int, index: int) -> str:
    """The mode of validation sample ``index``: the same at every validation of the run, on any number of ranks."""
    return mode_of(objective, i2v_probability, is_image, lambda: draw("validation-i2v", seed, index))


def default_mode(objective: str, is_image: bool) -> str:
    """A sample's mode when nothing chose one (DiffSynth's own loop, a direct call): its kind's first choice."""
    return mode_of(objective, 1.0, is_image, None)


def check_mode(objective: str, mode: str, is_image: bool) -> None:
    """Refuse a mode the sample cannot train in: ``t2i`` is for one latent frame, ``i2v``/``t2v`` for clips, and
    ``--objective diffsynth`` conditions everything."""
    if mode not in MODES:
        raise ValueError(f"unknown training mode {mode!r}; one of {', '.join(MODES)}")
    if objective == "diffsynth":
        if mode != I2V:
            raise ValueError(f"--objective diffsynth trains every sample i2v, not {mode}")
    elif (mode == T2I) != is_image:
        kind = "an image (one latent frame)" if is_image else "a clip"
        raise ValueError(f"a sample of {kind} cannot train {mode}")


def is_conditioned(mode: str) -> bool:
    """Whether the sample's first latent frame is the clean condition (timestep 0 on its tokens)."""
    return mode == I2V


def first_frame_in_loss(objective: str) -> bool:
    """Whether a conditioned sample's frame 0 (target zero) counts in its loss: only DiffSynth's objective."""
    return objective == "diffsynth"


def modes_per_epoch(objective: str, i2v_probability: float, video_samples: int, image_samples: int) -> dict:
    """How many samples of each mode an epoch trains (``i2v``/``t2v`` expected, rounded, when the choice is drawn)."""
    if objective == "diffsynth":
        return {T2I: 0, I2V: video_samples + image_samples, T2V: 0}
    i2v = round(video_samples * i2v_probability)
    return {T2I: image_samples, I2V: i2v, T2V: video_samples - i2v}


def describe_modes(objective: str, i2v_probability: float, counts: dict) -> str:
    """One line: ``modes per epoch: 90,180 t2i (images) + 80,000 i2v (videos, --i2v_probability 1)``."""
    if objective == "diffsynth":
        return (f"modes per epoch: {counts[I2V]:,} i2v (--objective diffsynth: every sample conditioned on its "
                "first frame, frame 0 in the loss)")
    about = "about " if 0.0 < i2v_probability < 1.0 else ""
    parts = [f"{counts[T2I]:,} t2i (images)"] if counts[T2I] else []
    parts += [f"{about}{counts[mode]:,} {mode}" for mode in (I2V, T2V) if counts[mode]]
    return f"modes per epoch: {' + '.join(parts) or 'none'} (videos: --i2v_probability {i2v_probability:g})"
