"""``--resolution_stages WxH[xF]:SHARE[,...]``: most of the optimizer steps at a lower resolution, the last ones at
``--width x --height`` (``--num_frames``). Pure: no torch.

Stage ``k`` trains the ``SHARE`` of the run's optimizer steps after the stages before it, at the pixel area ``W x H``
(and ``F`` frames where given); what the shares leave trains at the configured size. The boundaries fall on exact
optimizer steps (``boundaries``: the same on every rank, from the plan's total), so the learning-rate schedule runs
across the stages as one and a resume anywhere knows its stage from its step. A batch's shape at a stage
(``stage_shape``): under ``--buckets aspect`` its bucket (the nearest aspect at the configured area) scaled to the
stage's area, each side to a multiple of 32, so every stage has the same aspect set and a batch one shape; under
``off`` the stage's W x H.

A stage trains below the final size (``check_below_final``: a smaller pixel area, or the same area at fewer frames)
and every stage, and the final size after them, trains at least one optimizer step (``check_steps``: known once the
plan's total is).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from diffsynth_mbc.errors import OptionsError

FLAG = "--resolution_stages"
SIDE_STEP = 32   # the VAE's 16 x the DiT's patch 2
_STAGE = re.compile(r"^(\d+)x(\d+)(?:x(\d+))?:([0-9.]+)$")


@dataclass(frozen=True)
class Stage:
    width: int
    height: int
    num_frames: int | None   # None: --num_frames
    share: float

    @property
    def name(self) -> str:
        return f"{self.width}x{self.height}" + (f"x{self.num_frames}" if self.num_frames else "")

    @property
    def text(self) -> str:
        """The stage as ``--resolution_stages`` writes it."""
        return f"{self.name}:{self.share:g}"


def parse_stages(text: str | None) -> tuple[Stage, ...]:
    """The stages of ``--resolution_stages`` (() when unset); OptionsError naming the value that is wrong."""
    if text is None or not str(text).strip():
        return ()
    stages = []
    for part in str(text).split(","):
        match = _STAGE.match(part.strip())
        if not match:
            raise OptionsError(f"{FLAG}: {part.strip()!r} is not WxH[xF]:SHARE (e.g. 832x480:0.7 or "
                               "832x480x17:0.5,1024x576:0.2)")
        width, height, frames, share = int(match[1]), int(match[2]), match[3], float(match[4])
        if width < SIDE_STEP or height < SIDE_STEP or width % SIDE_STEP or height % SIDE_STEP:
            raise OptionsError(f"{FLAG}: {part.strip()!r}: width and height must be multiples of {SIDE_STEP} "
                               f"(at least {SIDE_STEP}), got {width}x{height}")
        if frames is not None and (int(frames) < 1 or int(frames) % 4 != 1):
            raise OptionsError(f"{FLAG}: {part.strip()!r}: frames must be 4k+1 (1, 5, 9, 13, 17, ...), got {frames}")
        if not 0 < share < 1:
            raise OptionsError(f"{FLAG}: {part.strip()!r}: the share must be above 0 and below 1, got {share:g}")
        stages.append(Stage(width, height, int(frames) if frames else None, share))
    total = sum(stage.share for stage in stages)
    if total >= 1:
        raise OptionsError(f"{FLAG} {text}: the shares add up to {total:g}; they must leave some of the run "
                           "(below 1) for the last steps at --width x --height")
    return tuple(stages)


def check_below_final(stages: tuple[Stage, ...], width: int, height: int, num_frames: int) -> None:
    """OptionsError naming the first stage that is not below the final size ``width x height x num_frames``: one with
    a larger pixel area or more frames (the final size is the largest: the memory is sized for it), or with the
    final size's area and frames (it would train the final size under another name)."""
    final = f"{width}x{height}x{num_frames}"
    for stage in stages:
        area, frames = stage.width * stage.height, stage.num_frames or num_frames
        if area > width * height or frames > num_frames:
            raise OptionsError(f"{FLAG}: the stage {stage.text} ({stage.width}x{stage.height}x{frames}) is larger "
                               f"than the final size {final} (--width x --height x --num_frames); the final size is "
                               "the largest, and the memory is sized for it: give the stage a smaller area or fewer "
                               "frames")
        if area == width * height and frames == num_frames:
            raise OptionsError(f"{FLAG}: the stage {stage.text} ({stage.width}x{stage.height}x{frames}) trains the "
                               f"final size's area and frames ({final}); a stage trains below it (a smaller area or "
                               "fewer frames), and the steps after the stages train at the final size")


def check_steps(stages: tuple[Stage, ...], total_steps: int, final: str) -> None:
    """OptionsError naming the first stage (or the final size ``final`` after them) that gets none of the run's
    ``total_steps`` optimizer steps. A run of no steps at all is refused where its rows are counted."""
    if not stages or total_steps < 1:
        return
    start = 0
    for index, end in enumerate(boundaries(stages, total_steps)):
        if end > start:
            start = end
            continue
        if index < len(stages):
            what, remedy = f"the stage {stages[index].text}", "give it a larger share, or use fewer stages"
        else:
            what = f"the final size {final}, after stages whose shares add up to {sum(s.share for s in stages):g},"
            remedy = "give the stages smaller shares"
        raise OptionsError(f"{FLAG}: {what} gets none of this run's {total_steps:,} optimizer steps (a step is "
                           f"{1 / total_steps:.3g} of the run): {remedy}")


def stage_names(stages: tuple[Stage, ...]) -> list[str]:
    """What a latent cache holds for ``stages``: their sizes (the shares change which steps train them, not the
    latents), in order."""
    return [stage.name for stage in stages]


def stage_settings(settings: dict, stage: Stage, bucket, buckets: str) -> tuple[dict, object]:
    """(a cache entry's settings, its bucket) at ``stage`` for a row of final ``bucket`` (``Bucket`` or None): the
    stage's frames, and its size (the bucket scaled to its area under aspect; its W x H under off)."""
    from diffsynth_mbc.data.media.buckets import Bucket

    changed = {**settings, "num_frames": stage.num_frames or settings["num_frames"]}
    if buckets == "aspect" and bucket is not None:
        final = (settings["height"], settings["width"])
        return changed, Bucket(*stage_shape(stage, bucket.height, bucket.width, buckets, final))
    changed.update(height=stage.height, width=stage.width)
    return changed, None


def boundaries(stages: tuple[Stage, ...], total_steps: int) -> list[int]:
    """The optimizer step each stage ends after (the final size's stage: ``total_steps``)."""
    ends, share = [], 0.0
    for stage in stages:
        share += stage.share
        ends.append(round(share * total_steps))
    return ends + [total_steps]


def final_stage_start(ends: list[int] | tuple[int, ...]) -> int:
    """The first optimizer step (from 1) of the final size's stage, from ``boundaries``; 1 without stages."""
    return ends[-2] + 1 if len(ends) > 1 else 1


def stage_at(ends: list[int], step: int) -> int:
    """The stage (0-based; ``len(ends) - 1``: the final size) of optimizer step ``step`` (0-based: the step about to
    be taken)."""
    for index, end in enumerate(ends):
        if step < end:
            return index
    return len(ends) - 1


def side(value: float) -> int:
    """The nearest multiple of 32 to ``value``, at least 32: a stage's side."""
    return max(SIDE_STEP, SIDE_STEP * round(value / SIDE_STEP))


def stage_shape(stage: Stage, height: int, width: int, buckets: str,
                final: tuple[int, int] | None = None) -> tuple[int, int]:
    """(height, width) a batch of the final shape ``height x width`` (its bucket under aspect) trains at in ``stage``:
    the stage's size under ``off``; under ``aspect`` the stage's W x H for the configured shape ``final`` (height,
    width), turned for its transpose, and any other bucket scaled by the stage's area over the configured one."""
    if buckets != "aspect":
        return stage.height, stage.width
    configured = final or (height, width)
    if (height, width) == configured:
        return stage.height, stage.width
    if (width, height) == configured:
        return stage.width, stage.height
    scale = math.sqrt(stage.width * stage.height / (configured[0] * configured[1]))
    return side(height * scale), side(width * scale)
