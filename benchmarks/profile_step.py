"""Where one optimizer step's time goes: the host's timeline against the GPU's, per row of ``bench_rows.py``.

    python benchmarks/profile_step.py --full-size --rows one_image,default --json profile.json --traces DIR
    python benchmarks/profile_step.py                 # the tiny DiT on this machine (CPU: the host side only)

The step is ``bench_rows.py``'s (the training's Accelerator, LoRA module, AdamW and ``forward_backward``, the
presets' choices for this GPU). Per row: ``--warmup`` steps (the compiled blocks meet the shape), then ``--runs``
runs of ``--steps`` steps timed (median of the runs' mean s/step), then ``--steps`` steps under ``torch.profiler``
(host and CUDA activity), each step inside a ``record_function`` window. From the profile, per step:

- ``wall_s``: the profiled steps' mean (the profiler's own overhead included, so a little above the timed one);
- ``gpu_busy_s``: the union of the GPU's kernel, copy and fill intervals inside the step's window; ``gpu_idle``
  the rest of the window, as a fraction: how long the GPU waited on the host;
- ``host_waits_s`` and ``host_waits``: the host's calls that wait for the GPU (stream, device and event
  synchronizes; the copies to the host), their time and count: each one stops the host from running ahead;
- ``launches``: kernel launches (and graph launches) the host issued;
- ``phases_s``: host time inside the forward's compiled blocks, the backward's, the optimizer's step;
- ``top_host_ops``: the operators with the most self host time (per step), and ``top_kernels`` the GPU's.

``--traces DIR`` also writes each row's Chrome trace (gzip) for a timeline viewer.
"""

from __future__ import annotations

import argparse
import gzip
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_rows import AUTO, NO_CUDA, ROWS, row_samples, sized  # noqa: E402
from step_timing import (Setting, attention_backends, build_step_run, optimizer_step,  # noqa: E402
                         print_and_save, random_dit_pipeline, refuse_to_start)

# CUDA runtime/driver calls that block the host until the GPU has caught up (a copy to pageable host memory too).
WAITS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cuStreamSynchronize",
         "cuCtxSynchronize", "cuEventSynchronize", "cudaMemcpy")
LAUNCHES = ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx", "cudaGraphLaunch",
            "cuGraphLaunch", "cudaLaunchCooperativeKernel")
# Host phases: the events whose name starts with one of the prefixes (outermost only: nested ones are inside).
PHASES = {"forward (the module's loss)": ("module forward",),
          "backward (autograd engine)": ("autograd::engine::evaluate_function",),
          "compiled regions (forward)": ("Torch-Compiled Region",),
          "dynamo cache lookups": ("TorchDynamo Cache Lookup",),
          "optimizer step": ("Optimizer.step#",)}


def union_seconds(intervals: list[tuple[float, float]]) -> float:
    """Total length covered by ``intervals`` (start, end), overlaps counted once."""
    total, end_so_far = 0.0, float("-inf")
    for start, end in sorted(intervals):
        if end <= end_so_far:
            continue
        total += end - max(start, end_so_far)
        end_so_far = end
    return total


def step_windows(events) -> list[tuple[float, float]]:
    return sorted((e.time_range.start, e.time_range.end) for e in events if e.name.startswith("profiled step "))


def inside(event, window) -> bool:
    return window[0] <= event.time_range.start < window[1]


def summarise_profile(profiler, steps: int, trace: dict) -> dict:
    """The per-step figures of the module docstring: the host's from the profiler's events, the GPU's from its trace
    (``trace_figures``). Times in microseconds there."""
    from torch.autograd import DeviceType

    events = list(profiler.events())
    windows = step_windows(events)
    host_events = [e for e in events if e.device_type == DeviceType.CPU]
    gpu = trace_figures(trace)
    per_step = []
    for window, device in zip(windows, gpu or [None] * len(windows)):
        in_window = [e for e in host_events if inside(e, window)]
        waits = [e for e in in_window if e.name.startswith(WAITS)]
        phases = {name: sum(e.time_range.end - e.time_range.start for e in in_window if e.name.startswith(prefixes)
                            and not any(p.name.startswith(prefixes) for p in _parents(e))) / 1e6
                  for name, prefixes in PHASES.items()}
        per_step.append({"wall_s": (window[1] - window[0]) / 1e6, **(device or {}),
                         "host_waits_s": sum(e.time_range.end - e.time_range.start for e in waits) / 1e6,
                         "host_waits": len(waits), "wait_calls": sorted({e.name for e in waits}),
                         "launches": sum(1 for e in in_window if e.name.startswith(LAUNCHES)),
                         "phases_s": phases})
    averages = profiler.key_averages()
    top_host = sorted((a for a in averages if not a.key.startswith(("profiled step", "module forward"))),
                      key=lambda a: a.self_cpu_time_total, reverse=True)[:30]
    keys = ["wall_s", "host_waits_s", "host_waits", "launches"] + (["gpu_busy_s", "gpu_idle", "kernels"] if gpu else [])
    mean = {key: statistics.mean(step[key] for step in per_step) for key in keys}
    mean["phases_s"] = {name: statistics.mean(s["phases_s"][name] for s in per_step) for name in PHASES}
    mean["wait_calls"] = sorted({name for s in per_step for name in s["wait_calls"]})
    return {"per_step": per_step, "mean": mean,
            "top_host_ops": [{"name": a.key, "calls_per_step": a.count / steps,
                              "self_host_ms_per_step": a.self_cpu_time_total / 1e3 / steps} for a in top_host],
            "top_kernels": top_kernels(trace, len(windows))}


GPU_WORK = ("kernel", "gpu_memcpy", "gpu_memset")   # the trace's categories of the GPU's own work


def trace_figures(trace: dict) -> list[dict]:
    """Per profiled step of a Chrome trace (``export_chrome_trace``): the step's window on the host, the GPU's busy
    time inside it (the union of its kernels, copies and fills that start there) and how many kernels ran; empty
    without GPU work (a CPU run)."""
    events = trace.get("traceEvents", [])
    windows = sorted((e["ts"], e["ts"] + e["dur"]) for e in events
                     if e.get("cat") == "user_annotation" and e.get("name", "").startswith("profiled step "))
    work = [(e["ts"], e["ts"] + e["dur"], e.get("cat")) for e in events if e.get("cat") in GPU_WORK]
    if not work:
        return []
    figures = []
    for start, end in windows:
        inside_window = [(a, b, cat) for a, b, cat in work if start <= a < end]
        busy = union_seconds([(a, b) for a, b, _ in inside_window])
        figures.append({"gpu_busy_s": busy / 1e6, "gpu_idle": 1 - busy / (end - start),
                        "kernels": sum(1 for *_, cat in inside_window if cat == "kernel")})
    return figures


def top_kernels(trace: dict, steps: int, count: int = 15) -> list[dict]:
    """The GPU's kernels with the most time per step in a Chrome trace."""
    totals, calls = {}, {}
    for event in trace.get("traceEvents", []):
        if event.get("cat") == "kernel":
            name = event["name"][:120]
            totals[name] = totals.get(name, 0.0) + event["dur"]
            calls[name] = calls.get(name, 0) + 1
    ranked = sorted(totals, key=totals.get, reverse=True)[:count]
    return [{"name": name, "calls_per_step": calls[name] / max(steps, 1),
             "gpu_ms_per_step": totals[name] / 1e3 / max(steps, 1)} for name in ranked]


def summarise_trace(path: Path) -> str:
    """``--summarise-trace``: the GPU's figures of a saved trace (gzip or plain JSON), step by step."""
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as handle:
        trace = json.load(handle)
    figures = trace_figures(trace)
    lines = [f"{path.name}: {len(figures)} profiled steps"]
    lines += [f"  step {index}: GPU busy {step['gpu_busy_s'] * 1e3:.1f} ms (idle {step['gpu_idle']:.0%} of the step's "
              f"window), {step['kernels']} kernels" for index, step in enumerate(figures)]
    lines += [f"  {k['gpu_ms_per_step']:8.2f} ms {k['calls_per_step']:6.0f}x  {k['name'][:90]}"
              for k in top_kernels(trace, len(figures), 10)]
    return "\n".join(lines)


def _parents(event):
    parent = event.cpu_parent
    while parent is not None:
        yield parent
        parent = parent.cpu_parent


def profile_row(run, name: str, pool: list, per_forward: int, args, sync, traces: Path | None) -> dict:
    import torch
    from torch.profiler import ProfilerActivity, profile, record_function

    cursor = [0]

    def batch():
        start = cursor[0]
        cursor[0] += per_forward
        return [dict(pool[(start + i) % len(pool)]) for i in range(per_forward)]

    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    for _ in range(args.warmup):
        optimizer_step(run, batch())
    sync()
    warmup = time.perf_counter() - start
    runs = []
    for _ in range(args.runs):
        start = time.perf_counter()
        for _ in range(args.steps):
            optimizer_step(run, batch())
        sync()
        runs.append((time.perf_counter() - start) / args.steps)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=activities) as profiler:
        for index in range(args.steps):
            with record_function(f"profiled step {index}"):
                optimizer_step(run, batch(), lambda: record_function("module forward"))
                if index == args.steps - 1:
                    sync()
    peak = torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else None
    with tempfile.TemporaryDirectory() as folder:
        raw = Path(folder) / "trace.json"
        profiler.export_chrome_trace(str(raw))
        with raw.open(encoding="utf-8") as handle:
            trace = json.load(handle)
        if traces is not None:
            traces.mkdir(parents=True, exist_ok=True)
            with raw.open("rb") as source, gzip.open(traces / f"{args.label}-{name}.json.gz", "wb") as target:
                shutil.copyfileobj(source, target)
    return {"row": name, "warmup_s": warmup, "s_per_step": statistics.median(runs), "s_per_step_runs": runs,
            "max_memory_allocated_gib": peak, **summarise_profile(profiler, args.steps, trace)}


def report(result: dict) -> str:
    lines = [f"{result['label']}: {result['info']['device']}, torch {result['info']['torch']}"]
    for row in result["rows"]:
        mean = row["mean"]
        idle = "" if "gpu_busy_s" not in mean else (
            f", GPU busy {mean['gpu_busy_s']:.4f} s (idle {mean['gpu_idle']:.0%}, {mean['kernels']:.0f} kernels)")
        memory = "" if row["max_memory_allocated_gib"] is None else f"{row['max_memory_allocated_gib']:.1f} GiB, "
        lines.append(f"  {row['row']:<12} {row['s_per_step']:.4f} s/step timed ({memory}warm-up "
                     f"{row['warmup_s']:.0f} s); profiled {mean['wall_s']:.4f} s{idle}, "
                     f"{mean['host_waits']:.0f} host waits ({mean['host_waits_s'] * 1e3:.1f} ms: "
                     f"{', '.join(mean['wait_calls']) or 'none'}), {mean['launches']:.0f} launches")
        lines.append("    host phases: " + ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in mean["phases_s"].items()))
        for op in row["top_host_ops"][:12]:
            lines.append(f"    {op['self_host_ms_per_step']:8.2f} ms {op['calls_per_step']:7.1f}x  {op['name'][:90]}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--full-size", action="store_true", help="Wan2.2-TI2V-5B at full size (CUDA only)")
    parser.add_argument("--rows", default="one_image,default", help="comma-separated rows of bench_rows.py")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--steps", type=int, default=3, help="steps per timed run, and steps profiled")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--lora-rank", type=int, default=32)
    parser.add_argument("--label", default="profile", help="names this tree's result and traces")
    parser.add_argument("--cudagraphs", action="store_true",
                        help="compile the blocks with CUDA graphs (inductor's, as torch.compile's reduce-overhead)")
    parser.add_argument("--json", help="also write the result here")
    parser.add_argument("--traces", type=Path, help="write each row's Chrome trace (gzip) into this folder")
    parser.add_argument("--summarise-trace", type=Path, metavar="TRACE",
                        help="only print the GPU's figures of a trace this script wrote, and exit")
    args = parser.parse_args(argv)
    if args.summarise_trace:
        print(summarise_trace(args.summarise_trace))
        return 0
    names = args.rows.split(",")
    if not set(names) <= set(ROWS):
        parser.error(f"--rows: each of {', '.join(ROWS)}")
    refusal = refuse_to_start("profile_step.py", args.full_size, f"profile_step.py: {NO_CUDA}", None)
    if refusal:
        print(refusal, file=sys.stderr)
        return 2
    import torch

    from diffsynth_mbc.models.pipeline import TI2V_5B_DIT, TINY_DIT

    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    if args.cudagraphs:
        import torch._inductor.config

        torch._inductor.config.triton.cudagraphs = True
    setting = Setting(**AUTO)
    run, info = build_step_run(setting, random_dit_pipeline(TI2V_5B_DIT if args.full_size else TINY_DIT),
                               args.lora_rank)
    dtype = next(p for p in run.module.parameters() if not p.requires_grad).dtype
    rows = []
    with attention_backends(setting.attention):
        for seed, name in enumerate(names):
            row = sized(ROWS[name], args.full_size)
            pool = row_samples(name, row, args.full_size, dtype, seed)
            rows.append(profile_row(run, name, pool, row.per_forward, args, sync, args.traces))
            print(f"  {name}: {rows[-1]['s_per_step']:.4f} s/step", file=sys.stderr, flush=True)
    result = {"label": args.label, "cudagraphs": args.cudagraphs, "info": info, "rows": rows, "runs": args.runs,
              "steps": args.steps, "warmup": args.warmup}
    print_and_save(report(result), result, args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
