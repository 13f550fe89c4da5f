"""Processes of this host as a run sees them: command lines, start times, children, environment (Linux /proc).

A pid alone names a process only until it is reused, so a process is identified by its pid *and* its
start time (``start_time``, clock ticks since boot), and a role (launcher, accelerate, rank) by its
command line. No torch.
"""

from __future__ import annotations

import os
from pathlib import Path

TRAINER_MODULES = ("diffsynth_mbc.train", "diffsynth_mbc.cache")
SUPERVISOR_MODULE = "diffsynth_mbc.supervise"
ACCELERATE_MODULES = ("accelerate.commands.launch", "torch.distributed.run")


def command_line(pid: int) -> list[str]:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")[:-1]
    except OSError:
        return []


def start_time(pid: int) -> int | None:
    """The process's start time in clock ticks since boot, or None when there is no such process (or a zombie)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2:].split()
    if fields[0] == "Z":
        return None
    return int(fields[19])


def alive(pid: int, started: int | None = None) -> bool:
    """``pid`` runs (not a zombie) and, when ``started`` is given, is the very process that started then."""
    now = start_time(pid)
    return now is not None and (started is None or now == started)


def parent(pid: int) -> int | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat[stat.rindex(")") + 2:].split()[1])


def children(pid: int) -> list[int]:
    """Direct children of ``pid`` (their parent pid is ``pid``)."""
    found = []
    for entry in os.scandir("/proc"):
        if entry.name.isdigit() and parent(int(entry.name)) == pid:
            found.append(int(entry.name))
    return sorted(found)


def environment_value(pid: int, name: str) -> str | None:
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return None
    prefix = name.encode() + b"="
    for entry in raw.split(b"\0"):
        if entry.startswith(prefix):
            return entry[len(prefix):].decode(errors="replace")
    return None


def _runs_module(pid: int, modules) -> bool:
    argv = command_line(pid)
    return any(argv[i] == "-m" and argv[i + 1] in modules for i in range(1, min(len(argv) - 1, 4)))


def is_trainer(pid: int) -> bool:
    """A rank process: `python -u -m diffsynth_mbc.train ...` (or the cache job) as accelerate starts it."""
    return _runs_module(pid, TRAINER_MODULES)


def is_accelerate(pid: int) -> bool:
    argv = command_line(pid)
    return _runs_module(pid, ACCELERATE_MODULES) or any(Path(arg).name in ("accelerate", "torchrun")
                                                        for arg in argv[:2])


def is_launcher(pid: int) -> bool:
    """A launcher: `bash launchers/<preset>.sh ...` while it prepares, `python -m diffsynth_mbc.supervise` after."""
    argv = command_line(pid)
    if _runs_module(pid, (SUPERVISOR_MODULE,)):
        return True
    return bool(argv) and Path(argv[0]).name == "bash" and any(
        arg.endswith(".sh") and Path(arg).parent.name == "launchers" for arg in argv[1:3])


def end_with_parent(parent: int) -> None:
    """In a worker: be killed when the process that started it dies, however it dies (``kill -9`` of the converter
    left its workers blocked forever, their parent pid 1; so did a rank killed while its data-loader workers outlived
    the scheduler's SIGTERM). Linux's PR_SET_PDEATHSIG; elsewhere nothing is set."""
    import ctypes
    import signal

    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)   # PR_SET_PDEATHSIG = 1
    except (OSError, AttributeError):
        return
    if os.getppid() != parent:   # the parent died before the line above: nobody would kill this worker
        os._exit(1)
