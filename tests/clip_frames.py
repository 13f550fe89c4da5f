"""A written clip's frames, decoded with PyAV directly: what the tests check sample clips against.

imageio's PyAV plugin (``iio.imread(..., plugin="pyav")``) runs a full garbage collection each time it closes a
file, which in a test process holding torch, diffsynth and the forked runs' objects costs 0.2-0.5 s per clip.
"""

from __future__ import annotations

import av
import numpy as np


def clip_frames(path) -> np.ndarray:
    """(frames, height, width, 3) uint8 RGB, every frame of the first video stream."""
    with av.open(str(path)) as container:
        return np.stack([frame.to_ndarray(format="rgb24") for frame in container.decode(video=0)])
