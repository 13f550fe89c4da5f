"""Which frames of a clip train: ``--frame_sampling``, ``--source_fps`` and ``--short_clips``. No torch.

A clip of ``available`` frames at ``fps`` is first put on a timeline: its own frames, or, with
``--source_fps F``, the frames at times 0, 1/F, 2/F, ... before the clip ends, each the nearest source
frame (so a 25 fps and a 30 fps clip move at one speed; a frame repeats where F is above the clip's rate).
From that timeline ``num_frames`` positions are taken:

- ``head`` (default, DiffSynth's): the first ``num_frames``;
- ``uniform``: ``num_frames`` spread evenly from the first frame to the last (the whole clip, sped up);
- ``random_window``: ``num_frames`` consecutive ones from a start drawn per (seed, epoch, row): another
  stretch of a long clip every epoch, the same on every rank and on resume.

A timeline shorter than ``num_frames`` follows ``--short_clips``:

- ``shorten`` (default, DiffSynth's): its longest 4k+1 leading frames (a shorter latent);
- ``loop``: the timeline again from its start until ``num_frames`` are taken;
- ``skip``: the row is bad media (``ShortClip``): replaced by the next row and counted like an undecodable
  file (``--max_bad_media_fraction``), never a crash mid-run. ``python -m diffsynth_mbc.convert --probe
  --reject_short`` rejects such clips before training, with the reason.

Every position is a source frame index; a reader decodes up to the last one and keeps only those.

Wan2.2-TI2V-5B generates 24 fps (``MODEL_FPS``): a LoRA trained on 29.97 fps clips at their own rate learns motion
that plays at 0.80x speed in its 24 fps output, and 15 fps clips at 1.6x. ``describe_frame_rates`` says, for the plan
and the doctor, which rates the catalogue holds and what the run does with them.
"""

from __future__ import annotations

import math
import random
from dataclasses import asdict, dataclass


FRAME_SAMPLING = ("head", "uniform", "random_window")
SHORT_CLIPS = ("shorten", "loop", "skip")
MODEL_FPS = 24.0   # the frame rate Wan2.2-TI2V-5B generates at
RATES_NAMED = 4    # the most common frame rates a description names; the rest are counted together


def frames_to_use(available: int, wanted: int, division: int = 4, remainder: int = 1) -> int:
    """How many leading frames DiffSynth's VideoDataset takes from a clip of ``available`` frames."""
    count = wanted
    if available < wanted:
        count = available
        while count > 1 and count % division != remainder:
            count -= 1
    return count


class ShortClip(ValueError):
    """The clip has fewer frames than a run with ``--short_clips skip`` trains on; the message says how many."""


@dataclass(frozen=True)
class FrameSelection:
    """How frames are picked from each clip; the default picks what DiffSynth picks."""
    sampling: str = "head"
    source_fps: float | None = None
    short_clips: str = "shorten"
    seed: int = 0

    def __post_init__(self):
        if self.sampling not in FRAME_SAMPLING:
            raise ValueError(f"--frame_sampling must be one of {', '.join(FRAME_SAMPLING)}, got {self.sampling!r}")
        if self.short_clips not in SHORT_CLIPS:
            raise ValueError(f"--short_clips must be one of {', '.join(SHORT_CLIPS)}, got {self.short_clips!r}")
        if self.source_fps is not None and not (math.isfinite(self.source_fps) and self.source_fps > 0):
            raise ValueError(f"--source_fps must be a finite number above 0, got {self.source_fps!r}")

    @property
    def is_default(self) -> bool:
        """DiffSynth's own selection: the readers take their original path, frame for frame."""
        return self.sampling == "head" and self.source_fps is None and self.short_clips == "shorten"

    @property
    def per_epoch(self) -> bool:
        """The frames change from epoch to epoch, so no latent cache can hold them."""
        return self.sampling == "random_window"

    def settings(self) -> dict | None:
        """What a latent cache and a checkpoint record of it: None for the default (caches and checkpoints made
        before these options existed match it)."""
        if self.is_default:
            return None
        return {key: value for key, value in asdict(self).items() if key != "seed"}


def frame_selection_from(options) -> FrameSelection:
    """The selection the options ask for: the training's ``TrainOptions`` or the options of ``python -m
    diffsynth_mbc.cache``, which both carry --frame_sampling, --source_fps, --short_clips and --seed."""
    return FrameSelection(sampling=options.frame_sampling, source_fps=options.source_fps,
                          short_clips=options.short_clips, seed=options.seed)


def frame_arguments(options) -> list[str]:
    """The frame flags of ``options`` that differ from the default, for commands that take the same flags."""
    selection = frame_selection_from(options)
    arguments = []
    if selection.sampling != "head":
        arguments += ["--frame_sampling", selection.sampling]
    if selection.source_fps is not None:
        arguments += ["--source_fps", f"{selection.source_fps:g}"]
    if selection.short_clips != "shorten":
        arguments += ["--short_clips", selection.short_clips]
    return arguments


def timeline(available: int, fps: float | None, source_fps: float | None) -> list[int]:
    """Source frame indices of the clip's timeline (see the module docstring). Without ``source_fps`` (or
    without a known clip rate) that is every frame."""
    if source_fps is None or not fps or available < 1:
        return list(range(available))
    step = fps / source_fps                       # source frames per timeline frame
    count = max(1, math.ceil(available / step - 1e-9))   # timeline frames before the clip ends
    return [min(available - 1, math.floor(j * step + 0.5 + 1e-9)) for j in range(count)]


def window_start(span: int, seed: int, epoch: int, sample: int) -> int:
    """A start in [0, span], the same for one (seed, epoch, sample) on every rank and process."""
    return random.Random(f"mbc-window:{seed}:{epoch}:{sample}").randint(0, span)


def select_frames(available: int, fps: float | None, wanted: int, selection: FrameSelection, *, epoch: int = 0,
                  sample: int = 0, division: int = 4, remainder: int = 1) -> list[int]:
    """The source frame indices that train, in order (a frame may repeat: --source_fps above the clip's rate,
    or --short_clips loop). ``sample`` names the sample within its epoch (for random_window's draw).
    Raises ShortClip for a short clip under ``--short_clips skip``."""
    if available < 1:
        raise ShortClip("the clip has no frames")
    line = timeline(available, fps, selection.source_fps)
    resampled = f" at --source_fps {selection.source_fps:g}" if selection.source_fps is not None else ""
    if len(line) < wanted:
        if selection.short_clips == "skip":
            raise ShortClip(f"the clip has {len(line)} frames{resampled}, fewer than the {wanted} that train "
                            "(--short_clips skip)")
        if selection.short_clips == "loop":
            return [line[k % len(line)] for k in range(wanted)]
        return line[:frames_to_use(len(line), wanted, division, remainder)]
    if selection.sampling == "uniform" and wanted > 1:
        last = len(line) - 1
        return [line[math.floor(k * last / (wanted - 1) + 0.5)] for k in range(wanted)]
    start = 0
    if selection.sampling == "random_window":
        start = window_start(len(line) - wanted, selection.seed, epoch, sample)
    return line[start:start + wanted]


def frames_needed(wanted: int, fps: float | None, source_fps: float | None) -> int:
    """Source frames a clip needs so that its timeline holds ``wanted`` frames (for convert's --reject_short)."""
    if source_fps is None or not fps:
        return wanted
    step = fps / source_fps
    available = max(1, math.floor((wanted - 1) * step))
    while len(timeline(available, fps, source_fps)) < wanted:
        available += 1
    return available


def describe_frame_rates(rates: dict, unknown: int, source_fps: float | None, num_frames: int) -> str | None:
    """One line for the plan and the doctor: the clips' frame rates (``rates``: fps -> clips, from the metadata's fps
    column; ``unknown``: clips without one) and what the run does with them, e.g. ``frame rates: clips at 29.97 fps
    (78,112) and 25 fps (1,888) put on the 24 fps timeline (--source_fps 24): 17 frames span 0.67 s``. None without
    clips."""
    if not rates and not unknown:
        return None
    unknown_note = (f"; {unknown:,} clip(s) of no recorded rate (python -m diffsynth_mbc.convert --probe records "
                    "each clip's)" if rates and unknown else "")
    if source_fps is not None:
        listed = f"clips at {_rates_listed(rates)}" if rates else f"{unknown:,} clips (rates not in the metadata)"
        played = (f" (Wan2.2-TI2V-5B generates {MODEL_FPS:g} fps: their motion plays at {MODEL_FPS / source_fps:.2f}x "
                  "speed there)" if abs(source_fps - MODEL_FPS) > 1e-6 else "")
        return (f"frame rates: {listed} put on the {source_fps:g} fps timeline (--source_fps {source_fps:g}): "
                f"{num_frames} frames span {(num_frames - 1) / source_fps:.2f} s{played}{unknown_note}")
    advice = f"--source_fps {MODEL_FPS:g} puts them on the timeline of Wan2.2-TI2V-5B, which generates {MODEL_FPS:g} fps"
    if not rates:
        return (f"frame rates: not in the metadata for {unknown:,} clips (python -m diffsynth_mbc.convert --probe "
                f"records them); each trains at its own rate (no --source_fps); {advice}")
    named = _most_common(rates)
    spans = ", ".join(f"{(num_frames - 1) / fps:.2f} s at {fps:g} fps" for fps, _ in named)
    speeds = ", ".join(f"{MODEL_FPS / fps:.2f}x ({fps:g} fps)" for fps, _ in named)
    return (f"frame rates: clips at {_rates_listed(rates)} train at their own rates (no --source_fps): {num_frames} "
            f"frames span {spans}; at {MODEL_FPS:g} fps their motion plays at {speeds} speed; {advice}{unknown_note}")


def rates_off_the_model(rates: dict, source_fps: float | None, tolerance: float = 0.02) -> bool:
    """Whether the clips train at a rate more than ``tolerance`` away from the model's 24 fps (motion sped up or slowed
    in what the LoRA learns)."""
    used = [source_fps] if source_fps is not None else list(rates)
    return any(abs(fps / MODEL_FPS - 1) > tolerance for fps in used)


def _most_common(rates: dict) -> list:
    return sorted(rates.items(), key=lambda item: (-item[1], item[0]))[:RATES_NAMED]


def _rates_listed(rates: dict) -> str:
    named = [f"{fps:g} fps ({clips:,})" for fps, clips in _most_common(rates)]
    rest = sorted(rates.items(), key=lambda item: (-item[1], item[0]))[RATES_NAMED:]
    if rest:
        named.append(f"{len(rest)} other rates ({sum(clips for _, clips in rest):,})")
    return named[0] if len(named) == 1 else ", ".join(named[:-1]) + " and " + named[-1]
