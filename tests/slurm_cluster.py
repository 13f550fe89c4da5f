"""A real SLURM cluster of its own for the tests of launchers/train.sbatch: munged, slurmctld and one slurmd per node
(n0, n1, ... all on this machine, as several-slurmd clusters run), in a folder of their own, on ports free at the
start, with ``SLURM_CONF`` pointing at their ``slurm.conf``; the daemons are this process's children, stopped with it.

Needs Debian's ``slurmctld``, ``slurmd``, ``slurm-client`` and ``munge``; ``needs_slurm`` skips a test when they are
absent, except where MBC_REQUIRE_SLURM=1 (CI) makes them required.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

DAEMONS = ("munged", "slurmctld", "slurmd")
COMMANDS = ("sbatch", "scontrol", "squeue", "scancel", "sinfo")
HAVE_SLURM = all(shutil.which(name) or os.path.exists(f"/usr/sbin/{name}") for name in DAEMONS + COMMANDS)
needs_slurm = pytest.mark.skipif(
    not HAVE_SLURM and not os.environ.get("MBC_REQUIRE_SLURM"),
    reason="needs SLURM and munge (apt-get install slurmctld slurmd slurm-client munge)")


def _daemon(name: str) -> str:
    return shutil.which(name) or f"/usr/sbin/{name}"


def _free_ports(count: int) -> list[int]:
    sockets = [socket.socket() for _ in range(count)]
    try:
        for sock in sockets:
            sock.bind(("127.0.0.1", 0))
        return [sock.getsockname()[1] for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


class Cluster:
    """The running cluster: ``env`` (this process's environment with ``SLURM_CONF``), its commands, its jobs."""

    def __init__(self, folder: Path, nodes: int):
        self.folder, self.nodes = folder, [f"n{index}" for index in range(nodes)]
        self.conf = folder / "slurm.conf"
        self.env = {**os.environ, "SLURM_CONF": str(self.conf)}
        self.daemons: list[tuple[str, subprocess.Popen]] = []

    # -- start and stop

    def start(self) -> "Cluster":
        key_dir = self.folder / "munge"
        key_dir.mkdir(mode=0o700)
        key = key_dir / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        munge_socket = key_dir / "munge.sock"
        # --force: the socket's folders are the test run's private temporary ones (munged wants them open to every
        # user, for the clients of other users; here every client is root)
        self._spawn("munged", [_daemon("munged"), "--foreground", "--force", f"--socket={munge_socket}",
                               f"--key-file={key}", f"--pid-file={key_dir / 'munged.pid'}",
                               f"--seed-file={key_dir / 'munged.seed'}"])
        self._wait(lambda: munge_socket.exists(), 30, "munged's socket")
        controller, *node_ports = _free_ports(1 + len(self.nodes))
        for name in ("state", "log", *(f"spool-{node}" for node in self.nodes)):
            (self.folder / name).mkdir()
        host = socket.gethostname()
        self.conf.write_text("\n".join([
            "ClusterName=mbctest", f"SlurmctldHost={host}(127.0.0.1)", f"SlurmctldPort={controller}",
            "SlurmUser=root", "SlurmdUser=root", "AuthType=auth/munge", f"AuthInfo=socket={munge_socket}",
            "CredType=cred/munge", f"StateSaveLocation={self.folder / 'state'}",
            f"SlurmdSpoolDir={self.folder / 'spool-%n'}", f"SlurmctldPidFile={self.folder / 'slurmctld.pid'}",
            f"SlurmdPidFile={self.folder / 'slurmd-%n.pid'}", f"SlurmctldLogFile={self.folder / 'log/slurmctld.log'}",
            f"SlurmdLogFile={self.folder / 'log/slurmd-%n.log'}", "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none", "SchedulerType=sched/backfill", "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_Core", "ReturnToService=2", "MpiDefault=none",
            "JobAcctGatherType=jobacct_gather/none", "AccountingStorageType=accounting_storage/none",
            "JobCompType=jobcomp/none", "MailProg=/bin/true", "InactiveLimit=0", "MinJobAge=600",
            "SlurmdParameters=config_overrides",
            *(f"NodeName={node} NodeHostname={host} NodeAddr=127.0.0.1 Port={port} CPUs=8 State=UNKNOWN"
              for node, port in zip(self.nodes, node_ports)),
            f"PartitionName=debug Nodes={','.join(self.nodes)} Default=YES MaxTime=INFINITE State=UP", ""]))
        self._spawn("slurmctld", [_daemon("slurmctld"), "-D", "-f", str(self.conf)])
        for node in self.nodes:
            self._spawn(f"slurmd {node}", [_daemon("slurmd"), "-D", "-N", node, "-f", str(self.conf)])
        self._wait(self._idle, 60, "every node idle")
        return self

    def _spawn(self, name: str, command: list[str]) -> None:
        log = open(self.folder / f"{name.replace(' ', '-')}.out", "wb")
        self.daemons.append((name, subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=self.env,
                                                    stdin=subprocess.DEVNULL)))
        log.close()

    def _idle_or_busy(self) -> bool:
        """slurmctld runs and answers (else there is no job to end, and its clients would retry for a minute)."""
        return any(name == "slurmctld" and daemon.poll() is None for name, daemon in self.daemons) and \
            self.run("sinfo", "-h", check=False).returncode == 0

    def _idle(self) -> bool:
        states = self.run("sinfo", "-h", "-N", "-o", "%T", check=False).stdout.split()
        return len(states) == len(self.nodes) and all(state == "idle" for state in states)

    def _wait(self, condition, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while not condition():
            for name, daemon in self.daemons:
                assert daemon.poll() is None, f"{name} ended: {self.logs()}"
            assert time.monotonic() < deadline, f"timed out waiting for {what}: {self.logs()}"
            time.sleep(0.2)

    def logs(self) -> str:
        return "\n".join(f"--- {path.name}:\n{path.read_text(errors='replace')[-2000:]}"
                         for path in sorted([*self.folder.glob("*.out"), *self.folder.glob("log/*")]))

    def stop(self) -> None:
        """Every job cancelled and gone, then the daemons stopped, the last first."""
        try:
            if not self._idle_or_busy():
                return
            jobs = self.run("squeue", "-h", "-o", "%i", check=False).stdout.split()
            if jobs:
                self.run("scancel", *jobs, check=False)
                deadline = time.monotonic() + 120
                while self.run("squeue", "-h", "-o", "%i", check=False).stdout.split() and \
                        time.monotonic() < deadline:
                    time.sleep(0.5)
        finally:
            for _name, daemon in reversed(self.daemons):
                daemon.terminate()
                try:
                    daemon.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    daemon.kill()
                    daemon.wait()

    # -- commands and jobs

    def run(self, *command: str, check: bool = True, **kwargs) -> subprocess.CompletedProcess:
        result = subprocess.run(command, env={**self.env, **kwargs.pop("env", {})}, capture_output=True, text=True,
                                timeout=60, **kwargs)
        assert not check or result.returncode == 0, f"{' '.join(command)}: {result.stdout}{result.stderr}"
        return result

    def submit(self, cwd: Path, script: str, *args: str, options=(), env=None) -> str:
        """``sbatch [options] script args`` from ``cwd`` with ``env``: the job id."""
        return self.run("sbatch", "--parsable", *options, script, *args, cwd=cwd, env=env or {}).stdout.strip()

    def job(self, job_id: str) -> dict:
        """``scontrol show job``'s fields (JobState, Restarts, Reason, ...); {} once SLURM forgot the job."""
        result = self.run("scontrol", "-o", "show", "job", job_id, check=False)
        fields = {}
        for item in result.stdout.split():
            key, _, value = item.partition("=")
            fields.setdefault(key, value)
        return fields if result.returncode == 0 else {}

    def wait_for_job(self, job_id: str, condition, timeout: float, what: str) -> dict:
        deadline = time.monotonic() + timeout
        while True:
            job = self.job(job_id)
            if condition(job):
                return job
            assert time.monotonic() < deadline, f"timed out waiting for job {job_id} {what}: {job}"
            time.sleep(0.3)


def start_cluster(nodes: int = 2) -> Cluster:
    """A cluster in a temporary folder of its own (removed with the test run's, tests/conftest.py)."""
    folder = Path(tempfile.mkdtemp(prefix="slurm-"))
    cluster = Cluster(folder, nodes)
    try:
        return cluster.start()
    except BaseException:
        cluster.stop()
        raise
