"""The processes of a run on this host: who holds a folder's lock, stopping a run, marking dead ranks.

The launcher takes an flock on ``FOLDER/.train[.nodeR].lock`` in the output, log and checkpoint
folders and every process of the run (launcher, tee, accelerate, ranks, data-loader workers) inherits
that descriptor. So the processes holding the lock file open *are* the run on this host, whatever
their parents, sessions or process groups are; a dead launcher's pid never stands in for them.

    python -m diffsynth_mbc.stop OUTPUT_PATH [--grace S]     (launchers/stop.sh)

Stopping sends SIGTERM to each rank, which is the same as Ctrl-C: every rank checkpoints, writes
``stopped`` and exits 0. Whatever still holds the lock after ``--grace`` seconds gets SIGKILL.
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
from pathlib import Path

from diffsynth_mbc import run_files
from diffsynth_mbc.atomic import write_json_even_when_full

LOCK_PREFIX = ".train"
TRAINER_MODULES = ("diffsynth_mbc.train", "diffsynth_mbc.cache")


def lock_name(machine_rank: int = 0) -> str:
    """One lock per node of a run: node 0 keeps the historical name."""
    return f"{LOCK_PREFIX}.lock" if machine_rank == 0 else f"{LOCK_PREFIX}.node{machine_rank}.lock"


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


def command_line(pid: int) -> list[str]:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")[:-1]
    except OSError:
        return []


def is_trainer(pid: int) -> bool:
    """A rank process: `python -u -m diffsynth_mbc.train ...` (or the cache job) as accelerate starts it."""
    argv = command_line(pid)
    return any(argv[i] == "-m" and argv[i + 1] in TRAINER_MODULES for i in range(1, min(len(argv) - 1, 4)))


def run_locks(folder: str | os.PathLike) -> list[Path]:
    return sorted(Path(folder).glob(f"{LOCK_PREFIX}*.lock"))


def describe_holders(folder: str | os.PathLike) -> str:
    """'launcher 123, ranks 130 131' for the message that refuses a second run on a folder."""
    pids = sorted({pid for lock in run_locks(folder) for pid in lock_holders(lock)})
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


def stop_run(folder: str | os.PathLike, grace_s: float = 120.0, poll_s: float = 0.2, out=sys.stderr) -> int:
    """Stop the run holding ``folder``'s locks: SIGTERM its ranks, SIGKILL what is left after the grace.

    Returns 0 when it stopped within the grace, 1 when it had to be killed, 3 when nothing ran there.
    """
    locks = run_locks(folder)
    pids = sorted({pid for lock in locks for pid in lock_holders(lock)})
    if not pids:
        print(f"no training is running on {folder} (no process holds its lock)", file=out)
        return 3
    ranks = [pid for pid in pids if is_trainer(pid)] or pids
    print(f"stopping the run on {folder}: SIGTERM to {' '.join(map(str, ranks))} "
          f"(checkpoint, then exit; SIGKILL after {grace_s:g} s)", file=out)
    _signal_all(ranks, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline:
        if not any(lock_holders(lock) for lock in locks):
            print("stopped", file=out)
            return 0
        time.sleep(poll_s)
    left = sorted({pid for lock in locks for pid in lock_holders(lock)})
    print(f"still running after {grace_s:g} s: SIGKILL to {' '.join(map(str, left))}", file=out)
    _signal_all(left, signal.SIGKILL)
    return 1


def _signal_all(pids: list[int], sig: int) -> None:
    for pid in pids:
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


def mark_dead_ranks(log_dir: str | os.PathLike, launch_exit_code: int, host: str | None = None) -> list[int]:
    """Status files of this host still saying starting/loading/training whose process is gone: failed.

    Called by the launcher once the launch has returned, so a rank killed with SIGKILL (which
    writes nothing) is reported as failed at once instead of being called stalled minutes later.
    """
    host = host or socket.gethostname()
    marked = []
    for path in sorted(Path(log_dir).glob("training_gpu*.json")):
        rank = run_files.rank_of_status_file(path.name)
        try:
            state = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue
        if rank is None or not isinstance(state, dict) or state.get("hostname") != host:
            continue
        pid = state.get("pid")
        if state.get("status") not in run_files.ACTIVE_STATUSES or not isinstance(pid, int) or pid_alive(pid):
            continue
        state.update(status=run_files.STATUS_FAILED, phase="process ended without a final status",
                     updated_at=time.time(),
                     error={"type": "RankDied", "traceback_tail": "",
                            "message": f"rank {rank} (pid {pid}) ended without writing a final status "
                                       f"(killed?); the launch exited with code {launch_exit_code}"})
        try:
            write_json_even_when_full(path, state)
        except OSError as exc:   # a full or vanished log folder: say so, the launcher still ends cleanly
            print(f"warning: cannot mark rank {rank} failed in {path}: {exc}", file=sys.stderr)
            continue
        marked.append(rank)
    return marked


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m diffsynth_mbc.stop", allow_abbrev=False,
                                     description="Stop the training running on OUTPUT_PATH gracefully (as Ctrl-C: "
                                                 "checkpoint, status 'stopped'), then forcibly after --grace seconds.")
    parser.add_argument("output_path", help="the run's output folder (or its log or checkpoint folder)")
    parser.add_argument("--grace", type=float, default=120.0, help="seconds to wait before SIGKILL (default 120)")
    parser.add_argument("--mark-dead-ranks", metavar="EXIT_CODE", type=int, default=None,
                        help=argparse.SUPPRESS)   # used by the launchers on the log folder after a launch ends
    options = parser.parse_args(argv)
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
