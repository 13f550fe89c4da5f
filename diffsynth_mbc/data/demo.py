"""The built-in demo's data: ``python -m diffsynth_mbc.demo prepare DIR``.

Writes a small synthetic MBC catalogue of real mp4/png/jpg files under DIR/catalog and converts it
with the real converter into DIR/metadata. ``bash launchers/train_test.sh --demo`` then trains the
tiny TI2V-architecture model on it with 2 CPU processes.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from diffsynth_mbc.data import convert
from diffsynth_mbc.data.demo_data import make_demo_catalog
from diffsynth_mbc.flags import FlagParser


def prepare(root: str | Path, num_videos: int = 6, num_images: int = 5, seed: int = 0) -> Path:
    root = Path(root)
    catalog = make_demo_catalog(root / "catalog", num_videos=num_videos, num_images=num_images,
                                width=64, height=64, num_frames=9, seed=seed)
    code = convert.main([str(catalog), "--base_path", str(root / "catalog"), "--output", str(root / "metadata")])
    if code != 0:
        raise RuntimeError(f"converting the demo catalogue {catalog} failed with exit code {code}")
    return root / "metadata" / "metadata.csv"


def build_parser() -> argparse.ArgumentParser:
    parser = FlagParser(prog="python -m diffsynth_mbc.demo", allow_abbrev=False)
    sub = parser.add_subparsers(dest="command", required=True)
    prep = sub.add_parser("prepare", help="write the demo catalogue and its DiffSynth metadata")
    prep.add_argument("root", help="folder for catalog/ and metadata/ (e.g. runs/demo)")
    prep.add_argument("--videos", type=int, default=6)
    prep.add_argument("--images", type=int, default=5)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    metadata = prepare(args.root, num_videos=args.videos, num_images=args.images)
    print(f"demo metadata: {metadata}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
