"""``python -m diffsynth_mbc.sample PROMPTS --lora PATH [PATH ...] --output DIR``: render a run's LoRA files side by
side with the base model, and with ``--validate`` measure each, to pick the one to keep.

    python -m diffsynth_mbc.sample prompts.yaml --lora runs/mbc/lora --output sweeps/mbc --strengths 0,0.5,1 --validate

PROMPTS has the format of the training's ``--sample_prompts``. ``--lora`` takes LoRA files, checkpoint folders or a
run's output folder (every LoRA file of the run, ordered by step; ``--ema``: their EMA twins too). The base model
(``--demo``, ``--model_dir``/``--model_id``, else the run's own) loads once; each prompt at strength 0 renders once,
into ``DIR/base/``; each file's clips go to ``DIR/<file>/`` under the names of the training's sample clips. Outputs:
every clip as mp4 with its first frame as png, ``sweep.json`` and ``sweep.html``. A second invocation renders only
what is missing; Ctrl-C leaves no half-written clip. ``--gpus N`` shares the clips out over N processes
(``accelerate launch``), each loading the base once. The flags it shares with the training (the model, sizes, seed,
precision and validation settings) are the training's own declarations (``sample=True`` in
``training/options/run_options.py``): the same names, help and checks, their default the run's.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys

from diffsynth_mbc.errors import OptionsError
from diffsynth_mbc.flags import FlagParser
from diffsynth_mbc.gpu import TORCH_NOTICE_FILTERS, quiet_torch_notices
from diffsynth_mbc.training.options.parser import add_flag
from diffsynth_mbc.training.options.run_options import DECLARATIONS

MODEL_SOURCE = ("demo", "model_dir", "model_id")   # one of them, else the run's model
SHARED = tuple(declaration for declaration in DECLARATIONS.values() if declaration.sample)
from diffsynth_mbc.run_layout import SWEEP_HTML, SWEEP_JSON


def build_parser():
    parser = FlagParser(prog="python -m diffsynth_mbc.sample", description=__doc__.split("\n\n")[0])
    parser.add_argument("prompts", help="prompts file, the format of the training's --sample_prompts")
    parser.add_argument("--lora", nargs="+", required=True, help="LoRA files, checkpoint folders or a run's output "
                                                                  "folder (every LoRA file of the run)")
    parser.add_argument("--output", required=True, help=f"where the clips, {SWEEP_JSON} and {SWEEP_HTML} go")
    parser.add_argument("--strengths", default="1", help="comma-separated LoRA strengths (default 1; 0: the base "
                                                         "model, rendered once per prompt)")
    parser.add_argument("--ema", action="store_true", help="also the EMA twins of a run's files")
    parser.add_argument("--validate", action="store_true", help="each file's validation loss and the base's: a "
                                                                "run's own validation settings, else --val_*")
    parser.add_argument("--gpus", type=int, default=1, help="processes to share the clips over (accelerate launch)")
    source = parser.add_mutually_exclusive_group()
    for declaration in SHARED:   # the training's flags: a prompt's default size and seed, the model, the validation
        model = declaration.name in MODEL_SOURCE
        add_flag(source if model else parser, dataclasses.replace(declaration, optional=False),
                 "default: the run's" + ("" if model else f", else {declaration.default_said.split(' ', 1)[1]}"))
    return parser


def given_settings(args) -> dict:
    """The shared training flags given (the model's aside), typed and checked as the training's: OptionsError naming
    the flag."""
    from diffsynth_mbc.training.options.checks import check_value

    given = {}
    for declaration in SHARED:
        value = vars(args)[declaration.name]
        if declaration.name in MODEL_SOURCE or value is None:
            continue
        given[declaration.name] = declaration.typed(value) if declaration.listed else value
        check_value(declaration, given[declaration.name])
    return given


def main(argv: list[str] | None = None) -> int:
    quiet_torch_notices()   # before torch is imported: its notices would print above the sweep's lines
    args = build_parser().parse_args(argv)
    try:
        if args.gpus > 1 and int(os.environ.get("WORLD_SIZE", "1")) == 1:
            return launch_processes(args.gpus, argv if argv is not None else sys.argv[1:])
        given = given_settings(args)   # a bad value stops before anything loads
        from diffsynth_mbc.sample.sweep import run_sweep

        return run_sweep(args, given)
    except KeyboardInterrupt:
        print(f"stopped: the clips rendered so far are kept in {args.output}; run the same command again to render "
              "the rest", file=sys.stderr)
        return 130
    except (OptionsError, ValueError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


def launch_processes(gpus: int, argv: list[str]) -> int:
    """``accelerate launch`` of this command on ``gpus`` processes (``--gpus`` taken off), each rendering its share."""
    import torch

    rest, skip = [], False
    for item in argv:
        if skip:
            skip = False
            continue
        if item == "--gpus":
            skip = True
            continue
        if not item.startswith("--gpus="):
            rest.append(item)
    environment = dict(os.environ)
    environment.setdefault("PYTHONWARNINGS", TORCH_NOTICE_FILTERS)   # accelerate's launcher imports torch too
    launcher = [sys.executable, "-m", "accelerate.commands.launch", "--num_processes", str(gpus),
                "--num_machines", "1", "--dynamo_backend", "no", "--mixed_precision", "no"]
    launcher.append("--multi_gpu")   # on CPUs too: one process each, joined over gloo (start_evaluation_accelerator)
    if not torch.cuda.is_available():
        environment.setdefault("OMP_NUM_THREADS", "1")
    return subprocess.call([*launcher, "-m", "diffsynth_mbc.sample", *rest], env=environment)
