"""One sweep: which files and clips, the settings they render and validate with, the rendering (each process its
share of the missing clips, each clip's record kept as it is written), the validation, and ``sweep.json`` and
``sweep.html`` at the end (rank 0)."""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

from diffsynth_mbc.atomic import atomic_write_json, atomic_write_text
from diffsynth_mbc.errors import OptionsError
from diffsynth_mbc.run_layout import (RUN_OPTIONS, SWEEP_HTML, SWEEP_JSON, SWEEP_RECORDS, SWEEP_RECORDS_GLOB,
                                      sweep_records_name)
from diffsynth_mbc.sample.lora_files import refuse_other_base, sweep_files, with_digests
from diffsynth_mbc.sample.render import Renderer, fitting_settings, rendering_settings, say, validation_of
from diffsynth_mbc.sample.sheet import summary_lines, sweep_page
from diffsynth_mbc.sample.sweep_plan import best_file, gain_words, judging_notes, plan_clips, read_records, rendered
from diffsynth_mbc.sample_prompts import load_sample_prompts, parse_strengths
from diffsynth_mbc.training.options.run_options import TrainOptions
from diffsynth_mbc.training.evaluation.validation import validation_settings
from diffsynth_mbc.training.options.run_record import read_run_options

DEMO_BASE = "Wan2.2-TI2V-5B (demo)"
RELEASE_BASE = "Wan2.2-TI2V-5B"


def sweep_options(args, given: dict, run: TrainOptions | None) -> TrainOptions:
    """The settings a sweep renders and validates with: the run's (``run_options.json``), then what is ``given``
    (the training's flags, typed and checked; the model's aside)."""
    changes = dict(given)
    if args.demo:
        changes.update(demo=True, model_dir=None, model_id=None)
    elif args.model_dir or args.model_id:
        changes.update(demo=False, model_dir=args.model_dir, model_id=args.model_id)
    elif run is None:
        raise OptionsError(f"the files are not a run's (no {RUN_OPTIONS} beside them) and no model is given: pass "
                           "--demo, --model_dir or --model_id")
    options = (run or TrainOptions()).replace(output_path=str(args.output), **changes)
    if args.validate and not options.val_metadata_path and not options.val_cache:
        raise OptionsError("--validate: " + ("the run validated nothing (no --val_metadata_path)" if run else
                                             "the files are not a run's") + "; pass --val_metadata_path")
    return options


def runs_of(files: list) -> dict[str, TrainOptions]:
    """Each run's options (its ``run_options.json``) by its output folder, in the order --lora named the runs."""
    ordered = sorted((item for item in files if item.run_dir), key=lambda item: item.source)
    runs = {run_dir: read_run_options(run_dir) for run_dir in dict.fromkeys(item.run_dir for item in ordered)}
    return {run_dir: options for run_dir, options in runs.items() if options is not None}


def known_records(output: Path) -> dict[str, dict]:
    """Clips recorded in ``sweep.json`` and, after an interrupted invocation, in each process's records."""
    records = read_records(output)
    for path in sorted((output / SWEEP_RECORDS).glob(SWEEP_RECORDS_GLOB)):
        try:
            records.update({item["path"]: item for item in json.loads(path.read_text(encoding="utf-8"))})
        except (OSError, ValueError, KeyError, TypeError):
            continue
    return records


def run_sweep(args, given: dict) -> int:
    from diffsynth_mbc.training.distributed.accelerator import start_evaluation_accelerator
    from diffsynth_mbc.training.distributed.collectives import gather_from_all, wait_for_everyone

    output = Path(args.output)
    strengths = parse_strengths(args.strengths, flag="--strengths")
    files = sweep_files(args.lora, ema=args.ema)
    runs = runs_of(files)
    options = sweep_options(args, given, next(iter(runs.values()), None))
    model = DEMO_BASE if options.demo else RELEASE_BASE
    refuse_other_base(files, model)
    prompts = load_sample_prompts(args.prompts, height=options.height, width=options.width,
                                  num_frames=options.num_frames, seed=options.seed, source="prompts file")
    fitting = fitting_settings(files, options.demo, model)   # every file fits the model, checked before it loads
    files = with_digests(files)
    accelerator = start_evaluation_accelerator(options)
    rendering = rendering_settings(options, accelerator)
    clips = plan_clips(prompts, files, strengths, rendering)
    output.mkdir(parents=True, exist_ok=True)
    records = known_records(output)
    todo = [clip for clip in clips if not rendered(clip, output, records)]
    main = accelerator.is_main_process
    notes = judging_notes(validation_settings(options), {run_dir: validation_settings(own) for run_dir, own
                                                         in runs.items()}, files) if args.validate else []
    if main:
        say(f"sweep: {len(files)} file(s) x {len(prompts)} prompt(s) at strength {args.strengths}: {len(clips)} clips, "
            f"{len(todo)} to render" + (f" on {accelerator.num_processes} processes" if accelerator.num_processes > 1
                                        else ""))
        for note in notes:
            say(note)
    renderer = Renderer(options, accelerator, fitting)
    mine = render_share(renderer, todo[accelerator.process_index::accelerator.num_processes], files, prompts, output,
                        accelerator.process_index, main)
    validated = validate_files(renderer, options, files, records_of_files(output), rendering) if args.validate \
        else None
    everyone = gather_from_all(accelerator, mine, None, "processes at the end of the sweep")
    if main:
        for share in everyone:
            records.update(share)
        finish(output, files, prompts, strengths, clips, records, validated, notes)
    wait_for_everyone(accelerator)
    return 0


def render_share(renderer, share: list, files: list, prompts: list, output: Path, rank: int, main: bool) -> dict:
    """Render this process's clips, each written whole (temp file, then rename) and recorded as it is."""
    from diffsynth_mbc.data.cache.progress import ProgressView
    from diffsynth_mbc.training.evaluation.sample_clips import write_clip

    mine: dict[str, dict] = {}
    records_file = output / SWEEP_RECORDS / sweep_records_name(rank)
    view = ProgressView(len(share), rank, 1, enabled=main, label="rendering", unit="clips")
    try:
        for clip in share:
            item = files[clip.file_index] if clip.file_index is not None else files[0]
            renderer.use(item.path)   # strength 0 (the base model) renders with any file's layers at zero
            prompt = prompts[clip.prompt_index]
            started = time.monotonic()
            frames = renderer.render(prompt, clip.strength)
            target = output / clip.path
            write_clip(target.parent, target.name, frames)
            mine[clip.path] = {"path": clip.path, "video": f"{clip.path}.mp4", "still": f"{clip.path}.png",
                               "prompt": prompt.prompt, "prompt_index": clip.prompt_index + 1, "seed": prompt.seed,
                               "file": None if clip.file_index is None else item.key, "strength": clip.strength,
                               "seconds": round(time.monotonic() - started, 3), "settings": clip.settings}
            atomic_write_json(records_file, list(mine.values()))
            view.advance()
    finally:
        view.close()
    return mine


def records_of_files(output: Path) -> dict[str, dict]:
    """The validation figures an earlier invocation measured, by file path, with what they were measured of."""
    try:
        saved = json.loads((output / SWEEP_JSON).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    found = {item["path"]: item for item in saved.get("files") or [] if isinstance(item, dict) and "path" in item}
    if isinstance(saved.get("base"), dict):
        found["base"] = saved["base"]
    return found


def validate_files(renderer, options, files: list, earlier: dict, rendering: dict) -> dict:
    """{file path: its validation figures, "base": the base model's}: the training's validator on each file's weights
    (figures an earlier invocation measured of the same bytes, settings, model, precision and device are kept)."""
    made_of = {"val_settings": validation_settings(options), "val_rendering": rendering}
    validator, results = None, {}
    for item in files:
        before = earlier.get(item.path) or {}
        if before.get("val_loss") is not None and all(before.get(key) == value for key, value in made_of.items()) \
                and before.get("val_file") == item.digest:
            results[item.path] = {key: value for key, value in before.items() if key.startswith("val_")}
            continue
        renderer.use(item.path)
        if validator is None or validator.module is not renderer.module:
            validator = renderer.validator(options)
        results[item.path] = {**validation_of(validator), **made_of, "val_file": item.digest}
    base = earlier.get("base") or {}
    if base.get("val_loss") is not None and all(base.get(key) == value for key, value in made_of.items()):
        results["base"] = base
    else:
        if validator is None:
            renderer.use(files[0].path)
            validator = renderer.validator(options)
        results["base"] = {**validation_of(validator, base=True), **made_of}
    return results


def write_outputs(output: Path, record: dict, page: str) -> None:
    atomic_write_json(output / SWEEP_JSON, record, indent=1)
    atomic_write_text(output / SWEEP_HTML, page)


def finish(output: Path, files, prompts, strengths, clips, records, validated, notes: list[str]) -> None:
    """``sweep.json`` and ``sweep.html`` from every clip recorded; the best file said on the terminal."""
    file_records = [{**item.as_dict(), **((validated or {}).get(item.path) or {})} for item in files]
    base = (validated or {}).get("base") or None
    base_loss = base.get("val_loss") if base else None
    best = best_file(file_records, base_loss)
    clip_records = [records[clip.path] for clip in clips if clip.path in records]
    # the sheet's columns: the base model (strength 0), the best file's (on screen without scrolling), then each
    # other file in step order, one column per strength
    order = sorted(range(len(files)), key=lambda index: not best or file_records[index]["key"] != best["key"])
    kinds = ([(None, 0.0)] if 0 in strengths else []) + [(index, strength) for index in order
                                                          for strength in strengths if strength != 0]
    columns = [{"file": None, "strength": 0.0, "val_loss": base_loss} if index is None else
               {"file": file_records[index], "strength": strength, "base_val_loss": base_loss}
               for index, strength in kinds]
    column_of = {kind: number for number, kind in enumerate(kinds)}
    cells = {(clip.prompt_index, column_of[(clip.file_index, clip.strength)]): clip.path
             for clip in clips if clip.path in records}
    record = {"prompts": [prompt.as_dict() for prompt in prompts], "strengths": strengths, "files": file_records,
              "base": base, "clips": clip_records, "best": best, "validation_notes": notes}
    summary = summary_lines(best, file_records, notes, strengths, validated is not None)
    page = sweep_page(prompts, columns, cells, best["key"] if best else None, f"LoRA sweep: {output.resolve().name}",
                      summary)
    write_outputs(output, record, page)
    shutil.rmtree(output / SWEEP_RECORDS, ignore_errors=True)
    missing = len(clips) - len(clip_records)
    say(f"sweep: {len(clip_records)} of {len(clips)} clips in {output}" + (f" ({missing} not rendered)" if missing
                                                                           else "") + f"; open {output / SWEEP_HTML}")
    if best:
        gain = f", {gain_words(best['gain'])} model's {best['val_loss_base']:.5g}" if best["gain"] is not None else ""
        run = f" of {best['run']}" if best["run"] else ""
        say(f"best: {best['label']}{run} (step {best['step']}) val_loss {best['val_loss']:.5g}{gain}: {best['path']}")
