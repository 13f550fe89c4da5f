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


def expected_words(settings: dict) -> list[str]:
    precision = {"bf16": "bf16 autocast", "fp16": "fp16 autocast"}[settings["precision"]]
    kernel = {"cudnn": "ran: cudnn", "mem_efficient": "ran: efficient"}[settings["attention"]]
    compiled = "; compiled;" if settings["compiled"] else "; not compiled;"
    return [precision, kernel, compiled, f"; {settings['recomputed_blocks']}/30 blocks recompute"]


def doctor_figures(settings: dict, shape: tuple[int, int, int], batch: int, gpu: str) -> tuple[float, float]:
    height, width, frames = shape
    plan = memory.Plan(height=height, width=width, num_frames=frames, batch_size=batch, cached=True,
                       precision=settings["precision"], attention=settings["attention"],
                       compiled=settings["compiled"], recomputed_blocks=settings["recomputed_blocks"])
    spec = known_gpu(gpu)
    step = speed.seconds_per_step(plan, spec, spec.name)
    return step.seconds, memory.peak_allocated(plan) / memory.GIB


def table_rows(folder: Path, gpu: str) -> list[dict]:
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
    lines = ["| case | s/step | MFU | peak GiB | doctor s/step (error) | doctor GiB (error) |",
             "|---|---:|---:|---:|---:|---:|"]
    for row in rows:
        speed_error = row["doctor_s_per_step"] / row["s_per_step"] - 1
        memory_error = row["doctor_peak_gib"] / row["peak_gib"] - 1
        lines.append(f"| `{row['case']}` | {row['s_per_step']:.3f} | {row['mfu']:.1%} | {row['peak_gib']:.1f} | "
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
    atomic_write_json(args.folder.with_suffix(".json"), {"device": args.device, "torch": args.torch,
                                                         "commit": args.commit, "date": args.date,
                                                         "doctor_gpu": args.gpu, "rows": rows}, indent=1)
    print(markdown(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
