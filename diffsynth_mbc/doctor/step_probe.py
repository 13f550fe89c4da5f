"""``python -m diffsynth_mbc.doctor --probe N``: N real optimizer steps of the run on this machine, measured.

The run's own settings (model, precision, compile, checkpointing, batches: every resolved option, written
to a temporary preset) train on two small metadata files, the first video rows and the first image rows
of the run's metadata (with ``--buckets aspect`` one file per bucket in use, that bucket's first rows: each
bucket's step time is measured apart, and the projection adds up each bucket's steps at its own), through
the real training entry (``python -m diffsynth_mbc.train``, one process) in a temporary folder that is
removed afterwards: nothing reaches the run's output, log or checkpoint folders. One epoch, no validation, samples, trackers or checkpoints. A run that trains from the latent
cache first builds a cache of each subset with ``python -m diffsynth_mbc.cache``, which measures the
encoding rate too. The first step(s) of each run are left out of the timing (model warm-up, compilation).
Read back: the rank's history ``training_gpu0.jsonl`` (``step_time_s``, ``samples`` per optimizer step)
and status file ``training_gpu0.json`` (the GPU's peak allocated memory, the largest residual magnitude the DiT's
blocks wrote and whether the stream was fp32); on the CPU the process's peak resident memory. The largest residual
is said against fp16's 65,504: the headroom a run in fp16 has, or how far past it the stream goes (fine with the fp32
residual stream, inf/NaN without it).
"""

from __future__ import annotations

import csv
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

from diffsynth_mbc.data.media.buckets import media_kind
from diffsynth_mbc.training.plan import estimates

from diffsynth_mbc import environment
from diffsynth_mbc.run_layout import CACHE_SUMMARY, history_path, status_path
from diffsynth_mbc.training.plan import run_length
from diffsynth_mbc.training.plan.residual_policy import FP16_MAX
from diffsynth_mbc.values import finite_number

LOG_TAIL = 3000
WARMUP_STEPS = 2   # left out of the timing: the first steps load kernels, autotune and compile
# What the probe changes in the run's options; everything else (model, precision, compile, checkpointing,
# LoRA, sizes, batches, decoder, workers) is the run's own.
NEUTRAL = {"datasets": None, "num_epochs": 1, "dataset_repeat": 1, "val_metadata_path": None, "val_base_path": None, "val_steps": None,
           "val_cache": None, "sample_prompts": None, "sample_steps": None, "checkpoint_steps": None,
           "checkpoint_minutes": None, "save_steps": None, "resume": None, "force_resume": False, "report_to": "none",
           "lr_scheduler": "constant", "warmup_steps": 0, "status_interval_s": 0.01, "print_every_s": 3600.0,
           "keep_old_histories": 0}


def write_subset(metadata_path: str, kind: str, rows_wanted: int, out: Path) -> int:
    """The first ``rows_wanted`` rows of one media type (repeated when there are fewer); how many distinct rows."""
    with open(metadata_path, newline="", encoding="utf-8-sig") as handle:
        reader = csv.DictReader(handle)
        fields = reader.fieldnames or []
        rows = []
        for row in reader:
            if media_type(row, fields) == kind:
                rows.append(row)
                if len(rows) == rows_wanted:
                    break
    return write_rows(fields, rows, rows_wanted, out)


def bucket_rows(options) -> tuple[list[str], dict[str, list[dict]]]:
    """``--buckets aspect``: (the metadata's columns, its rows by bucket key, ``video@1280x704``), each row in the
    bucket the training puts it in (its size from the run's size table)."""
    from diffsynth_mbc.data.media.row_buckets import bucket_keys
    from diffsynth_mbc.data.media.size_table import table_path_in

    with open(options.dataset_metadata_path, newline="", encoding="utf-8-sig") as handle:
        reader = csv.DictReader(handle)
        rows = list(reader)
        fields = reader.fieldnames or []
    by_key: dict[str, list[dict]] = {}
    for row, key in zip(rows, bucket_keys(rows, options.dataset_base_path, options.height, options.width,
                                              table_path=table_path_in(options.output_path))):
        by_key.setdefault(key, []).append(row)
    return fields, dict(sorted(by_key.items()))


def write_rows(fields: list[str], rows: list[dict], rows_wanted: int, out: Path) -> int:
    """``rows_wanted`` rows of ``rows`` (repeated when there are fewer) as a metadata file; how many distinct rows."""
    rows = rows[:rows_wanted]
    if rows:
        with open(out, "w", newline="", encoding="utf-8") as handle:
            writer = csv.DictWriter(handle, fieldnames=fields)
            writer.writeheader()
            writer.writerows(rows[i % len(rows)] for i in range(rows_wanted))
    return len(rows)


def media_type(row: dict, fields: list[str]) -> str:
    kind = (row.get("media_type") or "").strip().lower() if "media_type" in fields else ""
    if kind:
        return "image" if kind == "image" else "video"
    from diffsynth_mbc.data.convert.catalogue_rows import IMAGE_EXTENSIONS

    return "image" if Path(row.get("video") or "").suffix.lower().lstrip(".") in IMAGE_EXTENSIONS else "video"


def run_logged(command: list[str], log: Path, env: dict, cwd: str | None = None) -> tuple[int, int | None]:
    """(exit code, peak resident memory of the process in bytes, where the OS says it) of one command."""
    with open(log, "w", encoding="utf-8") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=cwd)
        try:
            _, status, usage = os.wait4(process.pid, 0)
        except KeyboardInterrupt:
            process.kill()
            raise
        process.returncode = os.waitstatus_to_exitcode(status)
    return process.returncode, usage.ru_maxrss * 1024 if sys.platform.startswith("linux") else None


def tail(log: Path) -> str:
    try:
        return log.read_text(errors="replace")[-LOG_TAIL:]
    except OSError:
        return ""


def child_environment() -> dict:
    env = {key: value for key, value in os.environ.items()
           if key not in (*environment.LAUNCH_VARIABLES, "RANK", "LOCAL_RANK", "WORLD_SIZE")}
    env["PYTHONUNBUFFERED"] = "1"
    return env


def build_cache(options, subset: Path, folder: Path, env: dict) -> tuple[str, float | None]:
    """A latent cache of the subset (the run trains from one); (its folder, encoding seconds per row)."""
    from diffsynth_mbc.training.plan.command import cache_arguments

    cache_dir = folder / "cache"
    arguments = cache_arguments(options, str(subset), options.dataset_base_path, str(cache_dir))
    if options.buckets != "off" and "--buckets" not in arguments:   # each entry encoded at its row's bucket
        arguments += ["--buckets", options.buckets]
    code, _ = run_logged([sys.executable, "-m", "diffsynth_mbc.cache", *arguments], folder / "cache.log", env)
    if code != 0:
        raise ProbeError(f"building the latent cache of the probe's rows failed (exit {code}):\n"
                         + tail(folder / "cache.log"))
    summary = json.loads((cache_dir / CACHE_SUMMARY).read_text())
    return str(cache_dir), encode_seconds_per_row(summary["per_rank"][0])


def encode_seconds_per_row(stats: dict) -> float | None:
    """Seconds per row of a cache build once it encodes: from the end of its first row to the end of its last,
    leaving out the models' load, the data workers' start and the first encode's warm-up (on an H200, 4 clips
    took 0.98 s a row counted from the load's end; their encodes take 0.38 s). With one row written: that row,
    after the load. None when nothing was written."""
    written = stats.get("written") or 0
    if written >= 2 and "first_row_done_s" in stats:
        return (stats["last_row_done_s"] - stats["first_row_done_s"]) / (written - 1)
    return (stats["seconds"] - stats.get("model_load_seconds", 0.0)) / written if written else None


class ProbeError(RuntimeError):
    """The probe's training or cache run failed; the message holds the tail of its log."""


def train(options, kind: str, subset: Path, folder: Path, env: dict, cache_dir: str | None) -> dict:
    """One training run on the subset; its measured step times and peak memory."""
    preset = {**options.recorded(), **NEUTRAL, "dataset_metadata_path": str(subset), "output_path": str(folder / "out"),
              "log_dir": str(folder / "logs"), "checkpoint_dir": str(folder / "checkpoints"),
              "run_id": f"doctor-probe-{folder.name}", "cache": cache_dir}
    (folder / "probe.yaml").write_text(yaml.safe_dump(preset, sort_keys=True), encoding="utf-8")
    code, rss = run_logged([sys.executable, "-m", "diffsynth_mbc.train", "--config", str(folder / "probe.yaml")],
                           folder / "train.log", env)
    status_file, history_file = status_path(folder / "logs", 0), history_path(folder / "logs", 0)
    status = json.loads(status_file.read_text()) if status_file.is_file() else {}
    if code != 0:
        message = (status.get("error") or {}).get("message") or ""
        raise ProbeError(f"the {kind} run failed (exit {code}){': ' + message if message else ''}:\n"
                         + tail(folder / "train.log"))
    lines = [json.loads(line) for line in history_file.read_text().splitlines() if line.strip()]
    steps = [line for line in lines if "step_time_s" in line and line.get("kind") != "val"]
    return {"steps": steps, "status": status, "rss": rss}


def summarise(run: dict, warmup: int, distinct_rows: int, encode_seconds: float | None) -> dict:
    steps = run["steps"]
    timed = steps[warmup:] or steps[-1:]
    gpu = run["status"].get("gpu") or {}
    shapes = [shape for s in timed for shape in s.get("shapes") or []]
    return {"seconds_per_step": round(statistics.median(s["step_time_s"] for s in timed), 4),
            "trained_at": shapes[0] if shapes and all(shape == shapes[0] for shape in shapes) else None,
            "samples_per_step": statistics.median(s.get("samples") or 1 for s in timed),
            "steps_timed": len(timed), "warmup_steps": len(steps) - len(timed), "distinct_rows": distinct_rows,
            "first_steps_s": [s["step_time_s"] for s in steps[:len(steps) - len(timed)]],
            "max_allocated_mb": gpu.get("run_peak_allocated_mb"),   # the status file's GPU reader (gpu.py)
            "peak_rss_mb": None if run["rss"] is None else round(run["rss"] / 2**20),
            "mixed_precision": run["status"].get("mixed_precision"),
            "attention_kernel": run["status"].get("attention_kernel"),
            **residual_figures(run["status"]),
            "encode_seconds_per_row": None if encode_seconds is None else round(encode_seconds, 4)}


def residual_figures(status: dict) -> dict:
    """The largest residual magnitude the run's blocks wrote (a number, or "inf"/"nan": the stream overflowed), fp16's
    headroom over it (65,504 / it: below 1 is past fp16's range) and whether the stream was fp32."""
    largest = status.get("largest_residual")
    number = finite_number(largest)
    return {"largest_residual": largest, "fp32_residual": status.get("fp32_residual"),
            "fp16_headroom": None if not number else round(FP16_MAX / number, 3)}


def probe_report(ours, options, result: dict) -> dict:
    """The probe's measurements and the run's length projected from them (``{"error": ...}`` on a failure); with
    --resolution_stages each stage is probed at its size on its own (``staged_probe``)."""
    if result["exit_code"] != 0:
        return {"error": "skipped: a check above failed (fix it first; the probe runs the real training)"}
    if options.resolution_stages:
        return staged_probe(ours, options, result)
    steps, warmup = ours.probe, WARMUP_STEPS
    cached = bool(options.cache) or ours.cached
    measured, env = {}, child_environment()
    with tempfile.TemporaryDirectory(prefix="mbc-probe-") as temporary:
        for unit, kind, write in probe_units(options, result.get("media") or {}):
            folder = Path(temporary) / unit.replace("@", "-")
            folder.mkdir()
            batch = options.batch_size if kind == "video" else estimates.image_batch(options)
            subset = folder / "metadata.csv"
            distinct = write((steps + warmup) * batch * options.gradient_accumulation_steps, subset)
            try:
                cache_dir, encode = build_cache(options, subset, folder, env) if cached else (None, None)
                run = train(options, unit, subset, folder, env, cache_dir)
            except ProbeError as exc:
                return {"error": str(exc), "measured": measured}
            measured[unit] = summarise(run, warmup, distinct, encode)
    return {"steps": steps, "warmup_steps": warmup, "measured": measured, "cached": cached,
            "projection": measured_projection(ours, options, result, measured)}


def staged_probe(ours, options, result: dict) -> dict:
    """--resolution_stages: the final size and every stage probed apart (each its own runs), and the run's length as
    each stage's share of the steps at its measured rate, the rest at the final size's; the cache build adds each
    stage's latents."""
    final = probe_report(ours, options.replace(resolution_stages=None), result)
    if "error" in final or not final.get("projection"):
        return final
    parts, staged = [], dict(final["projection"])
    rest = 1.0 - sum(stage.share for stage in options.resolution_stages)
    training, cache = final["projection"]["training_seconds"] * rest, final["projection"]["cache_build_seconds"]
    for stage in options.resolution_stages:
        at = probe_report(ours, options.replace(width=stage.width, height=stage.height, resolution_stages=None,
                                                num_frames=stage.num_frames or options.num_frames), result)
        if "error" in at:
            return {**at, "measured": final["measured"]}
        final.setdefault("stages", {})[stage.name] = at["measured"]
        training += stage.share * at["projection"]["training_seconds"]
        if cache is not None and at["projection"]["cache_build_seconds"] is not None:
            cache += at["projection"]["cache_build_seconds"]
        parts.append(f"{stage.name} {stage.share:.0%} of the steps "
                     f"({run_length.duration(stage.share * at['projection']['training_seconds'])})")
    parts.append(f"{options.width}x{options.height} {rest:.0%} "
                 f"({run_length.duration(rest * final['projection']['training_seconds'])})")
    total = training + (cache or 0.0)
    staged.update(training_seconds=round(training), cache_build_seconds=None if cache is None else round(cache),
                  total_seconds=round(total), total=run_length.duration(total),
                  line=f"projected run length: {run_length.duration(total)} (measured, in stages)",
                  stage_line="in stages: " + " + ".join(parts), cache_line=None)
    return {**final, "projection": staged}


def probe_units(options, media: dict) -> list[tuple[str, str, object]]:
    """What the probe measures apart, each with a run of its own: [(unit, media kind, write(rows wanted, file) ->
    distinct rows)]. Clips and images; with ``--buckets aspect`` every bucket in use (``video@1280x704``), since a
    step's time grows with its bucket's tokens."""
    if options.buckets == "aspect":
        fields, by_key = bucket_rows(options)
        return [(key, media_kind(key),
                 lambda wanted, out, rows=rows: write_rows(fields, rows, wanted, out)) for key, rows in by_key.items()]
    return [(kind, kind, lambda wanted, out, kind=kind: write_subset(options.dataset_metadata_path, kind, wanted, out))
            for kind in ("video", "image") if media.get(f"{kind}s")]


def measured_projection(ours, options, result: dict, measured: dict) -> dict | None:
    media = result.get("media")
    if not media or not measured:
        return None
    gpus = ours.gpus or (result["gpu"]["count"] if result.get("gpu") else 1)
    nodes = ours.nodes or estimates.nodes_from_environment()
    # the training's own step plan (what the launcher and the status files print), timed at the measured rates
    shape = estimates.run_shape(options, (media["videos"], media["images"]), gpus, nodes,
                                unit="GPU" if result.get("gpu") else "CPU process")
    build = estimates.cache_to_build(options, ours.cached)
    by_kind = {"video": {}, "image": {}}   # {kind: {unit: figure}}: the buckets of each kind, or the kind itself
    for unit, figure in measured.items():
        by_kind[media_kind(unit)][unit] = figure
    step, encode = {}, {}
    for kind, figures in by_kind.items():   # a kind's encoding: its buckets' mean (they are of one pixel area)
        rates = [f["encode_seconds_per_row"] for f in figures.values() if f["encode_seconds_per_row"] is not None]
        encode[kind] = sum(rates) / len(rates) if rates and build else None
        step[kind] = figures[kind]["seconds_per_step"] if kind in figures else None
    buckets = {unit: figure["seconds_per_step"] for unit, figure in measured.items() if "@" in unit}
    run = run_length.project(shape, step["video"], step["image"], encode["video"], encode["image"], kind="measured",
                             bucket_seconds=buckets or None)
    return run.as_dict()
