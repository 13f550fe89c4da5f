"""Print the step plan of a training before it starts: ``python -m diffsynth_mbc.plan --gpus N [train flags]``.

Reads the same preset and flags as ``diffsynth_mbc.training.recipe`` and counts the metadata rows the way
DiffSynth's loader will, and prints the plan on stderr: the training's own ``plan_from_options``, and the
doctor's projected run length of that same plan. ``--gpus`` counts the GPUs of one node, as the launchers'
and the doctor's do (x ``--nodes``); the old ``--world_size`` (every node's GPUs together) still works.
``--brief`` prints what the launchers show (within 80 columns), ``--detail_file`` appends the full plan to the
run's log. ``--paths_only`` reads no data and prints the output and log folders as shell assignments for the
launchers.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
from pathlib import Path

from diffsynth_mbc.data.dataset_list import metadata_counts
from diffsynth_mbc.data.media.frame_selection import frame_arguments
from diffsynth_mbc.errors import OptionsError
from diffsynth_mbc.flags import FlagParser
from diffsynth_mbc.training.options import build_parser as training_parser, resolve_options
from diffsynth_mbc.training.plan.step_plan import bucket_samples_of_metadata, plan_from_options, step_count, step_span

# --check-paths' exit code for a --resume of a run that has ended: the launcher says so and ends, exit 0, as the
# training would (launchers/common.sh).
RUN_HAS_ENDED = 3


def cache_arguments(options, metadata_path: str, base_path: str, cache_dir: str) -> list[str]:
    from diffsynth_mbc.data.media.size_table import table_path_in

    arguments = ["--dataset_base_path", base_path, "--dataset_metadata_path", metadata_path,
                 "--height", str(options.height), "--width", str(options.width),
                 "--num_frames", str(options.num_frames), "--cache_dir", cache_dir, "--seed", str(options.seed),
                 "--decoder", options.decoder, "--log_dir", options.log_dir]   # the monitor sees the build there
    arguments += frame_arguments(options)
    if options.buckets != "off":   # the cache stores each entry at its bucket's shape, sized as the run sizes it
        arguments += ["--buckets", options.buckets, "--size_table", table_path_in(options.output_path)]
    if options.resolution_stages and metadata_path == options.dataset_metadata_path:   # each stage's latents too
        arguments += ["--resolution_stages", options.resolution_stages.text]
    if options.sample_prompts and metadata_path == options.dataset_metadata_path:
        arguments += ["--sample_prompts", options.sample_prompts]
    affixes = {"caption_prefix": options.caption_prefix, "caption_suffix": options.caption_suffix}
    for key, value in affixes.items():   # part of what the cache encodes
        if value:
            arguments += [f"--{key}", value]
    if options.mixed_precision != "auto":   # auto: the cache picks as the training will, from the GPU
        arguments += ["--dtype", options.mixed_precision]
    if options.demo:
        return arguments + ["--demo"]
    if options.model_dir:
        return arguments + ["--model_dir", options.model_dir]
    return arguments + ["--model_id", options.model_id or "Wan-AI/Wan2.2-TI2V-5B"]


def cache_dirs(options) -> tuple[str, str]:
    """(the cache folder, the validation cache folder or "") a --cached launch builds: --cache/--val_cache, else
    beside the output folder."""
    from pathlib import Path

    from diffsynth_mbc.run_layout import DEFAULT_CACHE, DEFAULT_VAL_CACHE

    cache_dir = options.cache or str(Path(options.output_path).parent / DEFAULT_CACHE)
    val_cache_dir = ""
    if options.val_metadata_path:
        val_cache_dir = options.val_cache or str(Path(options.output_path).parent / DEFAULT_VAL_CACHE)
    return cache_dir, val_cache_dir


def print_cache_commands(options) -> None:
    """Shell assignments for the launchers; the default cache folder sits beside the output folder."""
    cache_dir, val_cache_dir = cache_dirs(options)
    print(f"CACHE_DIR={shlex.quote(cache_dir)}")
    arguments = cache_arguments(options, options.dataset_metadata_path, options.dataset_base_path, cache_dir)
    print("CACHE_ARGS=(" + " ".join(shlex.quote(a) for a in arguments) + ")")
    val_arguments = []
    if val_cache_dir:
        val_arguments = cache_arguments(options, options.val_metadata_path,
                                        options.val_base_path or options.dataset_base_path, val_cache_dir)
    print(f"VAL_CACHE_DIR={shlex.quote(val_cache_dir)}")
    print("VAL_CACHE_ARGS=(" + " ".join(shlex.quote(a) for a in val_arguments) + ")")


def paths_read(options, cached: bool = False, demo_root: str | None = None) -> list[tuple[str, str, str]]:
    """(what, value, "file" or "folder") of every path the run reads, as given (relative ones not yet resolved):
    each option's (``--key``) and, with a ``datasets:`` list, each catalogue's base_path and metadata_path (the
    combined metadata is written from them). The preset itself is read (and checked) with the options; the demo's
    own catalogue (``demo_root``: the launcher writes it there) and a cache that --cached builds are written, not
    read: none of them is listed."""
    wanted = []
    if not (options.datasets or (options.demo and demo_root)):
        wanted += [("dataset_metadata_path", options.dataset_metadata_path, "file"),
                   ("dataset_base_path", options.dataset_base_path, "folder")]
    if not options.demo:
        wanted += [("model_dir", options.model_dir, "folder")]
    wanted += [("val_metadata_path", options.val_metadata_path, "file"),
               ("val_base_path", options.val_base_path, "folder")]
    if not cached:
        wanted += [("cache", options.cache, "folder"), ("val_cache", options.val_cache, "folder")]
    wanted += [("sample_prompts", options.sample_prompts, "file")]
    read = [(f"--{key}", str(value), kind) for key, value, kind in wanted if value]
    for position, catalogue in enumerate(options.datasets or ()):
        read += [(f"datasets[{position}] base_path", catalogue.base_path, "folder"),
                 (f"datasets[{position}] metadata_path", catalogue.metadata_path, "file")]
    return read


def check_paths(options, cached: bool, project_root: str | None, demo_root: str | None = None,
                world_size: int = 1) -> int:
    """Print each path the run reads and what it resolved to; 2 naming the first missing one and the folder it
    was resolved against (and the project root, when the path is there instead), or what else the files refuse;
    ``RUN_HAS_ENDED`` saying so for a --resume of a run that has ended. The demo says what it trains on: the catalogue
    it writes under ``demo_root``, or the one it was given."""
    from pathlib import Path

    here, read = Path.cwd(), paths_read(options, cached, demo_root)
    if read:
        print(f"reads (relative paths are taken from the current folder, {here}):")
    for key, value, kind in read:
        resolved = (here / value).resolve()
        present = resolved.is_file() if kind == "file" else resolved.is_dir()
        print(f"  {key:<24} {resolved}{'' if present else f'   MISSING ({kind})'}")
        if present:
            continue
        where = "" if Path(value).is_absolute() else f" (resolved against the current folder {here})"
        hint = ""
        if project_root and not Path(value).is_absolute() and (Path(project_root) / value).exists():
            hint = f"; it is there under the project folder: run from {project_root}, or give an absolute path"
        print(f"error: {key} {value}: no such {kind}: {resolved}{where}{hint}", file=sys.stderr)
        return 2
    refusal, ended = refusal_of_the_files(options, world_size)
    if refusal:
        print(f"error: {refusal}", file=sys.stderr)
        return 2
    if ended:   # the launcher ends here, as the training would: nothing started, nothing written
        print(ended, file=sys.stderr)
        return RUN_HAS_ENDED
    if options.demo:
        run = (here / options.output_path).resolve()
        if demo_root:
            print(f"demo: writes its catalogue and metadata under {(here / demo_root).resolve()}, the run under {run}")
        else:
            data = "the --datasets catalogues" if options.datasets else \
                f"{(here / options.dataset_metadata_path).resolve()}"
            print(f"demo: the demo model trains on {data} (no catalogue of its own written), the run under {run}")
    return 0


def resumed_id(options) -> str:
    """The run a ``--resume`` goes on with (its checkpoint's run id), "" for a fresh run or an unreadable one: the
    launcher names the launch by it, so one run id is on the screen."""
    from diffsynth_mbc.training.checkpoints.folder import resumed_run_id

    if not options.resume:
        return ""
    try:
        return resumed_run_id(options.resume, options.checkpoint_dir) or ""
    except (OSError, ValueError):
        return ""


def refusal_of_the_files(options, world_size: int) -> tuple[str | None, str | None]:
    """What the training would refuse from the files alone (another run's checkpoints or LoRA files in a fresh
    run's folders, a --resume without a usable checkpoint or on other settings or media, missing media files that
    alone would stop the run), said before anything starts: the launch stops here, and --dry_run finds it too; or,
    for a --resume of a run that has ended, what the training says of it (nothing to train): (refusal, None),
    (None, that note) or (None, None)."""
    from diffsynth_mbc.training.checkpoints.resume import nothing_to_train, refuse_early

    run_id = options.run_id or resumed_id(options) or "a-new-run"
    try:
        folder = refuse_early(options, run_id, world_size)
    except OptionsError as exc:
        return str(exc), None
    return None, nothing_to_train(options, folder) if options.resume else None


def projection_of(options, plan, cached: bool, assume: str | None, nodes: int):
    """(the doctor's projection of this plan on this machine's GPUs or ``assume``'s, None, why it is unknown)."""
    from diffsynth_mbc.training.plan import estimates
    from diffsynth_mbc.gpu import known_gpu, nvidia_smi_device, resolve_precision

    if assume:
        spec = known_gpu(assume)
        rates_from = spec.name
    else:
        found = nvidia_smi_device()
        if found is None:
            return None, "without a GPU (python -m diffsynth_mbc.doctor --probe N measures this machine)"
        spec, rates_from, _ = found
    precision, _ = resolve_precision(options.mixed_precision, spec.capability)
    videos, images = plan.videos, plan.images
    run = estimates.estimate_run(options, spec, rates_from, precision, gpus=max(1, plan.world_size // nodes),
                                 nodes=nodes, cached_launch=cached, media=(videos, images), plan=plan)
    if run.projection is None:
        return None, run.speed["unknown"]
    return run.projection, ""


def frame_rate_line(options) -> str | None:
    """The clips' frame rates the metadata records and what the run does with them (``--source_fps``); None without
    clips."""
    from diffsynth_mbc.data.media.frame_selection import describe_frame_rates
    from diffsynth_mbc.training.plan.run_length import metadata_media

    media = metadata_media(options.dataset_metadata_path)
    return describe_frame_rates(media.frame_rates, media.unknown_rate, options.source_fps, options.num_frames)


def plan_lines(options, plan) -> list[str]:
    """The step plan in full: rows, catalogues, GPUs, batches, steps, modes, frame rates, precision."""
    repeat = "repeats per catalogue" if plan.datasets else f"repeat {plan.repeat}"
    kinds = f" ({plan.videos:,} videos + {plan.images:,} images)" if plan.images else ""
    lines = [f"step plan: {options.dataset_metadata_path}",
             f"  rows {plan.rows:,}{kinds} x {repeat} = {plan.samples_per_epoch:,} samples per epoch"]
    lines += [f"    {item['name']}: {item['rows']:,} rows ({item['videos']:,} videos + {item['images']:,} images) "
              f"x repeat {item['repeat'] * plan.repeat} = {item['samples_per_epoch']:,} samples"
              for item in plan.dataset_dicts()]
    batch = (f"batches of {plan.batch_size} videos / {plan.image_batch_size} images" if plan.images
             else f"batch {plan.batch_size}")
    precision = {"auto": "auto: bf16 on GPUs with native bf16 (A100, H100), fp16 with loss scaling below (V100)"}
    return lines + [
        f"  GPUs {plan.world_size} -> {plan.samples_per_rank_per_epoch:,} samples per GPU per epoch",
        f"  {batch} x accumulation {plan.gradient_accumulation} -> "
        f"{plan.steps_per_epoch:,} optimizer steps per GPU per epoch",
        f"  epochs {plan.num_epochs} -> {plan.total_steps:,} steps in total (every GPU runs these)",
        f"  {plan.describe_modes()}",
        *[f"  {line}" for line in (frame_rate_line(options),) if line],
        *[f"  {line}" for line in plan.describe_buckets()],
        *[f"  {line}" for line in plan.describe_stages()],
        f"  precision {precision.get(options.mixed_precision, options.mixed_precision)} "
        "(the training prints what it chose)"]


def projection_lines(run, unknown: str) -> list[str]:
    if run is None:
        return [f"  projected run length: unknown {unknown}"]
    best = run.evaluation.best_line() if run.evaluation is not None else None
    extra = [line for line in (run.cache_line(), run.evaluation_line(), run.stage_line(), best) if line]
    return ([f"  {run.line()}"] + [f"  {line}" for line in extra]
            + ["  (where each figure comes from: python -m diffsynth_mbc.doctor with the same flags)"])


def brief_lines(plan, run, unknown: str, width: int = 80, frame_rates: str | None = None) -> list[str]:
    """What the launchers show of the plan, each line within ``width`` columns: the totals, the modes, the clips'
    frame rates and the projected length (the full plan goes to the run's log)."""
    import textwrap

    from diffsynth_mbc.training.plan.run_length import duration

    if run is None:
        projected = f"projected run length: unknown {unknown.split(' (')[0]}"
    else:
        cache = (f"; the latent cache build {duration(run.all_cache_seconds)}"
                 if run.cache_build_seconds is not None else "")
        projected = f"projected run length: {run.up_to}{duration(run.total_seconds)} ({run.kind}{cache})"
    epochs = f"{plan.num_epochs} epoch{'s' if plan.num_epochs != 1 else ''}"
    gpus = f"{plan.world_size} GPU{'s' if plan.world_size != 1 else ''}"
    lines = [f"step plan: {step_count(plan.total_steps)} in total per GPU "
             f"({plan.steps_per_epoch:,} x {epochs}, {gpus})",
             "  " + plan.describe_modes().replace("modes per epoch: ", "modes/epoch: ", 1),
             *([f"  {frame_rates}"] if frame_rates else []), f"  {projected}"]
    if plan.stages:
        lines.append("  stages: " + ", then ".join(f"{row['size']} for {step_span(row['from_step'], row['to_step'])}"
                                                   for row in plan.stage_dicts()))
    if run is not None and run.evaluation is not None and run.evaluation.ends_early:
        lines.append(f"  {run.evaluation.best_line()}")
    if plan.bucket_samples:
        repeated = sum(row["repeated_samples"] for row in plan.bucket_dicts())
        lines.insert(2, f"  buckets: {len(plan.bucket_samples)} in use, every GPU on one at a time "
                        f"({repeated:,} samples repeated per epoch; the bucket table is in the log)")
    return [part for line in lines for part in textwrap.wrap(line, width, subsequent_indent="    ")]


def build_parser() -> argparse.ArgumentParser:
    parser = FlagParser(prog="python -m diffsynth_mbc.plan", add_help=True, allow_abbrev=False,
                        passes_on_to=training_parser)
    parser.add_argument("--gpus", type=int, help="GPUs (processes) per node of the run, as the launchers' --gpus")
    parser.add_argument("--world_size", type=int, help=argparse.SUPPRESS)   # the old name: every node's GPUs together
    parser.add_argument("--nodes", type=int, help="nodes of the run (default: NUM_MACHINES, else 1)")
    parser.add_argument("--paths-only", action="store_true",
                        help="only validate the flags and print OUTPUT_PATH=... LOG_DIR=... CHECKPOINT_DIR=... (reads no data)")
    parser.add_argument("--cache-commands", action="store_true",
                        help="print CACHE_DIR=..., CACHE_ARGS=(...) (and VAL_ CACHE_... for --val_metadata_path): "
                             "the arguments of `python -m diffsynth_mbc.cache` for the same preset and flags")
    parser.add_argument("--cached", action="store_true",
                        help="the run builds the latent cache first (the launchers' --cached): its time is projected too")
    parser.add_argument("--check-paths", action="store_true",
                        help="print every path the run reads, resolved; exit 2 naming the first missing one or what "
                             "else the files refuse, 3 saying that the --resume's run has ended (nothing to train)")
    parser.add_argument("--project-root", help="with --check_paths: also say when a missing relative path is there")
    parser.add_argument("--demo-root", help="with --check_paths and a demo: the folder the launcher writes the demo's "
                                            "own catalogue into (its data paths are then not checked)")
    parser.add_argument("--assume", help="project the run's length for this GPU (python -m diffsynth_mbc.doctor "
                                         "--help lists them) instead of this machine's")
    parser.add_argument("--brief", action="store_true",
                        help="print only the totals, the modes and the projected length, within 80 columns")
    parser.add_argument("--detail-file", metavar="FILE",
                        help="also append the full plan to FILE (the launchers pass the run's log)")
    return parser


def world_size_of(known) -> tuple[int, int]:
    """(GPUs of every node, nodes) from --gpus x --nodes, or the old --world_size; OptionsError without either."""
    from diffsynth_mbc.training.plan.estimates import nodes_from_environment

    nodes = known.nodes or nodes_from_environment()
    if known.gpus is not None and known.world_size is not None:
        raise OptionsError("give --gpus (GPUs per node), not --world_size beside it")
    if known.world_size is not None:
        world_size = known.world_size
    elif known.gpus is not None:
        world_size = known.gpus * nodes
    else:
        raise OptionsError("--gpus N is required: the GPUs per node of the run (python -m diffsynth_mbc.plan --help)")
    if world_size < 1 or nodes < 1:
        raise OptionsError(f"--gpus and --nodes must be at least 1, got --gpus {known.gpus or world_size} "
                           f"--nodes {nodes}")
    return world_size, nodes


def files_not_found(options) -> str | None:
    """A line naming how many of the metadata's files are not where the training will look (a wrong
    --dataset_base_path, a moved archive), with the first of them; None when every file is there."""
    from diffsynth_mbc.data.metadata_csv import missing_files, read_metadata

    rows = list(read_metadata(options.dataset_metadata_path))
    missing = missing_files(rows, options.dataset_base_path)
    if not missing:
        return None
    first = missing[0] - 1
    path = os.path.join(options.dataset_base_path or "", str(rows[first].get("video") or ""))
    return (f"warning: {len(missing):,} of {len(rows):,} files were not found (row {first + 1}: "
            f"{rows[first].get('video')}, looked for at {path}): the training replaces each as bad media and "
            f"stops past --max_bad_media_fraction {options.max_bad_media_fraction:g}; is --dataset_base_path "
            f"({options.dataset_base_path}) right?")


def resume_elsewhere_line(options, world_size: int) -> str | None:
    """What a ``--resume`` on another number of GPUs than its checkpoint's does (``training/plan/elastic.py``), said
    with the plan; the training says the steps it counted. None for every other run."""
    from diffsynth_mbc.training.checkpoints.folder import complete_checkpoints, read_manifest

    if not options.resume:
        return None
    try:
        if options.resume == "latest":
            found = complete_checkpoints(options.checkpoint_dir)
            folder = found[-1][1] if found else None
        else:
            folder = Path(options.resume)
        manifest = read_manifest(folder) if folder is not None else None
    except (OSError, ValueError):
        return None
    saved = (manifest or {}).get("world_size")
    if not isinstance(saved, int) or saved == world_size:
        return None
    return (f"resume on {world_size} GPU{'s' if world_size != 1 else ''} from a {saved}-GPU checkpoint ({folder.name}, "
            f"step {manifest.get('step')}): the rest of its epoch is shared out over {world_size}, every sample of "
            "it once, and the steps are counted again (the training says how many); the learning-rate schedule goes "
            "on by samples seen")


def print_plan(options, known, plan, nodes: int) -> int:
    try:
        run, unknown = projection_of(options, plan, known.cached, known.assume, nodes)
    except ValueError as exc:   # an unknown --assume name, or a precision this GPU cannot take
        print(f"error: {exc}", file=sys.stderr)
        return 2
    missing = files_not_found(options)
    notes = [line for line in (missing, resume_elsewhere_line(options, plan.world_size)) if line]
    full = notes + plan_lines(options, plan) + projection_lines(run, unknown)
    if known.detail_file:
        try:
            with open(known.detail_file, "a", encoding="utf-8") as handle:
                handle.write("\n".join(full) + "\n")
        except OSError as exc:
            print(f"error: --detail_file {known.detail_file}: {exc.strerror}", file=sys.stderr)
            return 2
    brief = notes + brief_lines(plan, run, unknown, frame_rates=frame_rate_line(options))
    print("\n".join(brief if known.brief else full), file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    known, train_argv = build_parser().parse_known_args(argv)
    try:
        options = resolve_options(train_argv)
        if known.cache_commands:
            print_cache_commands(options)
            return 0
        if known.check_paths:
            given = known.gpus is not None or known.world_size is not None
            return check_paths(options, known.cached, known.project_root, known.demo_root,
                               world_size_of(known)[0] if given else 1)
        if known.paths_only:
            print(f"OUTPUT_PATH={shlex.quote(options.output_path)}")
            print(f"LOG_DIR={shlex.quote(options.log_dir)}")
            print(f"CHECKPOINT_DIR={shlex.quote(options.checkpoint_dir)}")
            print(f"RESUMED_RUN_ID={shlex.quote(resumed_id(options))}")
            return 0
        world_size, nodes = world_size_of(known)
        from diffsynth_mbc.training.plan.run_length import count_media

        videos, images = count_media(options.dataset_metadata_path)
        plan = plan_from_options(options, rows=videos + images, images=images, world_size=world_size,
                                 datasets=metadata_counts(options), bucket_samples=bucket_samples_of_metadata(options))
    except FileNotFoundError as exc:
        print(f"error: metadata not found: {exc.filename}", file=sys.stderr)
        return 2
    except (OptionsError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return print_plan(options, known, plan, nodes)


if __name__ == "__main__":
    raise SystemExit(main())
