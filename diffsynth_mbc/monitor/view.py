"""Rich rendering of the monitor's aggregate (the dict built by monitor.state.MonitorState).

The view is fed a snapshot and never reads files itself; styles live in one Theme.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from rich import box
from rich.console import Group, RenderableType
from rich.markup import escape
from rich.panel import Panel
from rich.progress_bar import ProgressBar
from rich.table import Table
from rich.text import Text

from diffsynth_mbc.monitor.formats import (fmt_clock, fmt_duration, fmt_loss, fmt_lr, fmt_num, fmt_rate,
                                           fmt_seconds)
from diffsynth_mbc.monitor.modes import RECENT_STEPS, ordered
from diffsynth_mbc.values import printable
from diffsynth_mbc.run_files import overheads_text
from diffsynth_mbc.run_layout import STATUS_FILE_GLOB

SPARK_CHARS = "▁▂▃▄▅▆▇█"


@dataclass(frozen=True)
class Theme:
    status: dict = field(default_factory=lambda: {
        "starting": "cyan", "caching": "bold cyan", "loading": "cyan", "training": "bold green", "finished": "bold blue",
        "failed": "bold white on red", "stopped": "yellow", "preempted": "bold yellow",
        "stalled": "bold black on yellow",
        "no_data": "dim", "missing": "bold magenta", "unknown": "magenta",
    })
    label: str = "dim"
    value: str = "bold"
    spark: str = "green"
    error: str = "red"
    note: str = "yellow"
    header_border: str = "blue"


THEME = Theme()


def sparkline(values, width: int = 24) -> str:
    """Unicode block sparkline of the last ``width`` values (scaled between their min and max)."""
    values = [v for v in values if v is not None][-width:]
    if not values:
        return ""
    lo, hi = min(values), max(values)
    if hi - lo <= 1e-12 * max(1.0, abs(hi)):
        return SPARK_CHARS[3] * len(values)
    top = len(SPARK_CHARS) - 1
    return "".join(SPARK_CHARS[min(top, int((v - lo) / (hi - lo) * top + 0.5))] for v in values)


def _gpu_cells(gpu) -> tuple[str, str]:
    if not gpu:
        return "cpu", "-"
    util = gpu.get("util_pct")
    used, total = gpu.get("mem_used_mb"), gpu.get("mem_total_mb")
    util_text = "-" if util is None else f"{util:.0f}%"
    if used is None:
        mem_text = "-"
    elif total:
        mem_text = f"{used / 1024:.1f}/{total / 1024:.0f} GB"
    else:
        mem_text = f"{used / 1024:.1f} GB"
    peak = gpu.get("peak_allocated_mb")
    if peak is not None and used is not None:   # the allocator's peak since the rank's previous write
        mem_text += f" (peak {peak / 1024:.1f})"
    return util_text, mem_text


def _status_text(rank: dict, theme: Theme) -> Text:
    status = rank.get("status") or "unknown"
    if rank.get("stalled"):
        text = Text("STALLED", style=theme.status["stalled"])
        text.append(f" {fmt_duration(rank.get('age_s'))} (since {fmt_clock(rank.get('stalled_since'))},"
                    f" was {status})", style=theme.status["stalled"])
        return text
    return Text(status, style=theme.status.get(status, ""))


def render_header(snap: dict, log_dir: str | None, theme: Theme) -> RenderableType:
    status = snap.get("status", "no_data")
    grid = Table.grid(padding=(0, 2))
    grid.add_column(justify="right", style=theme.label)
    grid.add_column()
    grid.add_column(justify="right", style=theme.label)
    grid.add_column()
    status_text = Text(status.upper(), style=theme.status.get(status, ""))
    if snap.get("stalled_ranks"):
        status_text.append(f"  rank(s) {', '.join(map(str, snap['stalled_ranks']))} stalled",
                           style=theme.status["stalled"])
    grid.add_row("status", status_text, "run", Text(str(snap.get("run_id") or "-"), style=theme.value))
    step, total = snap.get("step"), snap.get("total_steps")
    progress = snap.get("progress")
    step_text = Text(f"{fmt_num(step, 'd') if isinstance(step, int) else '-'} / "
                     f"{fmt_num(total, 'd') if isinstance(total, int) else '-'}", style=theme.value)
    if progress is not None:
        step_text.append(f"  {progress:.1f}%")
    world = snap.get("world_size")
    missing = snap.get("missing_ranks") or []
    world_text = Text(str(world if world is not None else "-"), style=theme.value)
    if missing:
        world_text.append(f"  missing: {', '.join(map(str, missing))}", style=theme.status["missing"])
    cache = cache_of(snap)
    grid.add_row("cache rows" if cache else "step", step_text, "ranks", world_text)
    bar = ProgressBar(total=100.0, completed=progress or 0.0, width=40)
    rate = snap.get("samples_per_s")
    grid.add_row("progress", bar, "rows/s" if cache else "samples/s", Text(fmt_rate(rate), style=theme.value))
    grid.add_row("elapsed", Text(fmt_duration(snap.get("elapsed_s")), style=theme.value),
                 "ETA (slowest)", Text(fmt_duration(snap.get("eta_s")), style=theme.value))
    if cache:
        grid.add_row("failed rows", Text(printable(failures_text(cache)), style=theme.value), "", "")
    else:
        grid.add_row("loss (mean)", Text(fmt_loss(snap.get("loss")), style=theme.value),
                     "between steps", Text(printable(overheads_text(snap.get("overheads")) or "-"), style=theme.value))
    title = escape(printable("diffsynth-mbc monitor" + (f" — {log_dir}" if log_dir else "")))
    return Panel(grid, title=title, title_align="left", border_style=theme.header_border, box=box.ROUNDED)


def render_ranks(snap: dict, theme: Theme) -> RenderableType:
    table = Table(box=box.SIMPLE_HEAD, expand=False, pad_edge=False)
    for name, justify in (("rank", "right"), ("host", "left"), ("status", "left"), ("phase", "left"),
                          ("step", "right"), ("loss", "right"), ("trend", "left"), ("lr", "right"),
                          ("step time", "right"), ("GPU", "right"), ("GPU mem", "right"), ("updated", "right")):
        table.add_column(name, justify=justify, no_wrap=name in ("trend", "status", "updated"))
    rows = {r["rank"]: r for r in snap.get("ranks", [])}
    for rank in sorted(set(rows) | set(snap.get("missing_ranks") or [])):
        r = rows.get(rank)
        if r is None:
            table.add_row(str(rank), "-", Text("missing", style=theme.status["missing"]), "no status file", *["-"] * 8)
            continue
        util, mem = _gpu_cells(r.get("gpu"))
        step, total = r.get("step"), r.get("total_steps")
        step_text = f"{step if step is not None else '-'}/{total if total is not None else '-'}"
        table.add_row(
            str(rank),
            Text(printable(str(r.get("hostname") or "-"))),   # Text: what a file says is never markup
            _status_text(r, theme),
            Text(phase_text(r)),
            step_text,
            fmt_loss(r.get("loss")),
            Text(sparkline(r.get("loss_trend") or []), style=theme.spark),
            fmt_lr(r.get("lr")),
            "-" if r.get("step_time_s") is None else f"{fmt_seconds(r['step_time_s'])}s",
            util,
            mem,
            "-" if r.get("age_s") is None else f"{fmt_duration(r['age_s'])} ago",
        )
    return table


def render_mode_losses(snap: dict, theme: Theme) -> RenderableType | None:
    """Each rank's recent training loss per mode, one short line per rank (``rank 0  t2i 0.4123  i2v 0.5331``), a
    column per mode; None for a run whose history has no modes."""
    rows = sorted(((r["rank"], r["loss_by_mode"]) for r in snap.get("ranks", []) if r.get("loss_by_mode")),
                  key=lambda row: row[0])
    if not rows:
        return None
    modes = ordered({mode for _, losses in rows for mode in losses})
    grid = Table.grid(padding=(0, 2))
    for _ in range(2 + len(modes)):
        grid.add_column(style=theme.label, no_wrap=True)
    for i, (rank, losses) in enumerate(rows):
        cells = [Text.assemble((f"{printable(str(mode))} ", theme.label), (fmt_loss(losses[mode]), theme.value))
                 if mode in losses else "" for mode in modes]   # as the loss beside it
        grid.add_row(f"loss by mode (last {RECENT_STEPS} steps)" if i == 0 else "", f"rank {rank}", *cells)
    return grid


def error_groups(errors: list[dict]) -> list[tuple[dict, list[int], list[str]]]:
    """The same error on several ranks (the usual way a DDP run fails) once: (error, its ranks, their hosts)."""
    groups: dict[tuple, tuple[dict, list, list]] = {}
    for err in errors:
        key = (err.get("type"), err.get("message"), err.get("traceback_tail"))
        first, ranks, hosts = groups.setdefault(key, (err, [], []))
        ranks.append(err.get("rank"))
        if err.get("hostname") and err["hostname"] not in hosts:
            hosts.append(err["hostname"])
    return list(groups.values())


def rank_list(ranks: list) -> str:
    """[0, 1, 2, 5] -> "ranks 0-2, 5"; [3] -> "rank 3" (as the dashboard says it)."""
    numbers = sorted(r for r in ranks if isinstance(r, int))
    parts, i = [], 0
    while i < len(numbers):
        j = i
        while j + 1 < len(numbers) and numbers[j + 1] == numbers[j] + 1:
            j += 1
        parts.append(f"{numbers[i]}-{numbers[j]}" if j > i else str(numbers[i]))
        i = j + 1
    parts += [str(r) for r in ranks if not isinstance(r, int)]
    return ("ranks " if len(ranks) > 1 else "rank ") + ", ".join(parts)


def render_errors(snap: dict, theme: Theme, tail_lines: int = 10) -> list[RenderableType]:
    out = []
    for err, ranks, hosts in error_groups(snap.get("errors") or []):
        body = Text()
        body.append(f"{err.get('type') or 'Error'}: {err.get('message') or ''}\n", style="bold")
        tail = (err.get("traceback_tail") or "").rstrip("\n").splitlines()[-tail_lines:]
        if tail:
            body.append("\n".join(tail), style=theme.error)
        host = f" on {', '.join(hosts)}" if hosts else ""
        out.append(Panel(body, title=escape(printable(f"{rank_list(ranks)} failed{host}")), title_align="left",
                         border_style=theme.error))
    return out


def render_notes(snap: dict, theme: Theme, limit: int = 12) -> RenderableType | None:
    notes = snap.get("notes") or []
    events = snap.get("events") or []
    if not notes and not events:
        return None
    text = Text()
    for event in events[-3:]:
        text.append(f"· {printable(str(event))}\n", style=theme.label)
    for note in notes[:limit]:
        text.append(f"• {printable(str(note))}\n", style=theme.note)
    if len(notes) > limit:
        text.append(f"… and {len(notes) - limit} more (see --json)\n", style=theme.note)
    return text


COMPACT_BELOW = 110   # columns: below this, one short line per rank and a two-column header


def run_record(snap: dict, key: str):
    """What the lowest rank that has it says of ``key`` (the validation, the best LoRA, the stage and the early stop
    are the same on every rank)."""
    for rank in sorted(snap.get("ranks") or [], key=lambda r: r["rank"]):
        if rank.get(key) is not None:
            return rank[key]
    return None


def _whole(value) -> str:
    return "-" if value is None else str(value)


def render_evaluation(snap: dict, theme: Theme) -> RenderableType | None:
    """The last validation loss, the stage, the best LoRA and the early stop (where its count stands, or that it
    ended the run), a short line each, numbers first and whole (a long file name is cut at its end); None when the
    run has none of them."""
    first = Text(style=theme.label, no_wrap=True, overflow="ellipsis")
    val_loss, val_step = run_record(snap, "val_loss"), run_record(snap, "val_step")
    if val_loss is not None:
        first.append_text(Text.assemble("validation ", (fmt_loss(val_loss), theme.value),
                                        f" at step {_whole(val_step)}"))
    stage = run_record(snap, "stage")
    if stage is not None:
        first.append("  " if first else "")
        first.append_text(Text.assemble("stage ", (f"{_whole(stage['stage'])}/{_whole(stage['of'])}: {stage['size']}", theme.value),
                                        " (the final size)" if stage["final"] else ""))
    lines = [first] if first else []
    best = run_record(snap, "best")
    if best is not None:
        gain = best.get("gain")
        line = Text.assemble("best LoRA ", (fmt_loss(best["val_loss"]), theme.value), f" at step {best['step']}",
                             f" ({100 * gain:.2f}% below the base)" if gain is not None else "", style=theme.label)
        if best.get("file"):
            line.append(f": {best['file']}")
        line.no_wrap, line.overflow = True, "ellipsis"
        lines.append(line)
    stop, count = run_record(snap, "early_stop"), run_record(snap, "early_stop_count")
    if stop is None and isinstance(count, dict):   # --early_stop: where its count stands after the last validation
        why = count.get("not_counted")
        lines.append(Text(f"early stop: {_whole(count.get('count'))} of {_whole(count.get('patience'))} "
                          + (f"(step {_whole(count.get('step'))}: {why}, not counted)" if why else
                             f"validations without improvement since step {_whole(count.get('since_step'))}"),
                          style=theme.label, no_wrap=True, overflow="ellipsis"))
    if stop is not None:
        lines.append(Text(f"stopped early at step {stop['step']}: no better validation in "
                          f"{_whole(stop['validations_without_improvement'])} evaluations since step "
                          f"{_whole(stop['since_step'])}",
                          style=theme.note, no_wrap=True, overflow="ellipsis"))
    return Group(*lines) if lines else None


def cache_of(snap: dict) -> dict | None:
    """The latent cache build's figures while it is what the run does (no rank loading or training yet)."""
    return snap.get("caching") if snap.get("status") not in ("training", "loading") else None


def failures_text(cache: dict) -> str:
    failures = cache.get("failures") or 0
    last = cache.get("last_failure")
    return f"{failures}" + (f" (last: {' '.join(str(last).split())[:160]})" if failures and last else "")


def render_compact_header(snap: dict, theme: Theme) -> RenderableType:
    status = snap.get("status", "no_data")
    step, total, progress = snap.get("step"), snap.get("total_steps"), snap.get("progress")
    cache = cache_of(snap)
    line = Text()
    line.append(status.upper(), style=theme.status.get(status, ""))
    line.append(f"  {'cache rows' if cache else 'step'} {step if step is not None else '-'}/"
                f"{total if total is not None else '-'}", style=theme.value)
    if progress is not None:
        line.append(f" ({progress:.1f}%)", style=theme.value)
    line.append(f"  ETA {fmt_duration(snap.get('eta_s'))}", style=theme.value)
    line.append(f"  failed {failures_text(cache)}" if cache else f"  loss {fmt_loss(snap.get('loss'))}",
                style=theme.value)
    second = Text(f"elapsed {fmt_duration(snap.get('elapsed_s'))}  ranks {snap.get('world_size') or '-'}"
                  f"  {'rows/s' if cache else 'samples/s'} {fmt_rate(snap.get('samples_per_s'))}",
                  style=theme.label)
    if snap.get("missing_ranks"):
        second.append(f"  missing: {', '.join(map(str, snap['missing_ranks']))}", style=theme.status["missing"])
    second.append(Text(f"  run {printable(str(snap.get('run_id') or '-'))}", style=theme.label))
    between = overheads_text(snap.get("overheads"))
    if not between:
        return Group(line, second)
    return Group(line, second, Text(printable(f"between steps: {between}"), style=theme.label, no_wrap=True,
                                    overflow="ellipsis"))


def render_compact_ranks(snap: dict, theme: Theme) -> RenderableType:
    """One line per rank, the numbers first and whole; the phase last, cut with an ellipsis."""
    table = Table(box=box.SIMPLE_HEAD, expand=True, pad_edge=False, padding=(0, 1))
    for name in ("rank", "status", "step", "loss", "s/step", "updated"):
        table.add_column(name, justify="left" if name == "status" else "right", no_wrap=True)
    table.add_column("phase", ratio=1, no_wrap=True, overflow="ellipsis", min_width=6)
    rows = {r["rank"]: r for r in snap.get("ranks", [])}
    for rank in sorted(set(rows) | set(snap.get("missing_ranks") or [])):
        r = rows.get(rank)
        if r is None:
            table.add_row(str(rank), Text("missing", style=theme.status["missing"]), "-", "-", "-", "-",
                          "no status file")
            continue
        status = "STALLED" if r.get("stalled") else (r.get("status") or "unknown")
        table.add_row(str(rank), Text(status, style=theme.status.get(status.lower(), "")),
                      f"{r.get('step') if r.get('step') is not None else '-'}/{r.get('total_steps') or '-'}",
                      fmt_loss(r.get("loss")),
                      fmt_seconds(r.get("step_time_s")),
                      "-" if r.get("age_s") is None else fmt_duration(r["age_s"]),
                      Text(phase_text(r)))
    return table


def phase_text(r: dict) -> str:
    """The rank's phase, and what it waits for while blocked in a collective."""
    phase = printable(str(r.get("phase") or "-"))
    return f"{phase}: {r['waiting_text']}" if r.get("waiting_text") else phase


def render(snap: dict, *, log_dir: str | None = None, theme: Theme = THEME, footer: str | None = None,
           width: int | None = None) -> RenderableType:
    compact = width is not None and width < COMPACT_BELOW
    parts: list[RenderableType] = [render_compact_header(snap, theme) if compact
                                   else render_header(snap, log_dir, theme)]
    evaluation = render_evaluation(snap, theme)
    if evaluation is not None:
        parts.append(evaluation)
    if snap.get("ranks") or snap.get("missing_ranks"):
        parts.append(render_compact_ranks(snap, theme) if compact else render_ranks(snap, theme))
        by_mode = render_mode_losses(snap, theme)
        if by_mode is not None:
            parts.append(by_mode)
    else:
        parts.append(Text(f"No training files yet: waiting for {STATUS_FILE_GLOB}.", style=theme.label))
    parts.extend(render_errors(snap, theme))
    notes = render_notes(snap, theme)
    if notes is not None:
        parts.append(notes)
    if footer:
        parts.append(Text(footer, style=theme.label))
    return Group(*parts)
