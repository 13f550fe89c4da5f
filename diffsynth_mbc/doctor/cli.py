"""``python -m diffsynth_mbc.doctor [--config PRESET] [training flags] [--assume GPU] [--json] [--quick]``.

Answers "will this run work, and how fast could it go" before a long job: GPUs and torch kernels,
precision and attention kernel, NCCL, /dev/shm, open files, disks, model files, metadata, ffmpeg,
and the memory per GPU itemised against the GPU's memory, with the cheapest change that makes it
fit. Exit codes: 0 nothing failed (warnings allowed), 1 a check failed, 2 usage.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys

from diffsynth_mbc.doctor import checks, memory
from diffsynth_mbc.doctor.checks import FAIL, GIB, Check
from diffsynth_mbc.errors import OptionsError

STATUS_STYLE = {"ok": "green", "warn": "yellow", "fail": "bold red", "skip": "dim"}


def parse(argv):
    parser = argparse.ArgumentParser(prog="python -m diffsynth_mbc.doctor", add_help=False,
                                     description=__doc__.split("\n\n")[1])
    parser.add_argument("--assume", help="plan for a GPU that is not here: " + ", ".join(checks_known_gpus()))
    parser.add_argument("--gpus", type=int, help="GPUs per node (default: those found, or 1 with --assume)")
    parser.add_argument("--deepspeed", action="store_true", help="the plan uses DeepSpeed ZeRO-2")
    parser.add_argument("--json", action="store_true", help="one JSON object instead of the table")
    parser.add_argument("--quick", action="store_true",
                        help="skip the slow checks (NCCL bandwidth, decoding rows); the launchers run this")
    parser.add_argument("--brief", action="store_true",
                        help="one summary line, plus a line for each warning or failure (the launchers use this)")
    parser.add_argument("-h", "--help", action="store_true")
    ours, training_argv = parser.parse_known_args(argv)
    if ours.help:
        parser.print_help()
        print("\nEvery other flag is a training flag (python -m diffsynth_mbc.train --help), e.g. --config.")
        raise SystemExit(0)
    from diffsynth_mbc.training.options import resolve_options

    return ours, resolve_options(training_argv)


def checks_known_gpus():
    from diffsynth_mbc.gpu import KNOWN_GPUS

    return list(KNOWN_GPUS)


def memory_report(options, target: checks.Target, precision: str, deepspeed: bool) -> tuple[Check, dict]:
    from diffsynth_mbc.gpu import attention_kernel

    if target.spec is None:
        return Check("memory", checks.SKIP, "no GPU: use --assume NAME to plan for one"), {}
    spec, capability = target.spec, target.spec.capability
    plan = memory.Plan(options.height, options.width, options.num_frames, options.batch_size, options.lora_rank,
                       tuple(options.lora_target_modules.split(",")), precision, bool(options.cache),
                       options.use_gradient_checkpointing, options.use_gradient_checkpointing_offload,
                       attention_kernel(capability, precision), target.count if deepspeed else 1)
    gpu_bytes = int(spec.memory_gib * GIB)
    items = memory.estimate(plan)
    total = memory.total(items)
    changes = memory.changes_that_fit(plan, gpu_bytes, spec.native_bf16, lambda p: attention_kernel(capability, p))
    report = {"plan": {**vars(plan), "lora_targets": list(plan.lora_targets), "tokens": memory.tokens(
                  plan.height, plan.width, plan.num_frames)},
              "items": [{"item": name, "bytes": size} for name, size in items], "total_bytes": total,
              "gpu_bytes": gpu_bytes, "limit_bytes": int(memory.FITS_BELOW * gpu_bytes),
              "fits": memory.fits(plan, gpu_bytes),
              "changes_that_fit": [{"flags": flags, "precision": p.precision, "cached": p.cached,
                                    "total_bytes": memory.total(memory.estimate(p))} for flags, p in changes]}
    detail = f"{total / GIB:.1f} GiB estimated of {spec.memory_gib:.0f} GiB on {spec.name}"
    if report["fits"]:
        return Check("memory", checks.OK, detail + " (fits)"), report
    fix = (f"{changes[0][0]} (at {changes[0][1].precision}) -> "
           f"{report['changes_that_fit'][0]['total_bytes'] / GIB:.1f} GiB") if changes else \
        "no single change or pair fits: lower --height/--width/--num_frames"
    return Check("memory", FAIL, detail + " (does not fit)", fix), report


def speed_report(options, target: checks.Target, rows: int | None) -> dict:
    """Seconds per step at an assumed MFU from the model FLOPs; the run's length where the plan is known."""
    from diffsynth_mbc.training.step_plan import StepPlan

    spec = target.spec
    if spec is None or not spec.fp16_tflops:
        return {}
    s, d, layers = memory.tokens(options.height, options.width, options.num_frames), memory.DIT["dim"], \
        memory.DIT["num_layers"]
    forward = options.batch_size * (2 * memory.dit_params() * s + layers * (4 * s * s * d + 4 * s * memory.TEXT_TOKENS * d))
    step_flops = 2 * forward * options.gradient_accumulation_steps   # forward + activation gradients (base frozen)
    tflops = spec.bf16_tflops or spec.fp16_tflops
    seconds = step_flops / (tflops * 1e12 * checks.MFU_ASSUMED)
    out = {"model_tflop_per_step": round(step_flops / 1e12, 1), "peak_tflops": tflops, "mfu_assumed": checks.MFU_ASSUMED,
           "seconds_per_step": round(seconds, 2)}
    if rows:
        plan = StepPlan(rows=rows, repeat=options.dataset_repeat, world_size=max(1, target.count),
                        batch_size=options.batch_size, gradient_accumulation=options.gradient_accumulation_steps,
                        num_epochs=options.num_epochs)
        out.update(total_steps=plan.total_steps, days=round(plan.total_steps * seconds / 86400, 1))
    return out


def run_checks(ours, options) -> dict:
    target = checks.find_target(ours.assume, ours.gpus)
    precision_check, precision = checks.precision_check(target, options.mixed_precision)
    metadata_check, rows = checks.metadata_check(options, ours.quick)
    found = [checks.gpu_check(target), checks.arch_check(target), precision_check,
             checks.nccl_check(target, ours.quick), checks.shm_check(options), checks.open_files_check(),
             *checks.disk_checks(options, rows), checks.model_check(options), metadata_check, checks.ffmpeg_check()]
    memory_check, memory_detail = memory_report(options, target, precision, ours.deepspeed)
    found.append(memory_check)
    exit_code = 1 if any(c.status == FAIL for c in found) else 0
    return {"exit_code": exit_code, "gpu": None if target.spec is None else {
                "name": target.spec.name, "capability": list(target.spec.capability), "count": target.count,
                "memory_gib": round(target.spec.memory_gib, 1), "native_bf16": target.spec.native_bf16,
                "assumed": target.assumed},
            "checks": [vars(c) for c in found], "memory": memory_detail,
            "speed": speed_report(options, target, rows)}


def print_table(result: dict) -> None:
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    console = Console(stderr=False)
    table = Table(title="diffsynth_mbc doctor", show_lines=False)
    for column in ("check", "status", "found", "fix"):
        table.add_column(column, overflow="fold")
    for c in result["checks"]:
        table.add_row(Text(c["name"]), Text(c["status"], style=STATUS_STYLE[c["status"]]), Text(c["detail"]),
                      Text(c["fix"]))
    console.print(table)
    mem = result["memory"]
    if mem:
        items = Table(title=f"memory per GPU ({mem['plan']['tokens']} tokens, {mem['plan']['precision']})")
        items.add_column("item")
        items.add_column("GiB", justify="right")
        for row in mem["items"]:
            items.add_row(Text(row["item"]), f"{row['bytes'] / GIB:.2f}")
        items.add_row(Text("total", style="bold"), Text(f"{mem['total_bytes'] / GIB:.1f}", style="bold"))
        items.add_row(Text(f"limit ({memory.FITS_BELOW:.0%} of the GPU)"), f"{mem['limit_bytes'] / GIB:.1f}")
        console.print(items)
        for change in mem["changes_that_fit"][:4]:
            console.print(Text(f"fits with {change['flags']} (at {change['precision']}): "
                               f"{change['total_bytes'] / GIB:.1f} GiB"))
    speed = result["speed"]
    if speed:
        line = (f"speed: {speed['model_tflop_per_step']} TFLOP per step; at {speed['mfu_assumed']:.0%} of "
                f"{speed['peak_tflops']} TFLOPS about {speed['seconds_per_step']} s/step")
        if "days" in speed:
            line += f", {speed['total_steps']:,} steps -> about {speed['days']} days"
        console.print(Text(line))


def print_brief(result: dict) -> None:
    counts = {}
    for c in result["checks"]:
        counts[c["status"]] = counts.get(c["status"], 0) + 1
    print("preflight: " + ", ".join(f"{n} {status}" for status, n in sorted(counts.items())), file=sys.stderr)
    for c in result["checks"]:
        if c["status"] in ("warn", "fail"):
            print(f"  {c['status']}: {c['name']}: {c['detail']}" + (f" (fix: {c['fix']})" if c["fix"] else ""),
                  file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    try:
        ours, options = parse(argv)
    except (OptionsError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    try:
        with contextlib.redirect_stdout(sys.stderr):   # libraries' notices must not end up inside --json
            result = run_checks(ours, options)
    except ValueError as exc:   # an unknown --assume name
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if ours.json:
        print(json.dumps(result, indent=2, sort_keys=True))
    elif ours.brief:
        print_brief(result)
    else:
        print_table(result)
    return result["exit_code"]
