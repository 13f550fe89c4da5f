"""The run's lock, held by the launcher *and by every rank*, and the launcher that every rank watches.

One training per output, log and checkpoint folder (per node): each folder has a lock file
``.train[.nodeR].lock`` and a record beside it, ``.train[.nodeR].pid``::

    <launcher pid>
    <run id>
    key=value ...          (written by the supervisor: accelerate=PID, log_dir=PATH, launcher_start=TICKS)

The launcher takes each lock *exclusively* first (no process of another run may hold it, not even a
rank whose launcher died), then turns it into a *shared* lock and hands the lock files to the ranks
(``MBC_RUN_LOCKS``). Each rank opens them itself and takes them shared, checking the record names its
run, so the folders stay locked while any rank of the run lives, whatever became of its launcher.

A training started without the launcher (``accelerate launch -m diffsynth_mbc.train``, torchrun, or
``python -m diffsynth_mbc.train``) locks its folders itself, the same way (``lock_without_launcher``): each
node's local rank 0 takes the locks exclusively, records the process that started the ranks as the run's
launcher, and shares them with the node's other ranks. So the lock belongs to the training, whatever started it.

Each rank also watches its launcher (``MBC_LAUNCHER_PID`` with its start time ``MBC_LAUNCHER_START``, so a
reused pid is never taken for it): when it is gone, the rank stops as on SIGTERM (finishes the step,
checkpoints, writes ``stopped``). No torch.
"""

from __future__ import annotations

import fcntl
import os
import stat
import threading
import time
from pathlib import Path
from typing import Callable

from diffsynth_mbc import environment
from diffsynth_mbc.lifecycle.processes import alive
from diffsynth_mbc.run_layout import lock_name, lock_record_name

_held: list[int] = []     # this process's lock descriptors, open until it exits


class RunLockError(RuntimeError):
    """This process may not join the run on these folders."""


def record_file(lock_file: str | os.PathLike) -> Path:
    lock_file = Path(lock_file)
    return lock_file.with_name(lock_record_name(lock_file.name))


def read_record(lock_file: str | os.PathLike) -> dict:
    """{"launcher": pid or None, "run_id": str or None, **key=value lines} of the record beside ``lock_file``."""
    try:
        lines = record_file(lock_file).read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError):
        return {"launcher": None, "run_id": None}
    record = {"launcher": int(lines[0]) if lines and lines[0].strip().isdigit() else None,
              "run_id": lines[1].strip() or None if len(lines) > 1 else None}
    for line in lines[2:]:
        key, _, value = line.partition("=")
        if key.strip():
            record[key.strip()] = value.strip()
    return record


def write_record(lock_file: str | os.PathLike, launcher: int, run_id: str, **extra) -> None:
    lines = [str(launcher), run_id] + [f"{key}={value}" for key, value in extra.items()]
    path = record_file(lock_file)
    temporary = path.with_name(path.name + ".tmp")
    temporary.write_text("\n".join(lines) + "\n", encoding="utf-8")
    os.replace(temporary, path)


def regular_lock_problem(lock_file: str | os.PathLike) -> str | None:
    """Why ``lock_file`` is not a lock a run of ours could have made (a symlink, a device, ...), else None."""
    try:
        info = os.lstat(lock_file)
    except OSError as exc:
        return f"cannot read it ({exc.strerror})"
    if stat.S_ISLNK(info.st_mode):
        return f"it is a symbolic link (to {os.readlink(lock_file)})"
    if not stat.S_ISREG(info.st_mode):
        return "it is not a regular file"
    if info.st_uid != os.getuid():
        return f"it belongs to another user (uid {info.st_uid})"
    return None


def hold_run_locks(environ=os.environ) -> list[str]:
    """Take the run's lock files (``MBC_RUN_LOCKS``) shared, for as long as this process lives; [] without any.

    Raises RunLockError when a lock is not a regular file, is held exclusively by another launch, or its
    record names another run than ``MBC_RUN_ID``."""
    paths = [path for path in environ.get(environment.RUN_LOCKS, "").split(os.pathsep) if path]
    run_id = environ.get(environment.RUN_ID)
    taken = []
    for path in paths:
        problem = regular_lock_problem(path)
        if problem:
            raise RunLockError(f"refusing the run's lock {path}: {problem}")
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise RunLockError(f"{path} is held by another launch on the same folder") from None
        recorded = read_record(path)["run_id"]
        if run_id and recorded != run_id:
            os.close(fd)
            raise RunLockError(f"{path} belongs to run {recorded}, not to this run ({run_id})")
        _held.append(fd)
        taken.append(path)
    return taken


def lock_without_launcher(folders, run_id: str, local_rank: int, machine_rank: int = 0,
                          wait_s: float = 120.0) -> list[tuple[int, str | None]]:
    """Lock ``folders`` for a training no launcher locked (``MBC_RUN_LOCKS`` unset); (descriptor, the lock whose
    record this process wrote, or None) for each, held until ``release`` (which also removes those records) or the
    process's end.

    Local rank 0 takes each lock exclusively, so a folder that any process of another run holds is refused
    (RunLockError naming the folder and that run), writes the record (the ranks' parent process as the launcher,
    the run id) and turns the lock shared. The node's other ranks wait until the record names their own parent,
    then take the lock shared."""
    launcher, held = os.getppid(), []
    try:
        for folder in dict.fromkeys(os.path.realpath(str(folder)) for folder in folders if folder):
            os.makedirs(folder, exist_ok=True)
            path = os.path.join(folder, lock_name(machine_rank))
            problem = regular_lock_problem(path) if os.path.lexists(path) else None
            if problem:
                raise RunLockError(f"refusing the run's lock {path}: {problem}")
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
            held.append((fd, None))
            if local_rank == 0:
                _take_first(fd, path, launcher, run_id)
                held[-1] = (fd, path)
            else:
                _join(fd, path, launcher, wait_s)
    except BaseException:
        release(held)
        raise
    return held


def _take_first(fd: int, path: str, launcher: int, run_id: str) -> None:
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        other = read_record(path)["run_id"] or "of unknown id"
        folder = os.path.dirname(path)
        raise RunLockError(f"a training is already running on {folder}: run {other}. Not starting another (this "
                           f"one was started without the launcher, and takes the same lock); stop that run with: "
                           f"bash launchers/stop.sh {folder}") from None
    write_record(path, launcher, run_id, started_without_launcher="true")
    fcntl.flock(fd, fcntl.LOCK_SH)


def _join(fd: int, path: str, launcher: int, wait_s: float) -> None:
    deadline = time.monotonic() + wait_s
    while True:
        if read_record(path)["launcher"] == launcher:
            try:
                fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
                return
            except BlockingIOError:   # local rank 0 still holds it exclusively
                pass
        if time.monotonic() >= deadline:
            raise RunLockError(f"local rank 0 of this launch did not take {path} within {wait_s:g} s (another run "
                               "holds the folder, or rank 0 stopped)")
        time.sleep(0.05)


def release(held: list[tuple[int, str | None]]) -> None:
    """Remove the records this process wrote (while they still name its launch), then let go of the locks."""
    launcher = os.getppid()
    for fd, path in held:
        if path is not None and read_record(path)["launcher"] == launcher:
            record_file(path).unlink(missing_ok=True)
        try:
            os.close(fd)
        except OSError:
            pass


class LauncherWatch:
    """A thread that calls ``on_gone`` once when the launcher process (pid and start time) no longer runs."""

    def __init__(self, pid: int, started: int | None, on_gone: Callable[[str], None], interval_s: float = 1.0):
        self.pid, self.started, self.on_gone, self.interval_s = pid, started, on_gone, interval_s
        self._stop = threading.Event()

    def start(self) -> "LauncherWatch":
        threading.Thread(target=self._watch, name="launcher-watch", daemon=True).start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def _watch(self) -> None:
        while not self._stop.wait(self.interval_s):
            if not alive(self.pid, self.started):
                self.on_gone(f"its launcher (pid {self.pid}) ended")
                return


def watch_launcher(on_gone: Callable[[str], None], environ=os.environ, interval_s: float = 1.0) -> LauncherWatch | None:
    """Start watching the launcher named in the environment; None when no launcher started this process."""
    pid, started = environ.get(environment.LAUNCHER_PID, ""), environ.get(environment.LAUNCHER_START, "")
    if not pid.isdigit():
        return None
    return LauncherWatch(int(pid), int(started) if started.isdigit() else None, on_gone, interval_s).start()


def launcher_gone(environ=os.environ) -> bool:
    """Whether the launcher that started this process (``MBC_LAUNCHER_PID``/``_START``) has ended; False without one."""
    pid, started = environ.get(environment.LAUNCHER_PID, ""), environ.get(environment.LAUNCHER_START, "")
    return pid.isdigit() and not alive(int(pid), int(started) if started.isdigit() else None)


def follow_run_log(environ=os.environ) -> None:
    """The launcher copied this process's output into the run's log; with it gone, write there directly."""
    log = environ.get(environment.RUN_LOG)
    if not log:   # a detached launcher's ranks write to the log file themselves
        return
    try:
        target = os.open(log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    except OSError:
        target = os.open(os.devnull, os.O_WRONLY)
    for fd in (1, 2):
        os.dup2(target, fd)
    os.close(target)
