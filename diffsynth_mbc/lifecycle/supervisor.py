"""The launcher's last stage: it runs ``accelerate launch`` and owns the run's processes, signals and end.

    python -m diffsynth_mbc.supervise --lock FILE [--lock FILE ...] --log_dir DIR [--log_file F] -- COMMAND...

``launchers/common.sh`` locks the folders (``diffsynth_mbc.lifecycle.run_lock``), then ``exec``s this, so
the launcher's pid and its locks carry over. It

- starts COMMAND in a session of its own, so Ctrl-C reaches this process only, and gives the ranks the
  lock files, its pid and its start time (each rank takes the locks and watches this process);
- records itself and accelerate beside each lock (``.train.pid``), which ``stop.sh`` checks before it
  signals anything;
- copies COMMAND's output to its own and appends it to ``--log_file``;
- on SIGINT, SIGTERM or SIGHUP sends SIGTERM to the ranks (each finishes its step, checkpoints and
  writes ``stopped``); a repeated SIGTERM or SIGHUP is the same request and changes nothing; a person's
  second Ctrl-C (SIGINT) is passed on as SIGINT (the ranks then exit at once), a third kills them;
- on the scheduler's warning (SIGUSR1, ``launchers/train.sbatch``) passes it on to the ranks, each time it comes (a
  rank takes a repeat for the same request; one that came before any rank was up is asked again): they end
  ``preempted``. accelerate is started with it ignored, so neither it nor a cache job's ranks end on it, and a
  training's, in a scheduler's job, with SIGTERM blocked: the scheduler's SIGTERM reaches the ranks themselves, and
  accelerate waits for them;
- when COMMAND ends, marks ranks that died without a final status failed, ends with the run's last word
  (a failed rank's cause, or the checkpoint and command that resume a stopped run) after whatever torch
  printed, and removes its records.

Linux only (reads /proc). No torch.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import subprocess
import sys
import threading

from diffsynth_mbc import environment
from diffsynth_mbc.flags import FlagParser
from diffsynth_mbc.lifecycle import run_lock
from diffsynth_mbc.lifecycle.processes import children, is_trainer, start_time
from diffsynth_mbc.lifecycle.signals import NOW_SIGNAL, PREEMPT_SIGNAL, STOP_SIGNALS
from diffsynth_mbc.lifecycle.stop_command import closing_lines, mark_dead_ranks, rank_states

ERROR_LINE = re.compile(r"^(?:\[rank \d+\] )?error: (.+)$")
MAX_ERRORS = 5
MAX_ERROR_CHARS = 4000


class Supervisor:
    def __init__(self, command: list[str], locks: list[str], log_dir: str, log_file: str | None = None,
                 launcher_pid: int | None = None, out=None, resume_command: str | None = None):
        self.command, self.locks, self.log_dir, self.log_file = command, locks, log_dir, log_file
        self.pid = os.getpid()
        self.launcher_pid = launcher_pid or self.pid
        self.out = out or sys.stdout.buffer
        self.resume_command = resume_command
        self.child: subprocess.Popen | None = None
        self.signals_received = 0
        self.interrupts = 0   # of them, SIGINTs: a person's Ctrl-C
        self._log = None
        self.errors: dict[str, None] = {}   # the ranks' "error: ..." lines, each once (a refusal before any status)
        self._partial = b""

    # -- the command

    def environment(self) -> dict:
        env = dict(os.environ)
        env[environment.LAUNCHER_PID] = str(self.pid)
        env[environment.LAUNCHER_START] = str(start_time(self.pid))
        env[environment.RUN_LOCKS] = os.pathsep.join(self.locks)
        if self.log_file:
            env[environment.RUN_LOG] = self.log_file
        else:
            env.pop(environment.RUN_LOG, None)
        return env

    def run(self) -> int:
        for sig in STOP_SIGNALS:
            signal.signal(sig, self._on_signal)
        piped = self.log_file is not None
        if piped:
            self._log = open(self.log_file, "ab")
        # stdin stays the launcher's: rank 0 sizes its live bar by the terminal found there. The command inherits the
        # preemption signal ignored (its ranks take it back, the training's), this process then passes it on. In a
        # scheduler's job every process gets its SIGTERM: accelerate would take it for a failure (a traceback, its
        # ranks killed 30 s on), so a training's starts with SIGTERM blocked and waits for its ranks to stop after
        # their step (a cache job's ranks end on it at once, as ever).
        signal.signal(PREEMPT_SIGNAL, signal.SIG_IGN)
        training = os.environ.get(environment.SLURM_JOB) and "diffsynth_mbc.train" in self.command
        held = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM} if training else set())
        try:
            self.child = subprocess.Popen(self.command, env=self.environment(), start_new_session=True,
                                          stdout=subprocess.PIPE if piped else None,
                                          stderr=subprocess.STDOUT if piped else None)
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, held)
        signal.signal(PREEMPT_SIGNAL, self._on_preemption)
        self.write_records()
        copier = threading.Thread(target=self._copy_output, daemon=True) if piped else None
        if copier:
            copier.start()
        code = self._wait()
        if copier:
            copier.join(timeout=30)
        return self.conclude(code)

    def _wait(self) -> int:
        while True:
            try:
                return self.child.wait()
            except InterruptedError:   # a signal handler ran; keep waiting
                continue

    def _copy_output(self) -> None:
        fd = self.child.stdout.fileno()
        while True:
            try:
                chunk = os.read(fd, 65536)
            except InterruptedError:
                continue
            if not chunk:
                return
            self.emit(chunk)
            self._remember_errors(chunk)

    def _remember_errors(self, chunk: bytes) -> None:
        """Keep the lines a rank printed as ``error: ...`` (``[rank N] error: ...``), to say them again last. Runs on
        all of a run's output: a chunk without such a line costs one search."""
        data = self._partial + chunk
        cut = data.rfind(b"\n")
        self._partial = data[cut + 1:][-MAX_ERROR_CHARS:]
        if cut < 0 or b"error: " not in data[:cut]:
            return
        for raw in data[:cut].split(b"\n"):
            line = ERROR_LINE.match(raw.decode("utf-8", "replace").strip())
            if line and len(self.errors) < MAX_ERRORS:
                self.errors.setdefault(line.group(1)[:MAX_ERROR_CHARS], None)

    def emit(self, data: bytes) -> None:
        """To this process's output (the terminal) and the log file; a closed terminal never stops the run."""
        for stream in (self.out, self._log):
            if stream is None:
                continue
            try:
                stream.write(data)
                stream.flush()
            except (OSError, ValueError):
                pass

    def say(self, text: str) -> None:
        self.emit((text + "\n").encode())

    # -- signals

    def ranks(self) -> list[int]:
        """The rank processes: accelerate's children that run the training (or the cache job)."""
        if self.child is None:
            return []
        return [pid for pid in children(self.child.pid) if is_trainer(pid)]

    def _on_signal(self, signum, _frame) -> None:
        first = self.signals_received == 0
        self.signals_received += 1
        self.interrupts += signum == NOW_SIGNAL
        if self.child is None or self.child.poll() is not None:
            return
        if not first and signum != NOW_SIGNAL:
            return   # the stop already asked for, asked again
        ranks = self.ranks()
        if self.interrupts >= 3:
            targets, sig = ranks + [self.child.pid], signal.SIGKILL
        elif first:   # no rank yet: accelerate itself, which stops what it started
            targets, sig = ranks or [self.child.pid], signal.SIGTERM
        else:         # a person's second Ctrl-C: now
            targets, sig = ranks or [self.child.pid], NOW_SIGNAL
        for pid in targets:
            try:
                os.kill(pid, sig)
            except (ProcessLookupError, PermissionError):
                continue

    def _on_preemption(self, signum, _frame) -> None:
        """The scheduler's warning: to every rank (the same request again to a rank that had it already)."""
        for pid in self.ranks():
            try:
                os.kill(pid, signum)
            except (ProcessLookupError, PermissionError):
                continue

    # -- records and the end

    def write_records(self) -> None:
        run_id = os.environ.get(environment.RUN_ID, "")
        for lock in self.locks:
            run_lock.write_record(lock, self.launcher_pid, run_id, supervisor=self.pid,
                                  supervisor_start=start_time(self.pid), accelerate=self.child.pid,
                                  log_dir=os.path.abspath(self.log_dir))

    def remove_records(self) -> None:
        """Only the launcher's own records: a cache job's supervisor leaves them for the training that follows."""
        if self.launcher_pid != self.pid:
            return
        for lock in self.locks:
            if run_lock.read_record(lock).get("supervisor") == str(self.pid):
                run_lock.record_file(lock).unlink(missing_ok=True)

    def conclude(self, code: int) -> int:
        marked = mark_dead_ranks(self.log_dir, code)
        if marked:
            self.say(f"marked rank(s) {' '.join(map(str, marked))} failed: their process ended without a final status")
        closing = closing_lines(rank_states(self.log_dir, os.environ.get(environment.RUN_ID) or None),
                                self.resume_command, self.log_file)
        if not closing and code != 0 and self.errors:   # refused before any status file: its words, after torch's
            closing = [f"the run did not start: {error}" for error in self.errors] + \
                ([f"  log: {self.log_file}"] if self.log_file else [])
        for line in closing:
            self.say(line)
        self.remove_records()
        return code


def build_parser() -> argparse.ArgumentParser:
    parser = FlagParser(prog="python -m diffsynth_mbc.supervise", allow_abbrev=False,
                        description="Run a launch command as the owner of its processes (used by "
                                    "launchers/common.sh).")
    parser.add_argument("--lock", action="append", default=[], help="a lock file of the run (repeatable)")
    parser.add_argument("--log-dir", required=True, help="the run's log folder (per-rank status files)")
    parser.add_argument("--log-file", help="append the command's output here too")
    parser.add_argument("--launcher-pid", type=int, help="the launcher, when this is not it (default: this process)")
    parser.add_argument("--resume-command", help="the command that resumes this run, shown when it was stopped")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- COMMAND ...")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    options = parser.parse_args(argv)
    command = options.command[1:] if options.command[:1] == ["--"] else options.command
    if not command:
        parser.error("no command given")
    return Supervisor(command, options.lock, options.log_dir, options.log_file, options.launcher_pid,
                      resume_command=options.resume_command).run()
