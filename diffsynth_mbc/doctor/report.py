"""How the doctor's result is shown: the table of checks, the memory items, the speed with where each figure
comes from, the projected run length, the probe's measurements and the assumptions; or one brief line."""

from __future__ import annotations

import sys

from diffsynth_mbc.training.plan import memory

GIB = 1024 ** 3
STATUS_STYLE = {"ok": "green", "warn": "yellow", "fail": "bold red", "skip": "dim"}


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
        plan = mem["plan"]
        sized = f"{mem['bucket_note']}, " if mem.get("bucket_note") else ""
        items = Table(title=f"memory per GPU, {mem['batch']} batch ({sized}{plan['tokens']} tokens x "
                            f"{plan['batch_size']}, {plan['precision']}, {plan['recomputed_blocks']} of 30 blocks "
                            "recomputed)")
        items.add_column("item")
        items.add_column("GiB", justify="right")
        for row in mem["items"]:
            items.add_row(Text(row["item"]), f"{row['bytes'] / GIB:.2f}")
        items.add_row(Text("total", style="bold"), Text(f"{mem['total_bytes'] / GIB:.1f}", style="bold"))
        items.add_row(Text(f"limit ({memory.FITS_BELOW:.0%} of the GPU)"), f"{mem['limit_bytes'] / GIB:.1f}")
        console.print(items)
        for change in ([] if mem["fits"] else mem["changes_that_fit"][:4]):   # fits: nothing to change for memory
            console.print(Text(f"fits with {change['flags']} (at {change['precision']}): "
                               f"{change['total_bytes'] / GIB:.1f} GiB"))
    for line in speed_lines(result["speed"]) + probe_lines(result.get("probe")):
        console.print(Text(line))
    if result.get("assumptions"):
        console.print(Text("assumed: " + "; ".join(result["assumptions"]), style="dim"))


def speed_lines(speed: dict) -> list[str]:
    if not speed:
        return []
    if "unknown" in speed:
        return [f"speed: unknown: {speed['unknown']}"]
    lines = []
    for kind in ("video", "image"):
        if kind in speed:
            figure = speed[kind]
            mfu = ""
            if figure["mfu"] is not None:   # worked out from the seconds: no more a fact than they are
                held = "" if figure["kind"] == "measured" else " if the estimated speed holds"
                mfu = f", MFU {figure['mfu']:.0%}{held}"
            lines.append(f"speed, {kind} batch: {figure['seconds_per_step']:.2f} s/step ({figure['kind']}; "
                         f"{figure['model_tflop_per_step']} TFLOP/step{mfu})")
            lines += [f"    {source}" for source in figure["sources"]]
    return lines + projection_lines(speed.get("projection"))


def projection_lines(projection: dict | None) -> list[str]:
    """The projected run length, what its buckets add up to (--buckets aspect) and the cache build."""
    if not projection:
        return []
    return [line for line in (projection["line"], projection.get("bucket_line"), projection.get("cache_line"),
                              projection.get("evaluation_line"), projection.get("best_line"),
                              projection.get("stage_line")) if line]


def probe_lines(probe: dict | None) -> list[str]:
    if not probe:
        return []
    if probe.get("error"):
        return [f"probe: failed: {probe['error']}"]
    lines = []
    for kind, figure in probe.get("measured", {}).items():
        if figure.get("max_allocated_mb") is not None:
            memory_text = f", GPU peak {figure['max_allocated_mb'] / 1024:.1f} GiB allocated"
        elif figure.get("peak_rss_mb") is not None:
            memory_text = f", process peak {figure['peak_rss_mb'] / 1024:.1f} GiB resident"
        else:
            memory_text = ""
        encode = (f", encoding {figure['encode_seconds_per_row']:.3f} s/row"
                  if figure.get("encode_seconds_per_row") is not None else "")
        what = f"bucket {kind.partition('@')[2]} ({kind.partition('@')[0]}s)" if "@" in kind else f"{kind} batch"
        lines.append(f"probe, {what}: {figure['seconds_per_step']:.3f} s/step measured on this machine over "
                     f"{figure['steps_timed']} steps of {figure['samples_per_step']:g} samples (after "
                     f"{figure['warmup_steps']} warm-up: {', '.join(f'{s:.2f}' for s in figure['first_steps_s'])} s)"
                     f"{memory_text}{encode}")
        residual = residual_line(figure)
        if residual:
            lines.append(f"    {residual}")
    return lines + projection_lines(probe.get("projection"))


def residual_line(figure: dict) -> str | None:
    """The largest residual magnitude the probe's steps wrote, against fp16's 65,504."""
    largest, headroom = figure.get("largest_residual"), figure.get("fp16_headroom")
    if largest is None:
        return None
    stream = "fp32" if figure.get("fp32_residual") else "the model's dtype"
    if headroom is None:
        return (f"largest residual magnitude: {largest} (the residual stream, in {stream}, overflowed): "
                "--fp32_residual on keeps it in fp32")
    where = (f"{headroom:.1f}x headroom below fp16's 65,504" if headroom >= 1
             else f"{1 / headroom:.2f}x past fp16's 65,504" + (", held by the fp32 residual stream"
                                                               if figure.get("fp32_residual") else
                                                               ": fp16 overflows here without --fp32_residual on"))
    return f"largest residual magnitude: {largest:,.0f} ({where}; the stream in {stream})"


def check_line(c: dict) -> str:
    return f"  {c['status']}: {c['name']}: {c['detail']}" + (f" (fix: {c['fix']})" if c["fix"] else "")


def print_brief(result: dict, detail_file: str | None = None) -> None:
    """One summary line (counts, and which checks warned or failed), then a line for each warning or failure.
    With ``detail_file`` (the launchers pass the run's log) every check's line goes there instead, and only the
    failures stay on the terminal: the summary then fits in 80 columns."""
    counts, names = {}, {}
    for c in result["checks"]:
        counts[c["status"]] = counts.get(c["status"], 0) + 1
        names.setdefault(c["status"], []).append(c["name"])
    summary = "preflight: " + ", ".join(f"{n} {status}" + (f" ({', '.join(names[status])})" if status in ("warn", "fail")
                                                           else "") for status, n in sorted(counts.items()))
    shown = ("warn", "fail")
    if detail_file:
        with open(detail_file, "a", encoding="utf-8") as handle:
            handle.write("\n".join([summary] + [check_line(c) for c in result["checks"]]) + "\n")
        shown = ("fail",)
        summary += "; detail in the log" if len(summary) <= 60 else ""
    print(summary, file=sys.stderr)
    for c in result["checks"]:
        if c["status"] in shown:
            print(check_line(c), file=sys.stderr)
