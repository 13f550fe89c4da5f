"""Print the step plan of a training before it starts: ``python -m diffsynth_mbc.plan --world_size N [train flags]``.

Reads the same preset and flags as ``diffsynth_mbc.training.loop`` and counts the metadata rows the way
DiffSynth's loader will, and prints the plan on stderr. ``--paths_only`` reads no data and prints
the output and log folders as shell assignments for the launchers.
"""

from __future__ import annotations

import argparse
import shlex
import sys

from diffsynth_mbc.data.catalogues import metadata_counts
from diffsynth_mbc.data.frame_selection import frame_arguments
from diffsynth_mbc.flags import FlagParser
from diffsynth_mbc.training.step_plan import plan_from_options
from diffsynth_mbc.errors import OptionsError
from diffsynth_mbc.training.options import build_parser as training_parser, resolve_options


def cache_arguments(options, metadata_path: str, base_path: str, cache_dir: str) -> list[str]:
    arguments = ["--dataset_base_path", base_path, "--dataset_metadata_path", metadata_path,
                 "--height", str(options.height), "--width", str(options.width),
                 "--num_frames", str(options.num_frames), "--cache_dir", cache_dir, "--seed", str(options.seed),
                 "--decoder", options.decoder, "--log_dir", options.log_dir]   # the monitor sees the build there
    arguments += frame_arguments(options)
    if options.sample_prompts and metadata_path == options.dataset_metadata_path:
        arguments += ["--sample_prompts", options.sample_prompts]
    for key in ("caption_prefix", "caption_suffix"):   # part of what the cache encodes
        if getattr(options, key, ""):
            arguments += [f"--{key}", getattr(options, key)]
    if options.mixed_precision != "auto":   # auto: the cache picks as the training will, from the GPU
        arguments += ["--dtype", options.mixed_precision]
    if options.demo:
        return arguments + ["--demo"]
    if options.model_dir:
        return arguments + ["--model_dir", options.model_dir]
    return arguments + ["--model_id", options.model_id or "Wan-AI/Wan2.2-TI2V-5B"]


def print_cache_commands(options) -> None:
    """Shell assignments for the launchers; the default cache folder sits beside the output folder."""
    from pathlib import Path

    cache_dir = options.cache or str(Path(options.output_path).parent / "latent_cache")
    print(f"CACHE_DIR={shlex.quote(cache_dir)}")
    arguments = cache_arguments(options, options.dataset_metadata_path, options.dataset_base_path, cache_dir)
    print("CACHE_ARGS=(" + " ".join(shlex.quote(a) for a in arguments) + ")")
    val_cache_dir, val_arguments = "", []
    if options.val_metadata_path:
        val_cache_dir = options.val_cache or str(Path(options.output_path).parent / "latent_cache_val")
        val_arguments = cache_arguments(options, options.val_metadata_path,
                                        options.val_base_path or options.dataset_base_path, val_cache_dir)
    print(f"VAL_CACHE_DIR={shlex.quote(val_cache_dir)}")
    print("VAL_CACHE_ARGS=(" + " ".join(shlex.quote(a) for a in val_arguments) + ")")


def paths_read(options, cached: bool = False) -> list[tuple[str, str, str]]:
    """(option, value, "file" or "folder") of every path the run reads, as given (relative ones not yet resolved).
    The preset itself is read (and checked) with the options; the demo's catalogue is made by the launcher and a
    cache that --cached builds is written, not read: none of them is listed."""
    wanted = []
    if not options.demo:
        wanted += [("dataset_metadata_path", "file"), ("dataset_base_path", "folder"), ("model_dir", "folder"),
                   ("val_metadata_path", "file"), ("val_base_path", "folder")]
    if not cached:
        wanted += [("cache", "folder"), ("val_cache", "folder")]
    wanted += [("sample_prompts", "file")]
    return [(key, str(getattr(options, key)), kind) for key, kind in wanted if getattr(options, key, None)]


def check_paths(options, cached: bool, project_root: str | None) -> int:
    """Print each path the run reads and what it resolved to; 2 naming the first missing one and the folder it
    was resolved against (and the project root, when the path is there instead)."""
    from pathlib import Path

    here, read = Path.cwd(), paths_read(options, cached)
    if read:
        print(f"reads (relative paths are taken from the current folder, {here}):")
    for key, value, kind in read:
        resolved = (here / value).resolve()
        present = resolved.is_file() if kind == "file" else resolved.is_dir()
        print(f"  --{key:<22} {resolved}{'' if present else f'   MISSING ({kind})'}")
        if present:
            continue
        where = "" if Path(value).is_absolute() else f" (resolved against the current folder {here})"
        hint = ""
        if project_root and not Path(value).is_absolute() and (Path(project_root) / value).exists():
            hint = f"; it is there under the project folder: run from {project_root}, or give an absolute path"
        print(f"error: --{key} {value}: no such {kind}: {resolved}{where}{hint}", file=sys.stderr)
        return 2
    if options.demo:
        data, run = (here / options.dataset_base_path).parent.resolve(), (here / options.output_path).resolve()
        print(f"demo: writes its catalogue and metadata under {data}, the run under {run}")
    return 0


def projected_line(options, world_size: int, cached: bool, assume: str | None = None, nodes: int | None = None) -> str:
    """The doctor's projected run length for these options on this machine's GPUs (or ``assume``'s)."""
    from diffsynth_mbc.doctor import estimates
    from diffsynth_mbc.doctor.projection import count_media
    from diffsynth_mbc.gpu import known_gpu, nvidia_smi_device, resolve_precision

    if assume:
        spec = known_gpu(assume)
        rates_from = spec.name
    else:
        found = nvidia_smi_device()
        if found is None:
            return ("projected run length: unknown without a GPU (the speed model covers GPUs; "
                    "python -m diffsynth_mbc.doctor --probe N measures this machine)")
        spec, rates_from, _ = found
    precision, _ = resolve_precision(options.mixed_precision, spec.capability)
    nodes = nodes or estimates.nodes_from_environment()
    run = estimates.estimate_run(options, spec, rates_from, precision, gpus=max(1, world_size // nodes), nodes=nodes,
                                 cached_launch=cached, media=count_media(options.dataset_metadata_path))
    if run.projection is None:
        return f"projected run length: unknown: {run.speed['unknown']}"
    cache = run.projection.cache_line()
    return run.projection.line() + (f"\n  {cache}" if cache else "")


def build_parser() -> argparse.ArgumentParser:
    parser = FlagParser(prog="python -m diffsynth_mbc.plan", add_help=True, allow_abbrev=False,
                        passes_on_to=training_parser)
    parser.add_argument("--world_size", type=int, required=True, help="total processes (GPUs) of the run")
    parser.add_argument("--paths-only", action="store_true",
                        help="only validate the flags and print OUTPUT_PATH=... LOG_DIR=... CHECKPOINT_DIR=... (reads no data)")
    parser.add_argument("--cache-commands", action="store_true",
                        help="print CACHE_DIR=..., CACHE_ARGS=(...) (and VAL_ CACHE_... for --val_metadata_path): "
                             "the arguments of `python -m diffsynth_mbc.cache` for the same preset and flags")
    parser.add_argument("--cached", action="store_true",
                        help="the run builds the latent cache first (the launchers' --cached): its time is projected too")
    parser.add_argument("--nodes", type=int, help="nodes of the run (default: NUM_MACHINES, else 1); --world_size "
                                                  "counts the GPUs of all of them")
    parser.add_argument("--check-paths", action="store_true",
                        help="print every path the run reads, resolved; exit 2 naming the first missing one")
    parser.add_argument("--project-root", help="with --check_paths: also say when a missing relative path is there")
    parser.add_argument("--assume", help="project the run's length for this GPU (python -m diffsynth_mbc.doctor "
                                         "--help lists them) instead of this machine's")
    return parser


def main(argv: list[str] | None = None) -> int:
    known, train_argv = build_parser().parse_known_args(argv)
    try:
        options = resolve_options(train_argv)
        if known.cache_commands:
            print_cache_commands(options)
            return 0
        if known.check_paths:
            return check_paths(options, known.cached, known.project_root)
        if known.paths_only:
            print(f"OUTPUT_PATH={shlex.quote(options.output_path)}")
            print(f"LOG_DIR={shlex.quote(options.log_dir)}")
            print(f"CHECKPOINT_DIR={shlex.quote(options.checkpoint_dir)}")
            return 0
        from diffsynth_mbc.doctor.projection import count_media

        videos, images = count_media(options.dataset_metadata_path)
        plan = plan_from_options(options, rows=videos + images, images=images, world_size=known.world_size,
                                 datasets=metadata_counts(options))
    except FileNotFoundError as exc:
        print(f"error: metadata not found: {exc.filename}", file=sys.stderr)
        return 2
    except (OptionsError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"step plan: {options.dataset_metadata_path}", file=sys.stderr)
    repeat = "repeats per catalogue" if plan.datasets else f"repeat {plan.repeat}"
    kinds = f" ({plan.videos:,} videos + {plan.images:,} images)" if plan.images else ""
    print(f"  rows {plan.rows:,}{kinds} x {repeat} = {plan.samples_per_epoch:,} samples per epoch", file=sys.stderr)
    for item in plan.dataset_dicts():
        print(f"    {item['name']}: {item['rows']:,} rows ({item['videos']:,} videos + {item['images']:,} images) "
              f"x repeat {item['repeat'] * plan.repeat} = {item['samples_per_epoch']:,} samples", file=sys.stderr)
    print(f"  GPUs {plan.world_size} -> {plan.samples_per_rank_per_epoch:,} samples per GPU per epoch", file=sys.stderr)
    batch = (f"batches of {plan.batch_size} videos / {plan.image_batch_size} images" if plan.images
             else f"batch {plan.batch_size}")
    print(f"  {batch} x accumulation {plan.gradient_accumulation} -> "
          f"{plan.steps_per_epoch:,} optimizer steps per GPU per epoch", file=sys.stderr)
    print(f"  epochs {plan.num_epochs} -> {plan.total_steps:,} steps in total (every GPU runs these)", file=sys.stderr)
    print(f"  {plan.describe_modes()}", file=sys.stderr)
    precision = {"auto": "auto: bf16 on GPUs with native bf16 (A100, H100), fp16 with loss scaling below (V100)"}
    print(f"  precision {precision.get(options.mixed_precision, options.mixed_precision)} "
          "(the training prints what it chose)", file=sys.stderr)
    try:
        line = projected_line(options, known.world_size, known.cached, known.assume, known.nodes)
    except ValueError as exc:   # an unknown --assume name, or a precision this GPU cannot take
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"  {line}", file=sys.stderr)
    if not line.startswith("projected run length: unknown"):
        print("  (where each figure comes from: python -m diffsynth_mbc.doctor with the same flags)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
