"""How much detail a picture smaller than its training shape loses to the upscale, measured on real photos or
frames: the figure behind convert's "small media" threshold (``aspect_mix.UPSCALE_FLAGGED_ABOVE``).

    python benchmarks/bench_upscale.py PHOTO [PHOTO ...] [--json out.json]

For each picture (the sharp original), the training shape is two thirds of its size, and its true frame there is
the original resized as the training resizes (DiffSynth's ``crop_and_resize``: bilinear, antialiased on PIL
images). A file ``s`` times smaller than the shape (``s`` > 1) is the original resized to shape / s; it trains
upscaled by ``s``. A file larger than the shape (``s`` < 1) trains downscaled. The PSNR of each trained frame
against the true frame says what the file's size cost. Every resize between two sizes costs something, so the
baseline is a file 2% larger than its shape (``s`` = 0.98: nobody calls it small); the threshold is the largest
upscale whose error (MSE) is at most twice that baseline's (3 dB less PSNR).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
from pathlib import Path

FACTORS = (0.7, 0.8, 0.9, 0.98, 1.02, 1.05, 1.1, 1.15, 1.2, 1.3, 1.5, 2.0)
BASELINE = 0.98
SHAPE_SHARE = 2 / 3


def psnr_by_factor(path: str) -> dict[float, float]:
    import numpy as np
    import torchvision.transforms.functional as functional
    from PIL import Image
    from torchvision.transforms import InterpolationMode

    def resized(image, width, height):
        return functional.resize(image, (height, width), interpolation=InterpolationMode.BILINEAR)

    original = Image.open(path).convert("RGB")
    width, height = round(original.width * SHAPE_SHARE), round(original.height * SHAPE_SHARE)
    true_frame = np.asarray(resized(original, width, height), dtype=np.float64)
    result = {}
    for factor in FACTORS:
        smaller = resized(original, round(width / factor), round(height / factor))
        trained = np.asarray(resized(smaller, width, height), dtype=np.float64)
        mse = float(((trained - true_frame) ** 2).mean())
        result[factor] = 10 * math.log10(255 ** 2 / mse) if mse else float("inf")
    return result


def threshold(psnr: dict[float, float]) -> float:
    """The largest upscale factor whose PSNR is within 3 dB (twice the error) of the 2%-larger file's."""
    floor = psnr[BASELINE] - 10 * math.log10(2)
    return max(factor for factor in FACTORS if factor > 1 and psnr[factor] >= floor)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("photos", nargs="+")
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    rows = {}
    for path in args.photos:
        psnr = psnr_by_factor(path)
        rows[path] = {"psnr_db": {f"{factor:g}": round(value, 2) for factor, value in psnr.items()},
                      "threshold": threshold(psnr)}
        print(f"{Path(path).name}: " + " ".join(f"{factor:g}x {value:.1f}" for factor, value in psnr.items())
              + f" dB -> at most {rows[path]['threshold']:g}x")
    overall = statistics.median(row["threshold"] for row in rows.values())
    print(f"median threshold over {len(rows)} picture(s): flag an upscale of more than {overall:g}x")
    if args.json:
        Path(args.json).write_text(json.dumps({"photos": rows, "threshold": overall}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
