"""What the monitor knows about a run, built from the per-rank files in a log directory.

Pure logic, no rendering and no HTTP: parsing the status files, reading the JSONL history
incrementally, down-sampling it for drawing, stall detection, the ETA pick and the derivation
of one run status from the rank statuses. Imports neither rich, torch nor diffsynth.

The rules (also in ``python -m diffsynth_mbc.monitor --help``):

Which run is shown
    Status files are grouped by ``run_id``; the group with the newest ``started_at`` (then
    newest ``updated_at``, then newest file) is the run. Files of other runs are left out and
    listed in ``ignored_runs`` and the notes. Ranks at or above the run's ``world_size`` are
    left out with a note.

Stalled rank
    A rank whose status is ``starting``, ``loading`` or ``training`` and whose ``updated_at``
    is older than the stall threshold. The threshold is ``--stall_after`` when given, else the
    larger of 120 s and 10x the rank's median step time (last 101 steps of its history, else
    its ``step_time_s``). ``stalled_since`` is its last ``updated_at``. A rank blocked in a
    collective keeps its file fresh with ``waiting`` (what for, since when; ``waiting_text``), so
    when one rank hangs, only that one is stalled and a note names it.

Missing rank
    A rank below ``world_size`` with no readable status file. It is listed in
    ``missing_ranks`` but does not change the run status. With log folders that are not
    shared between nodes, give every node's folder (or its monitor's URL) as a source.

Run status, first rule that matches
    ``no_data`` (no status file of any run) > ``failed`` (any rank failed) > ``stalled`` (any
    rank stalled) > ``finished`` (every present rank finished) > ``preempted`` (no rank active
    and at least one preempted: the scheduler ended the job) > ``stopped`` (no rank active
    and at least one stopped) > ``training`` / ``loading`` / ``starting`` (the most advanced
    status among the active ranks).

Exit codes of ``--once``
    0 starting, loading, training, finished, stopped (a stop is asked for by someone, it is
    not an error) and preempted (a requeued job goes on); 1 failed; 3 stalled; 4 no data.

Long histories
    A history over 8 MiB is read tail first: the status (median step time, a loss trend from lines
    sampled across the file) is answered at once, and the whole file is read in the background
    (``backfill``); the down-sampled series wait for it. ``history_complete`` says which a rank has.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from typing import Any, Callable

from diffsynth_mbc import run_files
from diffsynth_mbc.monitor.aggregate import (
    aggregate,
    capped_recipe,
    pick_run,
    resumed_elsewhere_note,
    run_status,
    slow_ranks,
    waiting_notes,
    world_size_of,
)
from diffsynth_mbc.monitor.backfill import Backfill
from diffsynth_mbc.monitor.history import INDEX_EVERY, TAIL_FIRST_ABOVE, HistoryFile, read_history_window
from diffsynth_mbc.monitor.series import MAX_POINTS, TREND_POINTS
from diffsynth_mbc.monitor.status import (
    STALL_MIN_S,
    MAX_RANKS,
    STALL_STEP_FACTOR,
    StatusFile,
    normalize_status,
    read_status_file,
    waiting_text,
)


MISSING_NOTES_SHOWN = 16
EVENTS_SHOWN = 8
WHOLE_HISTORY_WAIT_S = 600.0   # longest a request for the down-sampled series waits for a whole read


class MonitorState:
    """Reads a log directory on every ``refresh`` and builds the aggregate (a JSON-safe dict).

    ``clock`` gives the wall time in unix seconds (compared with ``updated_at``); inject a fake
    one in tests. Thread-safe: ``refresh``/``snapshot``/``metrics`` may be called from the
    live view and from HTTP handler threads.
    """

    def __init__(self, log_dir: str | Path | list, *, stall_after: float | None = None,
                 clock: Callable[[], float] = time.time, max_points: int = MAX_POINTS,
                 index_every: int = INDEX_EVERY, remotes: list | None = None,
                 tail_first_above: int | None = TAIL_FIRST_ABOVE, backfill: bool = True):
        self.log_dirs = [Path(d) for d in log_dir] if isinstance(log_dir, (list, tuple)) else [Path(log_dir)]
        self.log_dir = self.log_dirs[0] if self.log_dirs else None
        self.remotes = list(remotes or [])
        self.stall_after = stall_after
        self.clock = clock
        self.max_points = max_points
        self.index_every = index_every
        self.tail_first_above = tail_first_above
        self.backfill = backfill   # read long histories whole in the background as soon as they are seen
        self._backfill = Backfill(self._adopt)
        self._lock = threading.RLock()
        self._status: dict[int, StatusFile] = {}
        self._history: dict[int, HistoryFile] = {}
        self._warned: dict[str, None] = {}  # warn-once notes, in order
        self._runs_seen: dict[int, str | None] = {}   # rank -> the run id its files last belonged to
        self._folders_seen: set[Path] = set()   # folders listed once: gone later means deleted, not "not yet"
        self._events: dict[str, None] = {}   # normal events worth a line, in order (a new run, ...)
        self._snapshot: dict | None = None
        self._refreshed_mono: float | None = None
        self.last_refresh_s: float | None = None

    # -- reading -------------------------------------------------------------------------------

    def _scan(self) -> str | None:
        """Re-read the status files that changed (every source); returns the problems with sources, if any."""
        seen: dict[int, StatusFile] = {}
        problems = [problem for folder in self.log_dirs if (problem := self._scan_folder(folder, seen))]
        for remote in self.remotes:
            try:
                views = remote.fetch_ranks()
            except OSError as exc:
                problems.append(str(exc))
                continue
            for view in views:
                rank = view["rank"]
                if 0 <= rank <= MAX_RANKS and rank not in seen:
                    sf = StatusFile(rank, Path(f"{remote}#rank{rank}"))
                    sf.data, sf.notes = normalize_status(view, rank)
                    sf.remote = True
                    seen[rank] = sf
        self._status = seen
        return "; ".join(problems) or None

    def _scan_folder(self, folder: Path, seen: dict[int, StatusFile]) -> str | None:
        try:
            entries = list(os.scandir(folder))
        except FileNotFoundError:
            if folder in self._folders_seen:
                return (f"log directory {folder} vanished (deleted or unmounted?): nothing of it is shown until a "
                        "run writes there again")
            return f"log directory {folder} does not exist (yet)"
        except NotADirectoryError:
            return f"{folder} is not a directory"
        except OSError as exc:
            return f"cannot list {folder}: {exc}"
        self._folders_seen.add(folder)
        for entry in entries:
            rank = run_files.rank_of_status_file(entry.name)
            if rank is None or rank in seen:
                continue
            if rank > MAX_RANKS:
                self._warn(f"{entry.name}: rank {rank} is outside 0..{MAX_RANKS}; ignored")
                continue
            try:
                if not entry.is_file():   # a FIFO, device or folder named like a status file
                    self._warn(f"{entry.name} is not a regular file; ignored")
                    continue
            except OSError:
                continue
            sf = self._status.get(rank)
            if sf is None or sf.path != Path(entry.path):
                sf = StatusFile(rank, Path(entry.path))
            read_status_file(sf, self._warn)
            seen[rank] = sf
        return None

    def _warn(self, message: str) -> None:
        self._warned.setdefault(message, None)

    def _note_new_run(self, rank: int, run_id: str | None, hf: HistoryFile) -> None:
        """A new run replacing the previous one's history is normal: an event, not a warning about the file."""
        previous = self._runs_seen.get(rank)
        if previous is not None and run_id != previous:
            hf.rereads = 0
            self._events.setdefault(f"new run {run_id} replaced {previous}", None)
        self._runs_seen[rank] = run_id

    def _history_path(self, rank: int) -> Path:
        """The history beside the rank's status file; a remote rank's history is not read here."""
        sf = self._status.get(rank)
        if sf is not None and sf.remote:
            return sf.path / "no-local-history"   # never exists
        folder = sf.path.parent if sf is not None else self.log_dir
        return run_files.history_path(folder, rank)

    def _history_for(self, rank: int) -> HistoryFile:
        path = self._history_path(rank)
        hf = self._history.get(rank)
        if hf is None or hf.path != path:
            hf = self._history[rank] = HistoryFile(path, max_points=self.max_points, index_every=self.index_every,
                                                   tail_first_above=self.tail_first_above)
        return hf

    def _adopt(self, rank: int, whole: HistoryFile) -> None:
        """Put a history read whole in the place of the one read tail first (unless the files changed)."""
        with self._lock:
            current = self._history.get(rank)
            if current is None or current.path != whole.path or current.complete:
                return
            whole.poll()
            whole.rereads += current.rereads
            self._history[rank] = whole

    def _wait_for_whole_histories(self, rank: int | None) -> None:
        with self._lock:
            snap = self.snapshot(max_age_s=0.5)
            events = []
            for r in sorted(r["rank"] for r in snap["ranks"]) if rank is None else [rank]:
                hf = self._history_for(r)
                hf.poll()
                if not hf.complete:
                    events.append(self._backfill.request(r, hf))
        for event in events:
            event.wait(WHOLE_HISTORY_WAIT_S)

    # -- public --------------------------------------------------------------------------------

    def refresh(self) -> dict:
        """Read what changed and rebuild the aggregate; returns it."""
        with self._lock:
            t0 = time.perf_counter()
            dir_problem = self._scan()
            snapshot = self._build(dir_problem)
            self.last_refresh_s = time.perf_counter() - t0
            snapshot["refresh_ms"] = round(self.last_refresh_s * 1000, 2)
            self._snapshot = snapshot
            self._refreshed_mono = time.monotonic()
            return snapshot

    def snapshot(self, max_age_s: float = 0.0) -> dict:
        """The aggregate, refreshed first unless the last refresh is younger than ``max_age_s``."""
        with self._lock:
            if self._snapshot is None or self._refreshed_mono is None \
                    or time.monotonic() - self._refreshed_mono >= max_age_s:
                return self.refresh()
            return self._snapshot

    def run_ranks(self) -> list[int]:
        with self._lock:
            snap = self._snapshot if self._snapshot is not None else self.refresh()
            present = [r["rank"] for r in snap["ranks"]]
            return sorted(set(present) | set(snap["missing_ranks"]))

    def metrics(self, rank: int | None = None, since: float | None = None, limit: int = 1000,
                points: int | None = None) -> dict:
        """Per-step history of one rank or of every rank of the run with a status file, keyed by rank.

        Raw JSONL records with step > since (at most ``limit`` per rank; ``truncated`` says
        more exist and ``next_since`` is where to continue), or with ``points`` the bounded
        down-sampled series (loss, lr, grad_norm, step_time_s, samples_per_s, val_loss, its gain over the base
        model, loss per mode: bucket mean, min, max) with at most that many points per series, where each epoch
        began, the LoRA health records, the training loss by timestep bin, all samples' and per mode (an EMA per
        bin over the run, whatever ``since``), and the samples and mean loss per shape bucket (over the run).
        """
        if points is not None:
            self._wait_for_whole_histories(rank)
        with self._lock:
            snap = self.snapshot(max_age_s=0.5)
            ranks = sorted(r["rank"] for r in snap["ranks"]) if rank is None else [rank]
            plan = {}
            for r in ranks:
                hf = self._history_for(r)
                hf.poll()
                if points is not None:
                    plan[r] = {
                        "downsampled": True,
                        "bucket": hf.loss.bucket,
                        "lines": hf.lines,
                        **{name: series.points(since, points) for name, series in hf.series.items()},
                        "val_loss": hf.val_loss.points(since, points),
                        "val_loss_ema": hf.val_loss_ema.points(since, points),
                        **hf.validation.payload(since, points),   # val_loss_by_quantile, val_gain(_by_quantile)
                        "lora_health": hf.health.as_list(since),   # the LoRA health records (heat map)
                        "loss_by_timestep": hf.by_timestep.as_dict(),
                        **hf.modes.payload(since, points),   # loss_by_mode, loss_by_timestep_by_mode, ...
                        "loss_by_bucket": hf.buckets.as_dict(),   # {bucket: {samples, loss}} over the run
                        "epochs": [{"step": step, "epoch": epoch} for step, epoch in hf.epoch_marks
                                   if since is None or step > since],
                        "last_step": hf.last_step,
                    }
                else:
                    plan[r] = hf.seek_point(since)
        out: dict[str, Any] = {"run_id": snap.get("run_id"), "since": since, "limit": limit,
                               "points": points, "ranks": {}}
        for r in ranks:
            if points is not None:
                out["ranks"][str(r)] = plan[r]
                continue
            ident, start, _ = plan[r]
            records, truncated = read_history_window(self._history_path(r), ident, start, since, limit)
            last = records[-1].get("step") if records else since
            out["ranks"][str(r)] = {"records": records, "truncated": truncated, "next_since": last}
        return out

    # -- aggregation ---------------------------------------------------------------------------

    def _build(self, dir_problem: str | None) -> dict:
        now = self.clock()
        notes: list[str] = []
        if dir_problem:
            notes.append(dir_problem)
        good = {r: sf for r, sf in self._status.items() if sf.data is not None}
        for sf in sorted(self._status.values(), key=lambda s: s.rank):
            if sf.error:
                notes.append(sf.error)

        run_id, chosen, ignored = pick_run(good)
        world_size = world_size_of(chosen)
        ranks_out, retired = [], []
        for rank in sorted(chosen):
            sf = chosen[rank]
            if world_size is not None and rank >= world_size:
                if sf.data.get("status") == run_files.STATUS_RETIRED:   # a rank a resume on fewer GPUs closed
                    retired.append(rank)
                else:
                    notes.append(f"{sf.path.name}: rank {rank} is outside world_size {world_size}; left out")
                continue
            notes.extend(sf.notes)
            hf = self._history_for(rank)
            hf.poll()
            if self.backfill and not hf.complete:
                self._backfill.request(rank, hf)
            self._note_new_run(rank, sf.data.get("run_id"), hf)
            notes.extend(hf.notes(sf.data.get("resumed_from")))
            ranks_out.append(self._rank_view(sf, hf, now))
        present = {r["rank"] for r in ranks_out}
        missing = sorted(set(range(world_size or 0)) - present)
        for rank in missing[:MISSING_NOTES_SHOWN]:
            sf = self._status.get(rank)
            why = "its status file is unreadable" if sf is not None and sf.data is None else "no status file yet"
            notes.append(f"rank {rank} missing: {why}")
        if len(missing) > MISSING_NOTES_SHOWN:
            notes.append(f"... and {len(missing) - MISSING_NOTES_SHOWN} more ranks missing")
        ignored_runs: dict[str, list[int]] = {}
        for sf in ignored:
            key = str(sf.data.get("run_id"))
            ignored_runs.setdefault(key, []).append(sf.rank)
        for key, ranks in sorted(ignored_runs.items()):
            notes.append(f"ignored files of run {key} (ranks {', '.join(map(str, sorted(ranks)))}): "
                         f"older than run {run_id}")
        notes.extend(self._warned)
        if self._backfill.failure:
            notes.append(self._backfill.failure)

        notes.extend(waiting_notes(ranks_out))
        moved = resumed_elsewhere_note(ranks_out, retired)
        if moved:
            notes.append(moved)
        status = run_status(ranks_out)
        agg = aggregate(ranks_out, status, now)
        errors = []
        for r in ranks_out:
            if r.get("status") == "failed":
                error = r.get("error") or {"type": None, "message": "failed without an error record",
                                           "traceback_tail": None}
                errors.append({"rank": r["rank"], "hostname": r.get("hostname"), **error})
        return {
            "status": status,
            "run_id": run_id,
            "world_size": world_size,
            **agg,
            "ranks": ranks_out,
            "stalled_ranks": [r["rank"] for r in ranks_out if r["stalled"]],
            "slow_ranks": slow_ranks(ranks_out),
            "missing_ranks": missing,
            "errors": errors,
            "ignored_runs": [{"run_id": k, "ranks": sorted(v)} for k, v in sorted(ignored_runs.items())],
            "notes": list(dict.fromkeys(notes)),
            "events": list(self._events)[-EVENTS_SHOWN:],
            "now": now,
            "schema_version": run_files.SCHEMA_VERSION,
        }

    def _rank_view(self, sf: StatusFile, hf: HistoryFile, now: float) -> dict:
        data = dict(sf.data)
        updated = data.get("updated_at")
        if updated is None:
            updated = sf.mtime
        age = None if updated is None else max(0.0, now - updated)
        median = hf.median_step_time()
        if median is None:
            median = data.get("step_time_s")
        if self.stall_after is not None:
            threshold = float(self.stall_after)
        else:
            threshold = max(STALL_MIN_S, STALL_STEP_FACTOR * median) if median else STALL_MIN_S
        stalled = bool(data.get("status") in run_files.ACTIVE_STATUSES and age is not None and age > threshold)
        data.update({
            "stalled": stalled,
            "age_s": None if age is None else round(age, 3),
            "stall_after_s": threshold,
            "stalled_since": updated if stalled else None,
            "median_step_time_s": median, "recipe": capped_recipe(data.get("recipe")),
            "loss_trend": hf.loss.trend(TREND_POINTS) if hf.complete else hf.sampled_trend,
            "loss_by_mode": hf.modes.recent_losses(),   # {mode: mean of its last steps}; {} without modes
            "history_lines": hf.records if hf.complete else None,   # None: read from its tail so far
            "history_complete": hf.complete,
            # what an active, fresh rank waits for (a stalled rank's last word on it is not news)
            "waiting_text": waiting_text(data.get("waiting"), now)
            if data.get("status") in run_files.ACTIVE_STATUSES and not stalled else None,
        })
        return data


