"""A GPU's step table from raw ``bench_cache.py --full-size`` outputs, each row beside the doctor's figures.

    python benchmarks/gpu_results.py benchmarks/results/2026-11-26-h200 --gpu H200-141GB \\
        --device "NVIDIA H200" --torch 2.11.0+cu130 --commit 8ddcbd8 --date 2026-11-26

The folder holds one JSON file per bench command (``--json``); ``RUNS`` below names the command each file came
from and the settings its rows trained with. Every row's own detail line is checked against those settings, so
a file under the wrong name fails here instead of landing in the table. Writes ``<folder>.json``
(``{"device", "torch", "commit", "date", "rows": [{"case", "s_per_step", "mfu", "peak_gib",
"doctor_s_per_step", "doctor_peak_gib", ...}]}``) and prints the Markdown table of ``results/README.md``.

The doctor's figures are what ``python -m diffsynth_mbc.doctor`` computes for the same step on the named GPU
(``training.plan.speed`` and ``training.plan.memory``): seconds per optimizer step, and
``torch.cuda.max_memory_allocated`` at the peak.

A folder of ``bench_rows.py --full-size`` outputs (``ROW_RUNS``: every bucket, image batch, stage and mode row of a
setting in one process, and the evaluation's costs) gives the same table with ``useful_mfu``, each row's warm-up
and compiled graphs, and ``extras``:

    python benchmarks/gpu_results.py benchmarks/results/2026-11-28-h100 --gpu H100-80GB \
        --device "NVIDIA H100 80GB HBM3" --torch 2.11.0+cu130 --commit ceea966 --date 2026-11-28
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from diffsynth_mbc.atomic import atomic_write_json  # noqa: E402
from diffsynth_mbc.gpu import known_gpu  # noqa: E402
from diffsynth_mbc.training.plan import memory, speed  # noqa: E402

VIDEO, IMAGE = (704, 1280, 17), (704, 1280, 1)
IMAGES_PER_FORWARD = 5
BF16 = {"precision": "bf16", "attention": "cudnn", "compiled": True, "recomputed_blocks": 30}
# file -> (the bench command's step flags beyond --full-size, the step's settings, the case name of its rows).
# The launchers' presets train with --gradient_checkpointing auto, which recomputes no block on an H100 or H200
# (36 of 127 GiB) and 10 of 30 on a V100S-32GB (28.2 of 28.8 GiB): those two runs are "default" and "v100_analog".
RUNS = {
    "recompute_none.json": ("--gradient-checkpointing none", {**BF16, "recomputed_blocks": 0}, "default"),
    "recompute_all.json": ("(bench_cache.py's own defaults: every block recomputed)", BF16, "recompute_all"),
    "no_compile.json": ("--compile off", {**BF16, "compiled": False}, "recompute_all_no_compile"),
    "v100_recompute_10.json": (
        "--mixed-precision fp16 --attention efficient --gradient-checkpointing 10 --memory-cap-gib 30",
        {**BF16, "precision": "fp16", "attention": "mem_efficient", "recomputed_blocks": 10}, "v100_analog"),
    "v100_recompute_all.json": ("--mixed-precision fp16 --attention efficient --memory-cap-gib 30",
                                {**BF16, "precision": "fp16", "attention": "mem_efficient"},
                                "v100_analog_recompute_all"),
}
# the rows of a full-size bench command (no --images): (name suffix, shape, samples per forward)
ROWS = (("", VIDEO, 1), ("_one_image", IMAGE, 1), ("_image_batch", IMAGE, IMAGES_PER_FORWARD))


# bench_rows.py files: file -> (its command's flags beyond --full-size, the step's settings, case prefix). The
# v100_analog setting of bench_rows.py at ceea966 did not restrict attention (its kernels ran cuDNN): its file is
# named for what it ran, fp16 with cuDNN attention and 10 of 30 blocks recomputed under a 30 GiB cap.
ROW_RUNS = {
    "default.json": ("--setting default --extras --runs 5 --steps 3", {**BF16, "recomputed_blocks": 0}, ""),
    "recompute_all.json": ("--setting recompute_all --runs 5 --steps 3", BF16, "recompute_all"),
    "fp16_recompute_10.json": ("--setting v100_analog --runs 5 --steps 3 (at ceea966: cuDNN attention ran)",
                               {**BF16, "precision": "fp16", "recomputed_blocks": 10}, "fp16_recompute_10"),
    "static_reference.json": ("--setting static_reference --runs 5 --steps 3", {**BF16, "recomputed_blocks": 0},
                              "static"),
    "static_one_image.json": ("--setting static_reference with its rows set to one_image --runs 5 --steps 3",
                              {**BF16, "recomputed_blocks": 0}, "static"),
}
TRAINING_ROWS = ("default", "portrait", "image_batch", "one_image", "square_images")   # a catalogue's buckets


def is_rows_folder(folder: Path) -> bool:
    return (folder / "default.json").is_file() and "setting" in json.loads((folder / "default.json").read_text())


def memory_step_modes(result: dict, row: dict) -> list[str]:
    """The modes of the samples of the one step whose memory was measured (bench_rows cycles through them)."""
    if "memory_step_modes" in row:
        return row["memory_step_modes"]
    modes = row.get("modes") or []
    if not modes:
        return []
    batches = result["warmup"] + result["runs"] * result["steps"]
    return [modes[(batches * row["samples_per_step"] + i) % len(modes)] for i in range(row["samples_per_step"])]


def row_table(folder: Path, gpu: str) -> list[dict]:
    rows = []
    for name, (flags, settings, prefix) in ROW_RUNS.items():
        if not (folder / name).is_file():
            continue
        result = json.loads((folder / name).read_text())
        info = result["info"]
        ran = {"precision": info["mixed_precision"], "compiled": info["compiled"],
               "recomputed_blocks": info["recompute_blocks"]}
        wanted = {key: settings[key] for key in ran}
        if ran != wanted:
            raise SystemExit(f"{folder / name}: ran {ran}; ROW_RUNS says {wanted}")
        for row in result["rows"]:
            kernel = {"cudnn": "cudnn", "mem_efficient": "efficient"}[settings["attention"]]
            if row["attention_kernels"] != [kernel]:
                raise SystemExit(f"{folder / name}, row {row['row']}: attention ran {row['attention_kernels']}, "
                                 f"ROW_RUNS says {kernel}")
            width, height, frames = (int(side) for side in row["shape"].split("x"))
            modes = memory_step_modes(result, row)   # a clip is conditioned (i2v) unless its memory step was t2v
            conditioned = frames > 1 and (not modes or "i2v" in modes)
            doctor_s, doctor_gib = doctor_figures(settings, (height, width, frames), row["samples_per_step"], gpu,
                                                  conditioned=conditioned)
            case = row["row"] if not prefix else f"{prefix}_{row['row']}".replace("_default", "")
            rows.append({
                "case": case, "setting": result["setting"], "bench_flags": flags, "shape": row["shape"],
                "samples_per_step": row["samples_per_step"], "tokens_per_step": row["tokens_per_step"],
                "modes": row["modes"], "memory_step_modes": modes,
                "s_per_step": round(row["s_per_step"], 4),
                "s_per_step_runs": [round(value, 4) for value in row["s_per_step_runs"]],
                "mfu": round(row["mfu"], 3), "useful_mfu": round(row["useful_mfu"], 3),
                "peak_gib": round(row["max_memory_allocated_gib"], 2),
                "reserved_gib": round(row["max_memory_reserved_gib"], 2),
                "doctor_s_per_step": round(doctor_s, 4), "doctor_peak_gib": round(doctor_gib, 2),
                "warmup_s": round(row["warmup_s"], 2), "graphs_compiled": row["graphs_compiled"],
                "attention_kernels": row["attention_kernels"], "skipped_steps": row["skipped_steps"]})
    return rows


def row_extras(folder: Path) -> dict:
    """The evaluation's costs and the compiled blocks' warm-up over the buckets, from default.json and
    dora_health.json."""
    result = json.loads((folder / "default.json").read_text())
    extras = result.get("extras", {})
    rows = {row["row"]: row for row in result["rows"]}
    warm = lambda names: sum(max(0.0, rows[n]["warmup_s"] - result["warmup"] * rows[n]["s_per_step"])  # noqa: E731
                             for n in names if n in rows)
    graphs = lambda names: sum(rows[n]["graphs_compiled"] for n in names if n in rows)  # noqa: E731
    out = {key: round(extras[key], 4) for key in ("health_record_s", "val_sample_s", "val_sample_lora_s",
                                                  "sample_clip_s", "sample_warmup_s", "val_first_s") if key in extras}
    out.update(val_quantiles=extras.get("val_quantiles"), sample_size=extras.get("sample_size"),
               sample_steps=extras.get("sample_steps"), sample_cfg=extras.get("sample_cfg"),
               compile_warmup_s=round(warm(TRAINING_ROWS), 1), recompiles=graphs(TRAINING_ROWS) - 1,
               compile_warmup_all_rows_s=round(warm(rows), 1), recompiles_all_rows=graphs(rows) - 1,
               graphs_while_timed=result["graphs_while_timed"],
               compile_warmup_evaluation_s=round(extras.get("val_first_s", 0) - extras.get("val_sample_s", 0)
                                                 + extras.get("sample_warmup_s", 0), 1),
               graphs_evaluation=extras.get("val_graphs_compiled", 0) + extras.get("sample_warmup_graphs_compiled", 0)
               + extras.get("sample_clip_graphs_compiled", 0))
    dora = folder / "dora_health.json"
    if dora.is_file():
        out["health_record_dora_s"] = round(json.loads(dora.read_text())["extras"]["health_record_dora_s"], 4)
    return out


def expected_words(settings: dict) -> list[str]:
    precision = {"bf16": "bf16 autocast", "fp16": "fp16 autocast"}[settings["precision"]]
    kernel = {"cudnn": "ran: cudnn", "mem_efficient": "ran: efficient"}[settings["attention"]]
    compiled = "; compiled;" if settings["compiled"] else "; not compiled;"
    return [precision, kernel, compiled, f"; {settings['recomputed_blocks']}/30 blocks recompute"]


def doctor_figures(settings: dict, shape: tuple[int, int, int], batch: int, gpu: str,
                   conditioned: bool | None = None) -> tuple[float, float]:
    height, width, frames = shape
    plan = memory.Plan(height=height, width=width, num_frames=frames, batch_size=batch, cached=True,
                       precision=settings["precision"], attention=settings["attention"],
                       compiled=settings["compiled"], recomputed_blocks=settings["recomputed_blocks"],
                       conditioned=frames > 1 if conditioned is None else conditioned)
    spec = known_gpu(gpu)
    step = speed.seconds_per_step(plan, spec, spec.name)
    return step.seconds, memory.peak_allocated(plan) / memory.GIB


def table_rows(folder: Path, gpu: str) -> list[dict]:
    if is_rows_folder(folder):
        return row_table(folder, gpu)
    rows = []
    for name, (flags, settings, case) in RUNS.items():
        result = json.loads((folder / name).read_text())
        if len(result["rows"]) != len(ROWS):
            raise SystemExit(f"{folder / name}: {len(result['rows'])} rows, expected {len(ROWS)} (video, "
                             f"one image per forward, {IMAGES_PER_FORWARD} images per forward)")
        for (suffix, shape, batch), row in zip(ROWS, result["rows"]):
            missing = [word for word in expected_words(settings) if word not in row["detail"]]
            if missing or row["samples_per_step"] != batch:
                raise SystemExit(f"{folder / name}, row {row['label']!r}: ran {row['detail']!r}, "
                                 f"{row['samples_per_step']} samples/step; RUNS says {missing or batch}")
            doctor_s, doctor_gib = doctor_figures(settings, shape, batch, gpu)
            rows.append({
                "case": (case + suffix).replace("default_", ""), "bench_flags": flags, "label": row["label"],
                "s_per_step": round(row["s_per_step"], 4),
                "s_per_step_runs": [round(value, 4) for value in row["s_per_step_runs"]],
                "mfu": round(row["mfu"], 3), "peak_gib": round(row["max_memory_allocated_gib"], 2),
                "reserved_gib": round(row["max_memory_reserved_gib"], 2),
                "doctor_s_per_step": round(doctor_s, 4), "doctor_peak_gib": round(doctor_gib, 2),
                "attention_kernels": row["attention_kernels"], "skipped_steps": row["skipped_steps"]})
    return rows


def markdown(rows: list[dict]) -> str:
    useful = all("useful_mfu" in row for row in rows)
    lines = ["| case | s/step | MFU |" + (" useful MFU |" if useful else "")
             + " peak GiB | doctor s/step (error) | doctor GiB (error) |",
             "|---|---:|---:|" + ("---:|" if useful else "") + "---:|---:|---:|"]
    for row in rows:
        speed_error = row["doctor_s_per_step"] / row["s_per_step"] - 1
        memory_error = row["doctor_peak_gib"] / row["peak_gib"] - 1
        lines.append(f"| `{row['case']}` | {row['s_per_step']:.3f} | {row['mfu']:.1%} | "
                     + (f"{row['useful_mfu']:.1%} | " if useful else "") + f"{row['peak_gib']:.1f} | "
                     f"{row['doctor_s_per_step']:.3f} ({speed_error:+.0%}) | "
                     f"{row['doctor_peak_gib']:.1f} ({memory_error:+.0%}) |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("folder", type=Path, help="the raw bench_cache.py --json files of one GPU")
    parser.add_argument("--gpu", required=True, help="the doctor's name for the GPU (--assume), e.g. H200-141GB")
    parser.add_argument("--device", required=True, help="torch.cuda.get_device_name() there")
    parser.add_argument("--torch", required=True, help="torch's version there")
    parser.add_argument("--commit", required=True, help="the commit the benchmark ran")
    parser.add_argument("--date", required=True)
    args = parser.parse_args(argv)
    rows = table_rows(args.folder, args.gpu)
    table = {"device": args.device, "torch": args.torch, "commit": args.commit, "date": args.date,
             "doctor_gpu": args.gpu, "rows": rows}
    if is_rows_folder(args.folder):
        table["extras"] = row_extras(args.folder)
    atomic_write_json(args.folder.with_suffix(".json"), table, indent=1)
    print(markdown(rows))
    for key, value in table.get("extras", {}).items():
        print(f"- {key}: {value}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
