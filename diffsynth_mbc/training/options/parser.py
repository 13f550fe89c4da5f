"""The command line of ``python -m diffsynth_mbc.train``, built from the options' declarations (``run_options.py``):
every flag in its group, with its help ending in its default, its type and its choices. No torch."""

from __future__ import annotations

import argparse
import sys
from typing import Sequence

from diffsynth_mbc.flags import FlagParser, unknown_flag_line
from diffsynth_mbc.training.options.declaration import GROUPS, Declaration
from diffsynth_mbc.training.options.run_options import DECLARATIONS


def build_parser() -> argparse.ArgumentParser:
    parser = FlagParser(
        prog="python -m diffsynth_mbc.train", argument_default=argparse.SUPPRESS, allow_abbrev=False,
        description="LoRA fine-tuning of Wan2.2-TI2V-5B through DiffSynth. Start it with `accelerate launch`.",
        epilog="Example: accelerate launch --config_file configs/accelerate/ddp.yaml -m diffsynth_mbc.train "
               "--config configs/train_test.yaml --learning_rate 5e-5")
    parser.add_argument("--config", help="YAML preset (see configs/); flags given here override it")
    groups = {title: parser.add_argument_group(title) for title in GROUPS}
    for declaration in DECLARATIONS.values():
        add_flag(groups[declaration.group], declaration)
    return parser


def add_flag(group, declaration: Declaration, default_said: str | None = None) -> None:
    """``declaration``'s flag in ``group`` (a parser or one of its groups): its help ending with its default
    (``default_said``: said otherwise), its type (``none`` clears an optional one), its choices shown."""
    help_text = declaration.help_text(default_said).replace("%", "%%")   # argparse formats the help with %
    if declaration.switch:
        group.add_argument(declaration.flag, action="store_true", help=help_text)
        return
    metavar = "{" + ",".join(declaration.choices) + "}" if declaration.choices else None
    group.add_argument(declaration.flag, type=declaration.reader, metavar=metavar, help=help_text)


def check_launcher_args(argv: Sequence[str]) -> int:
    """``LAUNCHER LAUNCHER_FLAG... -- TRAINING_ARGS...``: the launchers' check, before anything is locked or
    started, that every flag they pass on is a training flag; 2 with one line naming the unknown one."""
    launcher, rest = argv[0], list(argv[1:])
    split = rest.index("--") if "--" in rest else len(rest)
    line = unknown_flag_line(rest[split + 1:], [build_parser()], also=rest[:split],
                             full_list=f"bash {launcher} --help")
    if line:
        print(f"error: {line}", file=sys.stderr)
        return 2
    return 0
