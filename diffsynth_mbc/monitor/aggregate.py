"""Deriving one run from its ranks: which run a folder shows, its world size, status and aggregates.

Pure logic over the per-rank views built by ``state.MonitorState``.

Aggregates
    ``step``: the slowest rank's step; ``total_steps``: the largest; ``progress``: the slowest
    rank's; ``eta_s``: the largest among active ranks (their own ``eta_s``, else remaining
    steps x median step time); ``samples_per_s``: the sum over training ranks (when none trains any
    more, e.g. a finished run, the sum of the rates the ranks last trained at); ``loss``: the
    mean of the ranks' last losses; ``elapsed_s``: the largest of the ranks' ``elapsed_s``, an active rank's
    carried on to now from its ``updated_at`` (``elapsed_of``: a resumed run's time before its checkpoint
    counts); ``recipe``: rank 0's recipe; ``health_flags``: the newest LoRA health flags of every rank, each
    distinct one once with its ``ranks``.

The latent cache build (``python -m diffsynth_mbc.cache``) writes the same files with status ``caching``
and rows for steps: ``caching`` sums the ranks' rows done and in all, rows/s and failures, and while no
rank trains, ``step``/``total_steps``/``progress`` are those rows and ``samples_per_s`` the rows/s.
"""

from __future__ import annotations

import json
import math
from typing import Any, Iterable

from diffsynth_mbc import run_files
from diffsynth_mbc.monitor.health import run_flags
from diffsynth_mbc.monitor.status import MAX_RANKS, StatusFile

MAX_RECIPE_BYTES = 64 << 10   # a recipe larger than this (as JSON) is not the training's: not shown


def pick_run(good: dict[int, StatusFile]) -> tuple[str | None, dict[int, StatusFile], list[StatusFile]]:
    if not good:
        return None, {}, []
    groups: dict[Any, list[StatusFile]] = {}
    for sf in good.values():
        groups.setdefault(sf.data.get("run_id"), []).append(sf)

    def recency(files: list[StatusFile]) -> tuple:
        def best(key):
            values = [f.data.get(key) for f in files if f.data.get(key) is not None]
            return max(values) if values else -math.inf
        return best("started_at"), best("updated_at"), max((f.mtime or 0.0) for f in files)

    run_id = max(groups, key=lambda k: recency(groups[k]))
    chosen = {sf.rank: sf for sf in groups[run_id]}
    ignored = [sf for k, files in groups.items() if k != run_id for sf in files]
    return run_id, chosen, sorted(ignored, key=lambda s: s.rank)


def world_size_of(chosen: dict[int, StatusFile]) -> int | None:
    """The run's world size, as its ranks declare it; after a resume on fewer processes, the ranks it retired
    (status ``retired``) declare the old one and are not asked."""
    if not chosen:
        return None
    live = [sf for sf in chosen.values() if sf.data.get("status") != run_files.STATUS_RETIRED] or chosen.values()
    declared = [sf.data["world_size"] for sf in live if (sf.data.get("world_size") or 0) > 0]
    if declared:
        return max(set(declared), key=lambda v: (declared.count(v), v))
    return min(max(chosen) + 1, MAX_RANKS)


def resumed_elsewhere_note(ranks: list[dict], retired: list[int]) -> str | None:
    """``resumed on 1 GPU at step 12 (from 2); rank 1 retired there``: a run that went on on another number of
    processes, said once (its ranks' ``resumed_elsewhere``)."""
    moved = next((rank["resumed_elsewhere"] for rank in ranks if isinstance(rank.get("resumed_elsewhere"), dict)), None)
    if not moved:
        return None
    world = moved.get("world_size")
    note = (f"resumed on {world} GPU{'s' if world != 1 else ''} at step {moved.get('step')} (from "
            f"{moved.get('from_world_size')})")
    if retired:
        names = ", ".join(map(str, retired))
        note += f"; rank{'s' if len(retired) > 1 else ''} {names} retired there (records up to that step)"
    return note


def run_status(ranks: list[dict]) -> str:
    if not ranks:
        return "no_data"
    statuses = [r.get("status") for r in ranks]
    if "failed" in statuses:
        return "failed"
    if any(r["stalled"] for r in ranks):
        return "stalled"
    if all(s == "finished" for s in statuses):
        return "finished"
    active = [s for s in statuses if s in run_files.ACTIVE_STATUSES]
    if not active:   # the scheduler's end beats a stop: a rank it reached first may say stopped
        for ended in ("preempted", "stopped", "finished"):
            if ended in statuses:
                return ended
        return "starting"
    for candidate in ("training", "loading", "caching", "starting"):
        if candidate in active:
            return candidate
    return "starting"


SLOW_RANK_FACTOR = 1.25  # a rank whose typical step takes this much longer than the ranks' median is slow


def slow_ranks(ranks: list[dict], factor: float = SLOW_RANK_FACTOR) -> list[int]:
    """Ranks whose median step time exceeds ``factor`` x the median over the other ranks.

    DDP ranks wait for each other, so a persistently slower rank (a throttled GPU, a slow disk
    behind its data loader) shows as its own longer step times; with one rank nothing is slow.
    """
    medians = {r["rank"]: r["median_step_time_s"] for r in ranks
               if isinstance(r.get("median_step_time_s"), (int, float)) and r["median_step_time_s"] > 0}
    slow = []
    for rank, value in medians.items():
        others = sorted(v for r, v in medians.items() if r != rank)
        if others and value > factor * _median(others):
            slow.append(rank)
    return sorted(slow)


def _median(ordered: list[float]) -> float:
    middle = len(ordered) // 2
    return ordered[middle] if len(ordered) % 2 else (ordered[middle - 1] + ordered[middle]) / 2


def values_of(ranks: Iterable[dict], key: str) -> list[float]:
    return [r[key] for r in ranks if isinstance(r.get(key), (int, float)) and not isinstance(r.get(key), bool)]


def elapsed_of(ranks: list[dict], now: float) -> float | None:
    """The run's training time: the largest of the ranks' own ``elapsed_s`` (a resumed run's time before its
    checkpoint included), an active rank's carried on from its ``updated_at`` to ``now``; a rank whose file gives
    no ``elapsed_s``, while active: ``now`` - its ``started_at``."""
    figures = []
    for rank in ranks:
        active = rank.get("status") in run_files.ACTIVE_STATUSES
        elapsed, updated, started = (values_of([rank], key) for key in ("elapsed_s", "updated_at", "started_at"))
        if elapsed:
            figures.append(elapsed[0] + (max(0.0, now - updated[0]) if active and updated else 0.0))
        elif active and started:
            figures.append(max(0.0, now - started[0]))
    return max(figures) if figures else None


def aggregate(ranks: list[dict], status: str, now: float) -> dict:
    if not ranks:
        return {"step": None, "total_steps": None, "progress": None, "elapsed_s": None, "eta_s": None,
                "samples_per_s": None, "loss": None, "started_at": None, "updated_at": None, "overheads": None,
                "caching": None, "recipe": None, "health_flags": []}
    steps = values_of(ranks, "step")
    totals = values_of(ranks, "total_steps")
    total = max(totals) if totals else None
    progresses = []
    for r in ranks:
        p = r.get("progress")
        if p is None and r.get("step") is not None and r.get("total_steps"):
            p = 100.0 * r["step"] / r["total_steps"]
        if p is not None:
            progresses.append(min(100.0, max(0.0, p)))
    progress = 100.0 if status == "finished" else (min(progresses) if progresses else None)
    active = [r for r in ranks if r.get("status") in run_files.ACTIVE_STATUSES]
    etas = []
    for r in active:
        eta = r.get("eta_s")
        if eta is None and r.get("total_steps") is not None and r.get("step") is not None \
                and r.get("median_step_time_s"):
            eta = max(0, r["total_steps"] - r["step"]) * r["median_step_time_s"]
        if eta is not None:
            etas.append(max(0.0, eta))
    if status == "finished":
        eta_s = 0.0
    elif status in ("failed", "stopped", "preempted"):
        eta_s = None
    else:
        eta_s = max(etas) if etas else None
    started = values_of(ranks, "started_at")
    elapsed = elapsed_of(ranks, now)
    rated = [r for r in ranks if isinstance(r.get("samples_per_s"), float)]
    working = [r for r in rated if r.get("status") in ("training", "caching")]
    if working or active:   # a rank still loading or starting has no rate of its own yet: no stale one either
        rated = working
    rates = [r["samples_per_s"] for r in rated]
    losses = values_of(ranks, "loss")
    updated = values_of(ranks, "updated_at")
    cache = caching_of(ranks)
    if cache is not None and status not in ("training", "loading"):   # the cache build: rows of every rank
        steps, total = [cache["rows_done"]], cache["rows_total"]
        if status != "finished" and cache["rows_total"]:
            progress = 100.0 * cache["rows_done"] / cache["rows_total"]
    return {
        "step": int(min(steps)) if steps else None,
        "total_steps": int(total) if total is not None else None,
        "progress": None if progress is None else round(progress, 3),
        "elapsed_s": None if elapsed is None else round(elapsed, 3),
        "eta_s": None if eta_s is None else round(eta_s, 3),
        "samples_per_s": round(sum(rates), 6) if rates else None,
        "loss": sum(losses) / len(losses) if losses else None,
        "started_at": min(started) if started else None,
        "updated_at": max(updated) if updated else None,
        "overheads": overheads_of(ranks),
        "caching": cache,
        "recipe": recipe_of(ranks),
        "health_flags": run_flags(ranks),   # the newest LoRA health flags, each once with the ranks that raised it
    }


def capped_recipe(recipe):
    """A rank's ``recipe`` as its view shows it: None when it is no dict or larger than ``MAX_RECIPE_BYTES`` as
    JSON (not the training's: a 1.2 MB one passed the status API whole before)."""
    return recipe if isinstance(recipe, dict) and len(json.dumps(recipe)) <= MAX_RECIPE_BYTES else None


def recipe_of(ranks: list[dict]) -> dict | None:
    """The run's recipe (the status files' ``recipe``, written once at the start): rank 0's, else the lowest
    rank's that has one; None without one or when it is over ``MAX_RECIPE_BYTES`` of JSON."""
    for rank in sorted(ranks, key=lambda r: r["rank"]):
        recipe = rank.get("recipe")
        if isinstance(recipe, dict):
            return capped_recipe(recipe)
    return None


def caching_of(ranks: list[dict]) -> dict | None:
    """The latent cache build over the ranks whose files are a cache job's (``rows_total``): rows done and in all,
    rows/s (sum), failures (sum) and the last failure, the ETA of the slowest active rank; None without one."""
    cache = [r for r in ranks if isinstance(r.get("rows_total"), int) and not isinstance(r.get("rows_total"), bool)]
    if not cache:
        return None
    done = values_of(cache, "rows_done")
    rates = [r["rows_per_s"] for r in cache if r.get("status") == run_files.STATUS_CACHING
             and isinstance(r.get("rows_per_s"), (int, float))]
    active = [r for r in cache if r.get("status") in run_files.ACTIVE_STATUSES]
    etas = values_of(active, "eta_s")
    last = [r for r in cache if r.get("last_failure")]
    return {
        "ranks": len(cache),
        "rows_done": int(sum(done)),
        "rows_total": int(sum(r["rows_total"] for r in cache)),
        "rows_per_s": round(sum(rates), 6) if rates else None,
        "eta_s": (max(etas) if etas and len(etas) == len(active) else None) if active else 0.0,
        "failures": int(sum(values_of(cache, "failures"))),
        "last_failure": str(max(last, key=lambda r: r.get("updated_at") or 0)["last_failure"]) if last else None,
        "phase": "caching" if active else "cached",
    }


def overheads_of(ranks: list[dict]) -> dict | None:
    """The run's time between steps per kind (checkpoints, LoRA files, validation, samples): the tally of the
    rank that spent the most on it (every rank takes part in each, the slowest holds the others up)."""
    out: dict[str, dict] = {}
    for r in ranks:
        for kind, tally in (r.get("overheads") or {}).items():
            if kind not in out or (tally.get("total_s") or 0.0) > (out[kind].get("total_s") or 0.0):
                out[kind] = tally
    return out or None


def waiting_notes(ranks: list[dict]) -> list[str]:
    """'rank 1 is silent (stalled) while rank 0 waits for ranks in ...': the hung rank is the one named."""
    stalled = [r["rank"] for r in ranks if r["stalled"]]
    waiting = [r for r in ranks if r.get("waiting_text")]
    if not stalled or not waiting:
        return []
    names = ", ".join(str(rank) for rank in stalled)
    return [f"rank{'s' if len(stalled) > 1 else ''} {names} silent (stalled) while rank {r['rank']} is "
            f"{r['waiting_text']}" for r in waiting]
