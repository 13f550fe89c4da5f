"""2 CPU ranks (gloo) of the training, forked from a process that has imported torch, diffsynth and this package once.

``accelerate launch -m diffsynth_mbc.train`` costs three Python start-ups and ~7 s of imports per rank before the
first step; most end-to-end tests only need what the ranks then do. Here a per-run agent (forked from one zygote
process per test run, which preloaded the training's modules, shared by the pytest-xdist workers) forks the ranks with
the environment that ``accelerate launch --multi_gpu`` gives them (read from a real launch: ``RANK``, ``LOCAL_RANK``,
``WORLD_SIZE``, ``MASTER_ADDR``/``PORT``, ``ACCELERATE_*``, ``OMP_NUM_THREADS=1``) and each rank runs the same entry
as ``python -m diffsynth_mbc.train`` (or ``python -m diffsynth_mbc.cache``): real processes, a real process group,
real files. Like accelerate's agent, the agent stops the other ranks when one fails and exits 1 if any rank failed.
Tests of the launchers themselves (supervisor, stop.sh, the launcher watch) start the real launchers instead.
"""

from __future__ import annotations

import fcntl
import importlib
import json
import os
import pickle
import select
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from diffsynth_mbc.lifecycle import processes
from e2e_helpers import free_port, isolated_env

PRELOAD = ["torch", "accelerate", "peft", "diffsynth", "diffsynth_mbc.training.cli", "diffsynth_mbc.training.recipe",
           "diffsynth_mbc.models.pipeline", "diffsynth_mbc.data.cache.dataset", "diffsynth_mbc.training.lora.module",
           "diffsynth_mbc.training.evaluation.validation", "diffsynth_mbc.training.evaluation.sample_clips",
           "diffsynth_mbc.training.reporting.progress", "diffsynth_mbc.training.plan.step_choices",
           "diffsynth_mbc.training.step.micro_batch", "diffsynth_mbc.training.checkpoints.state",
           "diffsynth_mbc.cache",
           # DeepSpeed, and what its ZeRO optimizer check imports (~3 s a rank on top of DeepSpeed's own ~2.5 s)
           "deepspeed", "deepspeed.runtime.zero.muon.muon_optimizer"]
TRAINING = "diffsynth_mbc.training.cli:main"   # python -m diffsynth_mbc.train
CACHE_BUILD = "diffsynth_mbc.cache:main"        # python -m diffsynth_mbc.cache
STOP_OTHERS_GRACE_S = 30   # accelerate's agent: SIGTERM to the other ranks, SIGKILL after this
ZYGOTE_START_TIMEOUT_S = 300   # its imports take ~8 CPU-seconds, on a machine the other workers keep busy
_zygote_process = None        # the zygote this process started, kept so that it is not reported as left running


def _shared_folder() -> Path:
    return Path(os.environ.get("MBC_TEST_RUN_SHARED") or tempfile.gettempdir())


_LAUNCH_ENVIRONMENTS: dict = {}
DUMP = """import json, os, sys
json.dump(dict(os.environ), open(os.path.join(sys.argv[1], f"rank{os.environ.get('RANK', '0')}.json"), "w"))
"""
NOT_CARRIED = ("MASTER_PORT", "TORCHELASTIC_USE_AGENT_STORE", "TORCHELASTIC_ERROR_FILE")   # this run's own


def accelerate_environment(world_size: int, config_file: str | None) -> list[dict]:
    """What ``accelerate launch`` (``--multi_gpu`` on 2 CPU processes, or ``--config_file``) adds to each rank's
    environment, read once per test run from a real launch of a script that writes it down: the first worker to
    need it launches it, the others read what it wrote."""
    key = (world_size, config_file)
    if key not in _LAUNCH_ENVIRONMENTS:
        shared = _shared_folder()
        record = shared / f"launch-environment-{world_size}-{Path(config_file or 'multi_gpu').stem}.json"
        with open(shared / "launch-environment.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if not record.exists():
                written = record.with_suffix(".tmp")
                written.write_text(json.dumps(_launch_environment(world_size, config_file)))
                written.replace(record)
        _LAUNCH_ENVIRONMENTS[key] = json.loads(record.read_text())
    return _LAUNCH_ENVIRONMENTS[key]


def _launch_environment(world_size: int, config_file: str | None) -> list[dict]:
    """A real ``accelerate launch`` of a script that writes down each rank's environment: what it added."""
    with tempfile.TemporaryDirectory(prefix="mbc-launch-env-") as folder:
        script = Path(folder) / "dump_environment.py"
        script.write_text(DUMP)
        # as the demo launcher starts CPU processes: --multi_gpu for 2 or more
        where = ["--config_file", config_file] if config_file else (["--multi_gpu"] if world_size > 1 else []) + [
            "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no"]
        command = [sys.executable, "-m", "accelerate.commands.launch", *where, "--num_processes", str(world_size),
                   "--main_process_port", str(free_port()), str(script), folder]
        base = isolated_env(Path(folder))
        subprocess.run(command, env=base, check=True, capture_output=True, timeout=300, cwd=folder)
        ranks = [json.loads((Path(folder) / f"rank{rank}.json").read_text()) for rank in range(world_size)]
    return [{name: value for name, value in env.items()
             if base.get(name) != value and name not in NOT_CARRIED and name != "_"} for env in ranks]


def _rank(argv: list[str], env: dict, cwd: str, stdout: str, stderr: str, prelude: str | None, entry: str) -> None:
    """One rank, in a forked child: the environment and files of a launched rank, ``prelude`` (Python code a test
    runs in the rank first), then ``entry`` (``module:function``, called with the flags)."""
    code = 1
    try:
        os.chdir(cwd)
        os.environ.clear()
        os.environ.update(env)
        for fd, path in ((1, stdout), (2, stderr)):
            target = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            os.dup2(target, fd)
            os.close(target)
        module, function = entry.split(":")
        sys.argv = [module, *argv]
        import torch

        # A fresh process sizes torch's thread pool from OMP_NUM_THREADS when it imports torch; this one
        # imported torch in the zygote, before that was set.
        torch.set_num_threads(int(env.get("OMP_NUM_THREADS") or os.cpu_count() or 1))
        if prelude:
            exec(prelude, {"__name__": "prelude"})
        import importlib

        code = getattr(importlib.import_module(module), function)(argv)
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    except BaseException:
        import traceback

        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code or 0)


def _agent(argv: list[str], rank_envs: list[dict], cwd: str, stdout: str, stderr: str, prelude: str | None,
           entry: str) -> None:
    """The per-run agent (as accelerate's): forks the ranks, waits, stops the rest when one fails."""
    port, ranks = free_port(), {}
    for rank, env in enumerate(rank_envs):
        pid = os.fork()
        if pid == 0:
            _rank(argv, dict(env, MASTER_PORT=str(port)), cwd, stdout, stderr, prelude, entry)
        ranks[pid] = rank
    failed, stop_deadline = False, None
    while ranks:
        pid, status = os.waitpid(-1, os.WNOHANG)
        if pid == 0:
            if stop_deadline is not None and time.monotonic() > stop_deadline:
                for other in ranks:
                    _signal(other, signal.SIGKILL)
            time.sleep(0.05)
            continue
        if pid not in ranks:
            continue
        del ranks[pid]
        if os.waitstatus_to_exitcode(status) != 0 and not failed:
            failed, stop_deadline = True, time.monotonic() + STOP_OTHERS_GRACE_S
            for other in ranks:
                _signal(other, signal.SIGTERM)
    os._exit(1 if failed else 0)


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def _serve(address: str, owner: int) -> None:
    """The zygote: imports ``PRELOAD`` once, then forks an agent for each request on the Unix socket ``address``
    and answers the agent's pid, then its exit code (``-N``: killed by signal N) when it ends. It ends with the
    test run: when ``owner`` (the pytest process every worker is a child of) has gone."""
    for name in PRELOAD:
        importlib.import_module(name)
    owner_started = processes.start_time(owner)   # a pid reused after the test run is not the test run
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(address + ".binding")
    listener.listen(64)
    os.replace(address + ".binding", address)   # ready: a client that finds the address can connect
    wake_read, wake_write = os.pipe()
    os.set_blocking(wake_read, False)
    os.set_blocking(wake_write, False)
    signal.set_wakeup_fd(wake_write)
    signal.signal(signal.SIGCHLD, lambda *_: None)   # an agent ended: wakes the select below
    signal.signal(signal.SIGINT, signal.SIG_IGN)      # Ctrl-C stops the tests, which then stop it
    agents: dict[int, socket.socket] = {}
    while processes.alive(owner, owner_started):
        ready, _, _ = select.select([listener, wake_read], [], [], 1.0)
        if wake_read in ready:
            while True:
                try:
                    if not os.read(wake_read, 512):
                        break
                except BlockingIOError:
                    break
        while agents:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            answer = agents.pop(pid, None)
            if answer is not None:
                with answer:
                    try:
                        answer.sendall(f"{os.waitstatus_to_exitcode(status)}\n".encode())
                    except OSError:
                        pass   # the test that started it is gone
        if listener in ready:
            connection, _ = listener.accept()
            connection.settimeout(60)
            try:
                request = pickle.loads(_read_all(connection))
            except (EOFError, OSError, pickle.UnpicklingError):   # a client that left before asking
                connection.close()
                continue
            pid = os.fork()
            if pid == 0:   # the agent: nothing of the zygote's but its imports
                signal.set_wakeup_fd(-1)
                signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                signal.signal(signal.SIGINT, signal.default_int_handler)
                for handle in (listener, connection, *agents.values()):
                    handle.close()
                os.close(wake_read)
                os.close(wake_write)
                try:
                    _agent(**request)
                finally:
                    os._exit(1)   # never back into the zygote's loop
            connection.sendall(f"{pid}\n".encode())
            agents[pid] = connection


def _read_all(connection: socket.socket) -> bytes:
    chunks = []
    while chunk := connection.recv(1 << 16):
        chunks.append(chunk)
    return b"".join(chunks)


def _zygote_connection() -> socket.socket:
    """A connection to this test run's zygote; the first worker to need one starts it (under a lock: one per run)."""
    address = str(_shared_folder() / "ranks.sock")
    try:
        return _connect(address)
    except (FileNotFoundError, ConnectionRefusedError):
        pass
    with open(_shared_folder() / "ranks.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            return _connect(address)   # another worker started it meanwhile
        except (FileNotFoundError, ConnectionRefusedError):
            if os.path.exists(address):   # left by a zygote that died: start another
                os.unlink(address)
            _start_zygote(address)
            return _connect(address)


def _connect(address: str) -> socket.socket:
    connection = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        connection.connect(address)
    except OSError:
        connection.close()
        raise
    return connection


def _start_zygote(address: str) -> None:
    global _zygote_process
    # pytest-xdist's workers are children of the pytest process, which outlives them all; without workers, this
    # process is the test run.
    owner = os.getppid() if os.environ.get("PYTEST_XDIST_WORKER") else os.getpid()
    log = open(_shared_folder() / "ranks-zygote.log", "ab")
    # In the test run's session, as the ranks of a launched run are: a session of its own would be a scheduling
    # group of its own (Linux autogroup), and its ranks would share the CPUs differently from launched ones.
    _zygote_process = subprocess.Popen([sys.executable, __file__, address, str(owner)], stdin=subprocess.DEVNULL,
                                       stdout=log, stderr=subprocess.STDOUT)
    log.close()
    deadline = time.monotonic() + ZYGOTE_START_TIMEOUT_S
    while not os.path.exists(address):
        ended = _zygote_process.poll()
        said = (_shared_folder() / "ranks-zygote.log").read_text(errors="replace") if ended is not None else ""
        assert ended is None, f"the ranks' zygote ended ({ended}): {said}"
        assert time.monotonic() < deadline, "the ranks' zygote did not start"
        time.sleep(0.05)


class _Reader:
    def __init__(self, path: Path):
        self.path = path

    def read(self) -> str:
        return self.path.read_text(errors="replace") if self.path.exists() else ""


class ForkedRun:
    """A started run, used as the ``subprocess.Popen`` of ``accelerate launch`` would be: ``pid`` (the agent's; the
    ranks are its children), ``poll``, ``wait``, ``communicate``, ``returncode``, ``stdout.read()``. The zygote
    answers on ``connection``: the agent's pid, then its exit code (``-N``: killed by signal N) when it ends."""

    def __init__(self, connection: socket.socket, stdout: Path, stderr: Path):
        self.connection, self.answered, self.exit_code = connection, b"", None
        self.stdout, self.stderr = _Reader(stdout), _Reader(stderr)
        self.combined = stdout == stderr
        self.pid = int(self._answer(timeout=None))

    def _answer(self, timeout: float | None) -> str | None:
        """The zygote's next line, or None when it has said nothing more within ``timeout``."""
        while b"\n" not in self.answered:
            ready, _, _ = select.select([self.connection], [], [], timeout)
            if not ready:
                return None
            chunk = self.connection.recv(64)
            if not chunk:
                raise RuntimeError("the ranks' zygote ended while a run was going on")
            self.answered += chunk
        line, self.answered = self.answered.split(b"\n", 1)
        return line.decode()

    @property
    def returncode(self) -> int | None:
        return self.poll()

    def poll(self, timeout: float | None = 0) -> int | None:
        if self.exit_code is None:
            answer = self._answer(timeout)
            if answer is not None:
                self.exit_code = int(answer)
                self.connection.close()
        return self.exit_code

    def wait(self, timeout: float | None = None) -> int:
        if self.poll(timeout) is None:
            raise subprocess.TimeoutExpired("forked training ranks", timeout)
        return self.exit_code

    def communicate(self, timeout: float | None = None) -> tuple[str, str | None]:
        try:
            self.wait(timeout)
        except subprocess.TimeoutExpired:
            from e2e_helpers import kill_tree

            kill_tree(self.pid)
            self.poll(60)
            raise
        return self.stdout.read(), None if self.combined else self.stderr.read()


def start_training(work: Path, flags: list[str], world_size: int = 2, config_file: str | None = None,
                   combined: bool = False, prelude: str | None = None, entry: str = TRAINING,
                   **extra_env) -> ForkedRun:
    """Start ``world_size`` ranks of the training with ``flags`` in ``work`` (the working folder, and where its
    caches and the output files go), launched as ``accelerate launch`` would (``config_file``: its
    ``--config_file``); ``combined``: stdout and stderr in one file, as ``stderr=STDOUT``; ``prelude``: Python code
    each rank runs before the training's entry; ``entry``: what each rank runs instead of the training
    (``CACHE_BUILD``: ``accelerate launch -m diffsynth_mbc.cache``); ``extra_env``: more environment for the ranks."""
    work = Path(work)
    outputs = work / ".ranks"
    outputs.mkdir(parents=True, exist_ok=True)
    stamp = f"{time.monotonic_ns()}"
    stdout = outputs / f"{stamp}.out"
    stderr = stdout if combined else outputs / f"{stamp}.err"
    base = isolated_env(work, **extra_env)
    rank_envs = [dict(base, **launched) for launched in accelerate_environment(world_size, config_file)]
    request = {"argv": [str(f) for f in flags], "rank_envs": rank_envs, "cwd": str(work), "stdout": str(stdout),
               "stderr": str(stderr), "prelude": prelude, "entry": entry}
    connection = _zygote_connection()
    connection.sendall(pickle.dumps(request))
    connection.shutdown(socket.SHUT_WR)
    return ForkedRun(connection, stdout, stderr)


def run_training(work: Path, flags: list[str], timeout: float = 300, **options) -> subprocess.CompletedProcess:
    """``start_training`` to the end: a CompletedProcess as ``subprocess.run`` of ``accelerate launch`` gives it
    (returncode 0, or 1 when a rank failed; the ranks' stdout and stderr)."""
    run = start_training(work, flags, **options)
    stdout, stderr = run.communicate(timeout)
    return subprocess.CompletedProcess(["forked ranks", *map(str, flags)], run.returncode, stdout, stderr)


if __name__ == "__main__":   # the zygote: python forked_ranks.py ADDRESS OWNER_PID
    _serve(sys.argv[1], int(sys.argv[2]))
