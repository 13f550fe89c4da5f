"""The statistics of one training window and what they flag. Pure numpy: milliseconds per window.

``measure_window`` turns the small RGB frames of ``window.read_window`` into a few numbers (``WindowMeasures``,
stored by the runner so that thresholds can change without decoding again); ``findings`` compares them with the
thresholds below. All work is on luma (BT.601 from RGB, 0..255) and on area-averaged thumbnails, which hide the
encoder's noise and the source's resolution: a clip and its re-encoded, resized copy measure alike.

- scene cut: the mean absolute luma change between consecutive thumbnails, at the best of small shifts (so
  camera motion changes little); a cut is one change that is both large and many times the window's typical
  change (a pan or a slow fade changes every frame about as much);
- black: ffmpeg's blackdetect rule per frame (nearly every pixel below a tenth of full luma), the clip when
  more than half its frames are;
- frozen: how far any frame moves from the first (a high percentile of the per-pixel change, so a small moving
  part such as a speaking mouth counts and single noisy pixels do not);
- bars: rows (columns) from an edge that stay dark in every non-black frame, all along (what is left of them
  after the training's centre crop is what counts);
- perceptual hash: the sign pattern of the low DCT frequencies of a 32x32 thumbnail (pHash), for ``duplicates``.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from functools import lru_cache

import numpy as np

CUT_THUMB_SIDE = 32        # px, long side of the cut thumbnails: blurs away noise and fine motion, keeps a new shot
CUT_SHIFT = 2              # px of those thumbnails: camera motion up to 6% of the width a frame is compensated
CUT_MIN_CHANGE = 12.0      # luma levels: fades measured 6-11 a frame, busy motion 12-14; cuts between shots 29-57
CUT_MIN_RATIO = 4.0        # times the typical change: fades measured 1.1, pans 1.4-2.8, busy motion 1.7; cuts 15-43
TYPICAL_CHANGE_FLOOR = 1.0  # luma levels: a still window's typical change (encoder noise) counts as at least this
BLACK_LUMA = 26.0          # luma levels: ffmpeg blackdetect's pix_th 0.10 of full range (255)
BLACK_PIXEL_SHARE = 0.98   # of a frame's pixels below BLACK_LUMA: blackdetect's pic_th
BLACK_FRAME_SHARE = 0.5    # of the window's frames black: then the window is black (more than half trains on black)
MOTION_THUMB_SIDE = 64     # px, long side of the motion thumbnails: a mouth in a medium shot is still a few pixels
MOTION_PERCENTILE = 99.9   # of the per-pixel change: the ~3 most changed pixels of 64x36, a mouth covers more
FROZEN_MOTION = 8.0        # luma levels: re-encoded stills measured 1-3, 6 with heavy grain; moving mouths 40-86
BAR_LUMA = 12.0            # luma levels: encoded bars are 0-3, ffmpeg cropdetect's limit is ~9; a night sky has more
BAR_LIT_SHARE = 0.01       # of a bar row's (column's) pixels, over all non-black frames, that may be lit: noise
BAR_MIN_SIDE = 0.02        # of the height (width): thinner is an encoder's border, not a bar on that side
BARS_MAX_SHARE = 0.08      # of the trained picture: more dark bar than that trains the model to draw bars
HASH_SIDE = 32             # px, the pHash thumbnail (square)
HASH_BLOCK = 8             # the low-frequency DCT block whose signs make the hash
HASH_FLAT_STD = 2.0        # luma levels: a frame flatter than this has no detail to hash (black, one colour)
METER_CHUNK = 32           # frames measured at once when they arrive one by one: ~6 MB at work for 128x72


@dataclass(frozen=True)
class WindowMeasures:
    frames: int
    cut_score: float         # largest frame-to-frame change / the window's typical change (0 with < 3 frames)
    cut_frame: int | None    # index into the window of the first frame after the largest change
    cut_change: float        # that change: mean absolute luma difference, 0..255, on blurred thumbnails (at the
                             # best of small shifts: camera motion compensated)
    black_share: float       # share of the window's frames that are near black
    motion: float            # luma levels: how far the window moves from its first frame, at most
    bars: tuple[float, float, float, float]   # top, bottom, left, right: share of the height/width that is a bar
    hashes: tuple[str, ...]  # 16 hex digits each: first, middle, last frame; "" for a flat frame
    cut_position: int | None = None   # the source frame after the largest change (``cut_frame`` in the clip)
    cut_seconds: float | None = None  # its time in the clip (None: the rate is unknown)
    cut_dense: bool = False   # the cut's numbers were measured on every source frame around it, not the window's

    def to_dict(self) -> dict:
        """Plain JSON values; ``from_dict`` gives back an equal object."""
        values = asdict(self)
        values["bars"], values["hashes"] = list(self.bars), list(self.hashes)
        return values

    @classmethod
    def from_dict(cls, values: dict) -> "WindowMeasures":
        cut_frame = values["cut_frame"]
        return cls(frames=int(values["frames"]), cut_score=float(values["cut_score"]),
                   cut_frame=None if cut_frame is None else int(cut_frame), cut_change=float(values["cut_change"]),
                   black_share=float(values["black_share"]), motion=float(values["motion"]),
                   bars=tuple(float(share) for share in values["bars"]),
                   hashes=tuple(str(digest) for digest in values["hashes"]),
                   cut_position=None if values["cut_position"] is None else int(values["cut_position"]),
                   cut_seconds=None if values["cut_seconds"] is None else float(values["cut_seconds"]),
                   cut_dense=bool(values["cut_dense"]))


def readable_measures(values: dict) -> bool:
    """Whether stored measures give a ``WindowMeasures`` with every number finite (a hand-edited or foreign line
    may lack a field or hold NaN)."""
    try:
        measures = WindowMeasures.from_dict(values)
    except (KeyError, TypeError, ValueError):
        return False
    numbers = [measures.cut_score, measures.cut_change, measures.black_share, measures.motion, *measures.bars]
    return all(math.isfinite(number) for number in numbers)


@dataclass(frozen=True)
class Finding:
    reason: str        # one of reasons.REASONS
    value: float       # what was measured, in the unit of the threshold
    threshold: float
    detail: str        # one readable line


def luma(frames: np.ndarray) -> np.ndarray:
    """BT.601 luma, float32 0..255, of uint8 RGB frames [..., 3]."""
    weights = np.array([0.299, 0.587, 0.114], dtype=np.float32)
    return frames.astype(np.float32) @ weights


@lru_cache(maxsize=64)
def _area_weights(size: int, new_size: int) -> np.ndarray:
    """[new_size, size] weights: each output pixel the average of the input it covers (fractions at the seams)."""
    edges = np.arange(new_size + 1) * (size / new_size)
    starts, ends = edges[:-1, None], edges[1:, None]
    pixels = np.arange(size)[None, :]
    overlap = np.clip(np.minimum(ends, pixels + 1) - np.maximum(starts, pixels), 0, None)
    return (overlap / overlap.sum(axis=1, keepdims=True)).astype(np.float32)


def area_resize(planes: np.ndarray, height: int, width: int) -> np.ndarray:
    """Area-averaged resize of luma planes [..., h, w] to [..., height, width] (any ratio)."""
    rows = _area_weights(planes.shape[-2], height)
    columns = _area_weights(planes.shape[-1], width)
    return rows @ planes @ columns.T


def thumbnail_size(height: int, width: int, long_side: int) -> tuple[int, int]:
    """(height, width) with the long side ``long_side`` (never enlarging) and the aspect kept."""
    scale = min(1.0, long_side / max(height, width))
    return max(1, round(height * scale)), max(1, round(width * scale))


def frame_is_black(planes: np.ndarray) -> np.ndarray:
    """Per frame of luma planes [T, h, w]: nearly every pixel below BLACK_LUMA (blackdetect)."""
    return (planes < BLACK_LUMA).mean(axis=(1, 2)) >= BLACK_PIXEL_SHARE


def frame_changes(planes: np.ndarray) -> np.ndarray:
    """Mean absolute luma change between consecutive thumbnails of luma planes [T, h, w], the smallest over
    shifts of up to CUT_SHIFT pixels (so a pan or a shaking camera changes little, a new shot as much as ever)."""
    return thumbnail_changes(cut_thumbnails(planes))


def cut_thumbnails(planes: np.ndarray) -> np.ndarray:
    return area_resize(planes, *thumbnail_size(*planes.shape[1:], CUT_THUMB_SIDE))


def thumbnail_changes(thumbs: np.ndarray) -> np.ndarray:
    """``frame_changes`` of the cut thumbnails [T, h, w] (T - 1 changes)."""
    height, width = thumbs.shape[1:]
    shift = max(0, min(CUT_SHIFT, (min(height, width) - 1) // 4))
    before, after = thumbs[:-1, shift:height - shift, shift:width - shift], thumbs[1:]
    changes = np.full(len(before), np.inf, dtype=np.float32)
    for dy in range(-shift, shift + 1):
        for dx in range(-shift, shift + 1):
            moved = after[:, shift + dy:height - shift + dy, shift + dx:width - shift + dx]
            np.minimum(changes, np.abs(moved - before).mean(axis=(1, 2)), out=changes)
    return changes


def cut_statistics(planes: np.ndarray) -> tuple[float, int | None, float]:
    """(cut score, cut frame, cut change) of luma planes [T, h, w]: the largest change between consecutive
    frames, where it happens, and how many times the median of the other changes it is."""
    if len(planes) < 2:
        return 0.0, None, 0.0
    return cut_of_changes(frame_changes(planes))


def cut_of_changes(changes: np.ndarray) -> tuple[float, int | None, float]:
    """``cut_statistics`` from the frame-to-frame changes (one fewer than the frames; none: no cut)."""
    if not len(changes):
        return 0.0, None, 0.0
    largest = int(np.argmax(changes))
    if len(changes) < 2:
        return 0.0, None, float(changes[largest])
    typical = max(float(np.median(np.delete(changes, largest))), TYPICAL_CHANGE_FLOOR)
    return float(changes[largest]) / typical, largest + 1, float(changes[largest])


def _dark_run(lit_shares: np.ndarray) -> int:
    """How many leading rows (columns) are dark: at most BAR_LIT_SHARE of their pixels lit."""
    lit = np.flatnonzero(lit_shares > BAR_LIT_SHARE)
    return int(lit[0]) if len(lit) else len(lit_shares)


def _bars_of_lit(rows: np.ndarray, columns: np.ndarray) -> tuple[float, float, float, float]:
    """(top, bottom, left, right) share of the height/width that is a dark bar in every non-black frame, from the
    share of lit pixels in each row and column over those frames."""
    if _dark_run(rows) == len(rows):   # all dark: no picture to frame
        return 0.0, 0.0, 0.0, 0.0
    return (_dark_run(rows) / len(rows), _dark_run(rows[::-1]) / len(rows),
            _dark_run(columns) / len(columns), _dark_run(columns[::-1]) / len(columns))


@lru_cache(maxsize=4)
def _dct_matrix(size: int) -> np.ndarray:
    """Orthonormal DCT-II matrix [k, n]: coefficients = M @ signal."""
    k, n = np.arange(size)[:, None], np.arange(size)[None, :]
    matrix = np.cos(np.pi * (2 * n + 1) * k / (2 * size)) * np.sqrt(2.0 / size)
    matrix[0] /= np.sqrt(2.0)
    return matrix.astype(np.float32)


def perceptual_hash(plane: np.ndarray) -> str:
    """pHash of one luma plane [h, w]: 16 hex digits, "" when the frame is flat. Bits: the 63 coefficients of
    the 8x8 low-frequency DCT block without the DC term (the mean brightness), each above their median or not;
    the top bit stays 0."""
    thumb = area_resize(plane, HASH_SIDE, HASH_SIDE)
    if float(thumb.std()) < HASH_FLAT_STD:
        return ""
    dct = _dct_matrix(HASH_SIDE)
    block = (dct @ thumb @ dct.T)[:HASH_BLOCK, :HASH_BLOCK].ravel()[1:]
    bits = block > np.median(block)
    return f"{int(''.join('1' if bit else '0' for bit in bits), 2):016x}"


def hashed_positions(count: int) -> list[int]:
    """Indices of the hashed frames of a window of ``count``: first, middle, last (fewer when they coincide)."""
    return sorted({0, count // 2, count - 1}) if count else []


def measure_window(frames: np.ndarray) -> WindowMeasures:
    """The measures of one window: uint8 RGB frames [T, h, w, 3] (``read_window``'s)."""
    if frames.ndim != 4 or frames.shape[-1] != 3 or not len(frames):
        raise ValueError(f"expected RGB frames [T, h, w, 3], got an array of shape {frames.shape}")
    meter = WindowMeter(len(frames))
    meter.add(frames)
    return meter.result()


class WindowMeter:
    """``measure_window`` of a window of ``count`` frames fed in order, a frame or a chunk at a time: what it keeps
    is a few thumbnails, one number per frame and sums per row and column, so the memory does not grow with the
    clip (``--frame_sampling random_window`` measures every frame of a clip that may be an hour long)."""

    def __init__(self, count: int):
        self.count, self.seen = count, 0
        self.hash_at = set(hashed_positions(count))
        self.hashes: dict[int, str] = {}
        self.changes: list[np.ndarray] = []   # frame-to-frame changes, chunk by chunk
        self.last_thumb = None                # the cut thumbnail of the last frame seen
        self.first_motion_thumb = None
        self.motion = 0.0
        self.black = 0
        self.rows_lit = self.columns_lit = None   # lit pixels per row and column over the non-black frames
        self.lit_frames = 0
        self.pending: list[np.ndarray] = []   # frames pushed one at a time, measured METER_CHUNK at once

    def push(self, frame: np.ndarray) -> None:
        """One uint8 RGB frame [h, w, 3]; measured with the next ones (numpy's cost is per call, not per frame)."""
        self.pending.append(frame)
        if len(self.pending) >= METER_CHUNK:
            self.flush()

    def flush(self) -> None:
        if self.pending:
            chunk, self.pending = np.stack(self.pending), []
            self.add(chunk)

    def add(self, frames: np.ndarray) -> None:
        """uint8 RGB frames [T, h, w, 3], or one frame [h, w, 3]: the next of the window."""
        if frames.ndim == 3:
            frames = frames[None]
        planes = luma(frames)
        start, self.seen = self.seen, self.seen + len(planes)
        black = frame_is_black(planes)
        self.black += int(black.sum())
        thumbs = cut_thumbnails(planes)
        if self.last_thumb is not None:
            thumbs = np.concatenate([self.last_thumb[None], thumbs])
        self.changes.append(thumbnail_changes(thumbs))
        self.last_thumb = thumbs[-1]
        motion_thumbs = area_resize(planes, *thumbnail_size(*planes.shape[1:], MOTION_THUMB_SIDE))
        if self.first_motion_thumb is None:
            self.first_motion_thumb = motion_thumbs[0]
        moved = np.abs(motion_thumbs - self.first_motion_thumb).reshape(len(motion_thumbs), -1)
        self.motion = max(self.motion, float(np.percentile(moved, MOTION_PERCENTILE, axis=1).max()))
        lit = planes[~black] >= BAR_LUMA
        if self.rows_lit is None:
            self.rows_lit, self.columns_lit = np.zeros(planes.shape[1]), np.zeros(planes.shape[2])
        self.rows_lit += lit.sum(axis=(0, 2))
        self.columns_lit += lit.sum(axis=(0, 1))
        self.lit_frames += len(lit)
        for offset in range(len(planes)):
            if start + offset in self.hash_at:
                self.hashes[start + offset] = perceptual_hash(planes[offset])

    def result(self) -> WindowMeasures:
        self.flush()
        if self.seen != self.count or not self.seen:
            raise ValueError(f"the window has {self.count} frames, {self.seen} were measured")
        cut_score, cut_frame, cut_change = cut_of_changes(np.concatenate(self.changes))
        bars = (0.0, 0.0, 0.0, 0.0)
        if self.lit_frames:
            bars = _bars_of_lit(self.rows_lit / (self.lit_frames * len(self.columns_lit)),
                                self.columns_lit / (self.lit_frames * len(self.rows_lit)))
        return WindowMeasures(frames=self.seen, cut_score=round(cut_score, 4), cut_frame=cut_frame,
                              cut_change=round(cut_change, 4), black_share=round(self.black / self.seen, 4),
                              motion=round(self.motion, 4), bars=tuple(round(share, 4) for share in bars),
                              hashes=tuple(self.hashes[index] for index in sorted(self.hash_at)))


def kept_shares(source_size: tuple[int, int], train_shape: tuple[int, int]) -> tuple[float, float]:
    """(width, height) share of the source that the training's centre crop to ``train_shape``'s aspect keeps
    (the picture is scaled to cover the train shape, then the overhang is cut equally from both sides)."""
    (source_width, source_height), (train_width, train_height) = source_size, train_shape
    if min(source_width, source_height, train_width, train_height) <= 0:
        return 1.0, 1.0
    source_aspect, train_aspect = source_width / source_height, train_width / train_height
    if source_aspect > train_aspect:
        return train_aspect / source_aspect, 1.0
    return 1.0, source_aspect / train_aspect


def bars_after_crop(bars: tuple[float, float, float, float], source_size: tuple[int, int],
                    train_shape: tuple[int, int]) -> tuple[float, float, float, float]:
    """(top, bottom, left, right): what is left of each bar (a share of the source's height or width) after the
    centre crop, as a share of the trained picture's height or width."""
    keep_width, keep_height = kept_shares(source_size, train_shape)
    top, bottom, left, right = bars
    cut_height, cut_width = (1 - keep_height) / 2, (1 - keep_width) / 2
    return (max(0.0, top - cut_height) / keep_height, max(0.0, bottom - cut_height) / keep_height,
            max(0.0, left - cut_width) / keep_width, max(0.0, right - cut_width) / keep_width)


def _bar_finding(reason: str, sides: tuple[str, str], measured: tuple[float, float], left: tuple[float, float],
                 axis: str, shape_label: str) -> Finding | None:
    """A letterbox or pillarbox finding when both sides hold a bar and more than BARS_MAX_SHARE of the trained
    picture is bar after the crop."""
    trained = sum(left)
    if min(measured) < BAR_MIN_SIDE or trained <= BARS_MAX_SHARE:
        return None
    detail = (f"dark bars {measured[0]:.0%} {sides[0]} + {measured[1]:.0%} {sides[1]} of the {axis}; "
              f"trained at {shape_label} they are {trained:.0%} of the picture")
    return Finding(reason, round(trained, 4), BARS_MAX_SHARE, detail)


def cut_detail(measures: WindowMeasures) -> str:
    """``hard cut at source frame 150 (0:06.25), window frame 9 of 17: mean luma change 54 vs 3.0 typical``."""
    typical = measures.cut_change / measures.cut_score
    where = f"frame {measures.cut_frame} of the window"
    if measures.cut_position is not None:
        when = "" if measures.cut_seconds is None else f" ({clock(measures.cut_seconds)})"
        where = f"source frame {measures.cut_position}{when}, window frame {measures.cut_frame} of {measures.frames}"
    rate = " (at the clip's own frame rate, around the trained frames)" if measures.cut_dense else ""
    return f"hard cut at {where}: mean luma change {measures.cut_change:.0f} vs {typical:.1f} typical{rate}"


def clock(seconds: float) -> str:
    """``0:06.25``, ``1:02:03.50``: a time in the clip as a player shows it."""
    minutes, rest = divmod(seconds, 60)
    hours, minutes = divmod(int(minutes), 60)
    return f"{hours}:{minutes:02d}:{rest:05.2f}" if hours else f"{minutes}:{rest:05.2f}"


def findings(measures: WindowMeasures, media_type: str, train_shape: tuple[int, int], shape_label: str,
             source_size: tuple[int, int]) -> list[Finding]:
    """What the measures flag (all reasons but ``duplicate``, which compares rows: ``duplicates``). Images are
    never cut or frozen; a black window is not also called frozen or boxed (the black is the cause)."""
    found = []
    video = media_type != "image"
    if video and measures.cut_change >= CUT_MIN_CHANGE and measures.cut_score >= CUT_MIN_RATIO:
        found.append(Finding("scene_cut", measures.cut_score, CUT_MIN_RATIO, cut_detail(measures)))
    if measures.black_share > BLACK_FRAME_SHARE:
        black_frames = round(measures.black_share * measures.frames)
        what = f"{black_frames} of {measures.frames} frames are" if video else "the image is"
        found.append(Finding("black", measures.black_share, BLACK_FRAME_SHARE,
                             f"{what} near black ({BLACK_PIXEL_SHARE:.0%} of the pixels below luma "
                             f"{BLACK_LUMA:.0f} of 255)"))
        return found
    if video and measures.motion < FROZEN_MOTION:
        frames = f"{measures.frames} frames" if measures.frames > 1 else "its single frame"
        found.append(Finding("frozen", measures.motion, FROZEN_MOTION,
                             f"no motion across {frames}: at most {measures.motion:.1f} luma levels of change "
                             f"from the first frame (under {FROZEN_MOTION:.0f})"))
    left = bars_after_crop(measures.bars, source_size, train_shape)
    for reason, sides, pair, axis in (("letterbox", ("top", "bottom"), slice(0, 2), "height"),
                                      ("pillarbox", ("left", "right"), slice(2, 4), "width")):
        finding = _bar_finding(reason, sides, measures.bars[pair], left[pair], axis, shape_label)
        if finding is not None:
            found.append(finding)
    return found
