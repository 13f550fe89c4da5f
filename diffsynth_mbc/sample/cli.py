"""``python -m diffsynth_mbc.sample PROMPTS --lora PATH [PATH ...] --output DIR``: render a run's LoRA files side by
side with the base model, and with ``--validate`` measure each, to pick the one to keep.

    python -m diffsynth_mbc.sample prompts.yaml --lora runs/mbc/lora --output sweeps/mbc --strengths 0,0.5,1 --validate

PROMPTS has the format of the training's ``--sample_prompts``. ``--lora`` takes LoRA files, checkpoint folders or a
run's output folder (every LoRA file of the run, ordered by step; ``--ema``: their EMA twins too). The base model
(``--demo``, ``--model_dir``/``--model_id``, else the run's own) loads once; each prompt at strength 0 renders once,
into ``DIR/base/``; each file's clips go to ``DIR/<file>/`` under the names of the training's sample clips. Outputs:
every clip as mp4 with its first frame as png, ``sweep.json`` and ``sweep.html``. A second invocation renders only
what is missing; Ctrl-C leaves no half-written clip. ``--gpus N`` shares the clips out over N processes
(``accelerate launch``), each loading the base once.
"""

from __future__ import annotations

import os
import subprocess
import sys

from diffsynth_mbc.errors import OptionsError
from diffsynth_mbc.flags import FlagParser
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
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--demo", action="store_true", help="the demo's tiny random model")
    source.add_argument("--model_dir", help="local Wan2.2-TI2V-5B folder (default: the run's)")
    source.add_argument("--model_id", help="ModelScope id (default: the run's)")
    parser.add_argument("--gpus", type=int, default=1, help="processes to share the clips over (accelerate launch)")
    parser.add_argument("--seed", type=int, help="prompts' first seed and the demo model's (default: the run's, "
                                                 "else 42)")
    parser.add_argument("--height", type=int, help="prompts' default height (default: the run's, else 704)")
    parser.add_argument("--width", type=int, help="prompts' default width (default: the run's, else 1280)")
    parser.add_argument("--num_frames", type=int, help="prompts' default frames (default: the run's, else 17)")
    parser.add_argument("--mixed_precision", choices=("auto", "bf16", "fp16", "fp32"),
                        help="default: the run's, else auto (bf16 from compute capability 8.0, fp16 below)")
    parser.add_argument("--val_metadata_path", help="validation metadata for files without a run")
    parser.add_argument("--val_base_path", help="folder its paths are relative to")
    parser.add_argument("--val_samples", type=int, help="validation samples (default: the run's, else 16)")
    parser.add_argument("--val_timestep_quantiles", help="default: the run's, else the training's default")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.gpus > 1 and int(os.environ.get("WORLD_SIZE", "1")) == 1:
            return launch_processes(args.gpus, argv if argv is not None else sys.argv[1:])
        from diffsynth_mbc.sample.sweep import run_sweep

        return run_sweep(args)
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
    launcher = [sys.executable, "-m", "accelerate.commands.launch", "--num_processes", str(gpus),
                "--num_machines", "1", "--dynamo_backend", "no", "--mixed_precision", "no"]
    launcher.append("--multi_gpu")   # on CPUs too: one process each, joined over gloo (render.start_accelerator)
    if not torch.cuda.is_available():
        environment.setdefault("OMP_NUM_THREADS", "1")
    return subprocess.call([*launcher, "-m", "diffsynth_mbc.sample", *rest], env=environment)
