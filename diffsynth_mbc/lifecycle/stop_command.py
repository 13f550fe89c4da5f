"""The processes of a run on this host: who holds a folder's lock, stopping a run, marking dead ranks.

Each of the output, log and checkpoint folders has a lock, ``FOLDER/.train[.nodeR].lock``, held by the
launcher and by every rank of the run (``diffsynth_mbc.lifecycle.run_lock``), and a record beside it
naming the run id, the launcher, the supervisor and accelerate. So the ranks are found through the lock
even when their launcher is dead; and a process is signalled only when it is this run's launcher,
accelerate or rank by its recorded pid (or its lock and run id) *and* its command line, never because it
happens to hold a file of that name open: a lock that is a symbolic link or not a regular file is refused.

    python -m diffsynth_mbc.stop OUTPUT_PATH [--grace S]     (launchers/stop.sh)

Stopping sends SIGTERM to each rank, which is the same as Ctrl-C: every rank checkpoints, writes
``stopped`` and exits 0. What of the run is still alive after ``--grace`` seconds gets SIGKILL.
Linux only (reads /proc). No torch.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from diffsynth_mbc import environment, run_files, run_layout
from diffsynth_mbc.atomic import write_json_even_when_full
from diffsynth_mbc.flags import FlagParser
from diffsynth_mbc.lifecycle.processes import (alive, environment_value, is_accelerate, is_launcher, is_trainer,
                                               parent, start_time)
from diffsynth_mbc.lifecycle.run_lock import read_record, regular_lock_problem


def lock_holders(lock_file: str | os.PathLike) -> list[int]:
    """Pids of the processes on this host that have ``lock_file`` open."""
    try:
        target = os.stat(lock_file)
    except OSError:
        return []
    holders = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            for fd in os.scandir(f"/proc/{entry.name}/fd"):
                try:
                    info = os.stat(fd.path)
                except OSError:
                    continue
                if (info.st_dev, info.st_ino) == (target.st_dev, target.st_ino):
                    holders.append(int(entry.name))
                    break
        except OSError:   # gone meanwhile, or not ours to read
            continue
    return sorted(holders)


def run_locks(folder: str | os.PathLike) -> list[Path]:
    return sorted(Path(folder).glob(f"{run_layout.LOCK_PREFIX}*{run_layout.LOCK_SUFFIX}"))


def describe_holders(folder: str | os.PathLike) -> str:
    """'launcher 123, ranks 130 131' for the message that refuses a second run on a folder: the holders other than
    the process asking and the processes that started it (a refused launcher holds the lock file open itself)."""
    asking = ancestors(os.getpid())
    pids = sorted({pid for lock in run_locks(folder) for pid in lock_holders(lock)} - asking)
    if not pids:
        return "no process of it is visible on this host"
    ranks = [pid for pid in pids if is_trainer(pid)]
    others = [pid for pid in pids if pid not in ranks]
    parts = []
    if others:
        parts.append("processes " + " ".join(map(str, others)))
    if ranks:
        parts.append("ranks " + " ".join(map(str, ranks)))
    return ", ".join(parts)


def ancestors(pid: int) -> set[int]:
    """``pid`` and every process above it."""
    found = set()
    while pid and pid not in found:
        found.add(pid)
        pid = parent(pid) or 0
    return found


@dataclass
class RunProcesses:
    """The processes of the run recorded beside a folder's locks, each checked by pid *and* command line."""
    run_id: str | None = None
    log_dir: str | None = None
    launchers: set = field(default_factory=set)     # the launcher (bash, then the supervisor it became)
    accelerate: set = field(default_factory=set)
    ranks: set = field(default_factory=set)
    strangers: list = field(default_factory=list)   # lock holders that are none of these: never signalled

    def members(self) -> list[int]:
        return sorted(self.launchers | self.accelerate | self.ranks)

    def describe(self) -> str:
        parts = [f"{what} {' '.join(map(str, sorted(pids)))}" for what, pids in
                 (("launcher", self.launchers), ("accelerate", self.accelerate), ("ranks", self.ranks)) if pids]
        return ", ".join(parts)


def _number(value) -> int | None:
    return int(value) if isinstance(value, str) and value.isdigit() else None


def find_run(locks: list[Path]) -> RunProcesses:
    """The launcher, accelerate and ranks of the run that the records beside ``locks`` name.

    A launcher is the recorded pid holding the lock with a launcher's command line (or the recorded supervisor,
    by pid and start time); accelerate the recorded pid, a child of that supervisor, running accelerate; a rank
    a lock holder running the training with the record's run id in its environment whose parent is not
    itself a rank (a data-loader worker is left to its rank)."""
    holders = sorted({pid for lock in locks for pid in lock_holders(lock)})
    run = RunProcesses()
    for lock in locks:
        record = read_record(lock)
        run.run_id, run.log_dir = run.run_id or record["run_id"], run.log_dir or record.get("log_dir")
        launcher = record["launcher"]
        if launcher in holders and is_launcher(launcher):
            run.launchers.add(launcher)
        supervisor = _number(record.get("supervisor"))
        # Only a supervisor holding this very lock: a copy of the folder carries the record but not the lock.
        if supervisor in holders and alive(supervisor, _number(record.get("supervisor_start"))) \
                and is_launcher(supervisor):
            run.launchers.add(supervisor)
            accelerate = _number(record.get("accelerate"))
            if accelerate and parent(accelerate) == supervisor and is_accelerate(accelerate):
                run.accelerate.add(accelerate)
        if record["run_id"]:
            run.ranks |= {pid for pid in holders if is_trainer(pid) and not is_trainer(parent(pid) or 0)
                          and environment_value(pid, environment.RUN_ID) == record["run_id"]}
        if record.get("started_without_launcher") and launcher:   # the ranks it started hold the lock themselves
            run.ranks |= {pid for pid in holders if is_trainer(pid) and parent(pid) == launcher}
    members = set(run.members())
    run.strangers = [pid for pid in holders if pid not in members and parent(pid) not in members]
    return run


def _alive_of(starts: dict) -> list[int]:
    return sorted(pid for pid, started in starts.items() if alive(pid, started))


def _wait_gone(starts: dict, timeout_s: float, poll_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while _alive_of(starts):
        if time.monotonic() >= deadline:
            return False
        time.sleep(poll_s)
    return True


def stop_run(folder: str | os.PathLike, grace_s: float = 120.0, poll_s: float = 0.2, out=sys.stderr) -> int:
    """Stop the run recorded on ``folder``: SIGTERM its ranks, SIGKILL what of the run is left after the grace.

    Only this run's launcher, accelerate and ranks are ever signalled. Returns 0 when it stopped within the
    grace, 1 when it had to be killed, 2 when a lock is not a regular file, 3 when nothing of a run ran there.
    """
    locks = run_locks(folder)
    for lock in locks:
        problem = regular_lock_problem(lock)
        if problem:
            print(f"error: refusing the lock {lock}: {problem}. A run's lock is a regular file the launcher "
                  f"creates; nothing was signalled", file=out)
            return 2
    run = find_run(locks)
    if run.strangers:
        print(f"note: {' '.join(map(str, run.strangers))} hold(s) the lock but are not this run's launcher, "
              f"accelerate or ranks: left alone", file=out)
    if not run.members():
        print(f"no training is running on {folder} (no process of a run holds its lock)", file=out)
        return 3
    starts = {pid: start_time(pid) for pid in run.members()}
    targets = sorted(run.ranks or run.launchers)
    print(f"stopping run {run.run_id} on {folder} ({run.describe()}): SIGTERM to {' '.join(map(str, targets))} "
          f"(checkpoint, then exit; SIGKILL after {grace_s:g} s)", file=out)
    _signal_all(targets, signal.SIGTERM, starts)
    if _wait_gone(starts, grace_s, poll_s):
        report_ranks(run, out)
        return report_outcome(run, out)
    kill_after_grace(run, starts, grace_s, poll_s, out)
    marked = mark_dead_ranks(run.log_dir, 137, reason=f"killed by stop.sh after its grace of {grace_s:g} s",
                             run_id=run.run_id) if run.log_dir else []
    report_ranks(run, out)
    if marked:
        print(f"marked rank(s) {' '.join(map(str, marked))} failed: killed without a final status", file=out)
    print("had to kill the run: exit 1", file=out)
    return 1


def kill_after_grace(run: RunProcesses, starts: dict, grace_s: float, poll_s: float, out) -> None:
    """SIGKILL the ranks still alive; the supervisor then ends the launch itself, or is killed too."""
    ranks = [pid for pid in sorted(run.ranks) if alive(pid, starts[pid])]
    if ranks:
        print(f"still running after {grace_s:g} s: SIGKILL to ranks {' '.join(map(str, ranks))}", file=out)
        _signal_all(ranks, signal.SIGKILL, starts)
    if _wait_gone(starts, 20.0, poll_s):
        return
    left = _alive_of(starts)
    print(f"{'still' if ranks else f'still running after {grace_s:g} s:'} SIGKILL to "
          f"{' '.join(map(str, left))} (launcher, accelerate)", file=out)
    _signal_all(left, signal.SIGKILL, starts)
    _wait_gone(starts, 10.0, poll_s)


def report_outcome(run: RunProcesses, out) -> int:
    """The run's last word as its ranks wrote it (not what was asked): 0 when every rank stopped or finished."""
    states = rank_states(run.log_dir, run.run_id) if run.log_dir else {}
    lines = closing_lines(states, None, None)
    for line in lines or ["stopped"]:
        print(line, file=out)
    ended = {state.get("status") for state in states.values()}
    return 0 if ended <= {*run_files.STOPPED_STATUSES, run_files.STATUS_FINISHED} else 1


def closing_lines(states: dict, resume_command: str | None, log_file: str | None) -> list[str]:
    """The run's last word, after everything torch and accelerate printed: why it failed, or how to resume."""
    failed = {rank: state for rank, state in states.items() if state.get("status") == run_files.STATUS_FAILED}
    if failed:
        lines = []
        for rank, state in sorted(failed.items()):
            error = state.get("error") or {}
            message = " ".join(str(error.get("message") or state.get("phase") or "").split())
            lines.append(f"failed: rank {rank} at step {state.get('step')}: {error.get('type', 'error')}: "
                         f"{message[:600]}")
        return lines + ([f"  log: {log_file}"] if log_file else [])
    if states and all(state.get("status") in run_files.STOPPED_STATUSES for state in states.values()):
        state = states[min(states)]
        checkpoint = state.get("last_checkpoint")
        preempted = any(state.get("status") == run_files.STATUS_PREEMPTED for state in states.values())
        lines = [f"{'preempted' if preempted else 'stopped'} at step {state.get('step')}/{state.get('total_steps')}"
                 + (f"; resume from {checkpoint}" if checkpoint else "; no checkpoint was written")]
        if resume_command and checkpoint:
            lines.append(f"  resume: {resume_command}")
        return lines
    return []


def report_ranks(run: RunProcesses, out) -> None:
    """What each rank of this host wrote last, so the user reads what happened, not what was asked."""
    if not run.log_dir:
        return
    for rank, state in sorted(rank_states(run.log_dir, run.run_id).items()):
        print(f"  rank {rank}: {state.get('status')} at step {state.get('step')} ({state.get('phase')})", file=out)


def rank_states(log_dir: str | os.PathLike, run_id: str | None = None, host: str | None = None) -> dict:
    """{rank: status} of this host's ranks (of ``run_id`` when given) in ``log_dir``."""
    host = host or socket.gethostname()
    states = {}
    for path in sorted(Path(log_dir).glob(run_layout.STATUS_FILE_GLOB)):
        rank = run_layout.rank_of_status_file(path.name)
        try:
            state = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue
        if rank is None or not isinstance(state, dict) or state.get("hostname") != host:
            continue
        # A resumed run goes on under its checkpoint's run id; its launch is named by launch_id.
        if run_id is None or run_id in (state.get("run_id"), state.get("launch_id")):
            states[rank] = state
    return states


def _signal_all(pids: list[int], sig: int, starts: dict | None = None) -> None:
    for pid in pids:
        if starts is not None and not alive(pid, starts.get(pid)):
            continue   # gone, or its pid reused since: never signal a stranger
        try:
            os.kill(pid, sig)
        except (ProcessLookupError, PermissionError):
            continue


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def mark_dead_ranks(log_dir: str | os.PathLike, launch_exit_code: int, host: str | None = None,
                    reason: str | None = None, run_id: str | None = None) -> list[int]:
    """Status files of this host still saying starting/loading/training whose process is gone: failed.

    Called by the supervisor once the launch has returned, and by ``stop_run`` after it had to kill, so a
    rank killed with SIGKILL (which writes nothing) is reported as failed at once instead of being called
    stalled minutes later, or left `training` forever.
    """
    marked = []
    for rank, state in rank_states(log_dir, run_id, host).items():
        pid = state.get("pid")
        if state.get("status") not in run_files.ACTIVE_STATUSES or not isinstance(pid, int) or pid_alive(pid):
            continue
        why = reason or f"killed?); the launch exited with code {launch_exit_code}"
        state.update(status=run_files.STATUS_FAILED, phase="process ended without a final status",
                     updated_at=time.time(),
                     error={"type": "RankDied", "traceback_tail": "",
                            "message": f"rank {rank} (pid {pid}) ended without writing a final status ({why}"
                                       + (")" if reason else "")})
        path = run_layout.status_path(log_dir, rank)
        try:
            write_json_even_when_full(path, state)
        except OSError as exc:   # a full or vanished log folder: say so, the launcher still ends cleanly
            print(f"warning: cannot mark rank {rank} failed in {path}: {exc}", file=sys.stderr)
            continue
        marked.append(rank)
    return marked


def build_parser(prog: str = "python -m diffsynth_mbc.stop") -> argparse.ArgumentParser:
    parser = FlagParser(prog=prog, allow_abbrev=False,
                        description="Stop the training running on OUTPUT_PATH gracefully (as Ctrl-C: "
                                    "checkpoint, status 'stopped'), then forcibly after --grace seconds.")
    parser.add_argument("output_path", help="the run's output folder (or its log or checkpoint folder)")
    parser.add_argument("--grace", type=float, default=120.0, help="seconds to wait before SIGKILL (default 120)")
    parser.add_argument("--mark-dead-ranks", metavar="EXIT_CODE", type=int, default=None,
                        help=argparse.SUPPRESS)   # used by the launchers on the log folder after a launch ends
    return parser


def main(argv: list[str] | None = None, prog: str = "python -m diffsynth_mbc.stop") -> int:
    options = build_parser(prog).parse_args(argv)
    if options.mark_dead_ranks is not None:
        marked = mark_dead_ranks(options.output_path, options.mark_dead_ranks)
        if marked:
            print(f"marked rank(s) {' '.join(map(str, marked))} failed: their process ended without a final status",
                  file=sys.stderr)
        return 0
    if not Path(options.output_path).is_dir():
        print(f"error: {options.output_path} is not a folder", file=sys.stderr)
        return 2
    return stop_run(options.output_path, options.grace)
