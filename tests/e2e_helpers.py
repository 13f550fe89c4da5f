"""Running the real launchers and commands as subprocesses, with caches kept inside the test folder."""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import signal
import socket
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# The environment when the tests were collected: what a test's in-process run sets in this process's environment
# (the training sets ACCELERATE_* for its Accelerator) never reaches the processes later tests start.
SESSION_ENVIRONMENT = dict(os.environ)


def isolated_env(work: Path, **extra) -> dict:
    """The session's environment with the caches a run writes kept in ``work``; C++ extensions (torch's, DeepSpeed's)
    stay in the session's folder (conftest.py): built once."""
    env = dict(SESSION_ENVIRONMENT)
    for var in ("HF_HOME", "MODELSCOPE_CACHE", "TMPDIR", "TRITON_CACHE_DIR"):
        path = work / ".cache" / var.lower()
        path.mkdir(parents=True, exist_ok=True)
        env[var] = str(path)
    env["PYTHON"] = sys.executable
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env.pop("MBC_RUN_ID", None)
    env.update({key: str(value) for key, value in extra.items()})
    return env


def forget_in_process_trainings(monkeypatch) -> None:
    """Unset the ``ACCELERATE_*`` settings an earlier in-process training left in this process's environment, for a
    command run here whose own processes inherit it (the doctor's probe runs)."""
    for key in [key for key in os.environ if key.startswith("ACCELERATE_")]:
        monkeypatch.delenv(key)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def read_status(log_dir: Path, rank: int) -> dict:
    return json.loads((log_dir / f"training_gpu{rank}.json").read_text())


def assert_the_monitor_reads_what_the_ranks_wrote(log_dir: Path, ranks=(0, 1)) -> dict:
    """Every field a run's ranks wrote is one run_files.STATUS_SCHEMA declares, and the monitor reads each back as it
    was written, with no note (#61 item 5). Returns the fields rank 0 wrote, for a test to say which it expects."""
    from diffsynth_mbc.monitor.status import normalize_status
    from diffsynth_mbc.run_files import STATUS_SCHEMA

    written = {}
    for rank in ranks:
        raw = read_status(log_dir, rank)
        read, notes = normalize_status(raw, rank)
        assert sorted(set(raw) - set(STATUS_SCHEMA)) == [] and notes == []
        assert {key: value for key, value in read.items() if key in raw} == raw
        written = written or raw
    return written


def read_history(log_dir: Path, rank: int, overheads: bool = False, health: bool = False) -> list[dict]:
    """A rank's JSONL records: steps, validation, samples; the timing lines of checkpoints, LoRA files, validation
    and samples ({"kind": "overhead"}) only with ``overheads``, the LoRA health ({"kind": "lora_health"}) only with
    ``health``."""
    records = [json.loads(line) for line in (log_dir / f"training_gpu{rank}.jsonl").read_text().splitlines()]
    return [record for record in records if (overheads or record.get("kind") != "overhead")
            and (health or record.get("kind") != "lora_health")]


def read_overheads(log_dir: Path, rank: int) -> list[dict]:
    return [record for record in read_history(log_dir, rank, overheads=True) if record.get("kind") == "overhead"]


def read_health(log_dir: Path, rank: int) -> list[dict]:
    return [record for record in read_history(log_dir, rank, health=True) if record.get("kind") == "lora_health"]


def cpu_launch_command(*train_args: str, num_processes: int = 2) -> list[str]:
    """accelerate launch of the training on CPU ranks (gloo), the way the demo launcher does it."""
    return [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", str(num_processes),
            "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
            "--main_process_port", str(free_port()), "-m", "diffsynth_mbc.train", *train_args]


def a_preset_s_files(folder):
    """What train_test.yaml and train_full.yaml read, relative to ``folder``: metadata, model folder; the media."""
    for name in ("data/mbc_test/metadata.csv", "data/mbc_full/metadata.csv", "data/mbc_full/metadata_val.csv"):
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_text("file_path,caption,media_type\na.mp4,a clip,video\n")
    (folder / "models" / "Wan2.2-TI2V-5B").mkdir(parents=True)
    (folder / "media").mkdir()
    return folder / "media"


def a_value_for(action: argparse.Action) -> list[str]:
    """A value this flag accepts that differs from its default, so that reading it shows (for tests that pass
    every flag of a command)."""
    if action.nargs == 0:
        return []
    choices = action.choices or (action.metavar[1:-1].split(",") if str(action.metavar).startswith("{") else None)
    if choices:   # argparse's, or the training's declared ones (checked by the options, shown as the metavar)
        return [next(str(c) for c in reversed(list(choices)) if c is not None and c != action.default)]
    if action.type is int:
        return ["3"]
    if action.type is float or getattr(action.type, "__name__", "") == "_positive":
        return ["0.5"]
    if callable(action.type) and action.type is not str:   # the options' own parsers (booleans, ...)
        for candidate in ("true", "1", "0.5"):
            try:
                action.type(candidate)
                return [candidate]
            except (ValueError, TypeError, argparse.ArgumentTypeError):
                continue
    if action.dest == "serve":
        return ["0"]
    return ["some/path"]


def build_demo_cache(root, metadata, cache_dir, *extra: str, seed: int = 42) -> None:
    """The latent cache of a demo catalogue prepared in ``root`` (64x64, 9 frames, fp32, no worker processes),
    built in-process by ``python -m diffsynth_mbc.cache``'s own entry; ``extra``: more of its flags."""
    from diffsynth_mbc.data.cache import cli as cache

    args = ["--demo", "--seed", str(seed), "--dataset_base_path", str(Path(root) / "catalog"),
            "--dataset_metadata_path", str(metadata), "--height", "64", "--width", "64", "--num_frames", "9",
            "--cache_dir", str(cache_dir), "--dataset_num_workers", "0", "--dtype", "fp32", *extra]
    assert cache.main(args) == 0


def demo_flags(data_root, run_dir=None, **overrides) -> list[str]:
    """The demo preset's training flags on a demo catalogue prepared in ``data_root``, writing to ``run_dir``
    (``data_root`` itself by default); ``overrides``: more flags."""
    run_dir = Path(run_dir or data_root)
    flags = {"config": REPO / "configs" / "train_demo.yaml", "dataset_base_path": Path(data_root) / "catalog",
             "dataset_metadata_path": Path(data_root) / "metadata" / "metadata.csv", "output_path": run_dir / "lora",
             "log_dir": run_dir / "logs", **overrides}
    return [item for key, value in flags.items() for item in (f"--{key}", str(value))]


def launch(tmp_path, flags):
    """2 training ranks started as ``accelerate launch`` starts them, forked (``forked_ranks``): a handle used as
    its Popen (stdout and stderr in one)."""
    from forked_ranks import start_training

    return start_training(tmp_path, flags, combined=True, OMP_NUM_THREADS=1)


def run(tmp_path, flags, timeout=300):
    process = launch(tmp_path, flags)
    output, _ = process.communicate(timeout=timeout)
    return process.returncode, output


def wait_for(condition, process, timeout=180, what="condition", seen=lambda: "", every=0.05):
    """``condition()``'s first true value, asked every ``every`` seconds while ``process`` runs; ``seen()`` says
    what was last seen when it never comes."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        assert process.poll() is None, f"the run ended before {what}: {process.stdout.read()[-3000:]}"
        assert time.monotonic() < deadline, f"timed out waiting for {what}; last seen: {seen()}"
        time.sleep(every)


def kill_tree(pid):
    """SIGKILL the launcher and every process under it, as a reboot would (torchrun starts each rank in a
    session of its own, so killing the launcher's process group would leave the ranks running)."""
    import psutil

    parent = psutil.Process(pid)
    processes = parent.children(recursive=True) + [parent]
    for process in processes:
        try:
            process.send_signal(signal.SIGKILL)
        except psutil.NoSuchProcess:
            pass
    # A killed process lets go of its files (the run's locks among them) only once it has exited, which on a
    # loaded machine takes a moment: wait, as a reboot's next start would.
    psutil.wait_procs(processes[:-1], timeout=60)   # the launcher itself is the caller's to wait for


def run_main(main, args, cwd) -> argparse.Namespace:
    """A command's ``main(argv)`` in this process, as ``python -m`` would run it from ``cwd``: (returncode, stdout,
    stderr), as subprocess.run gives them. The same code as the command, without a Python start-up and the
    imports (torch's, diffsynth's) that cost seconds per process."""
    out, err, before = io.StringIO(), io.StringIO(), os.getcwd()
    os.chdir(cwd)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = main([str(arg) for arg in args])
    finally:
        os.chdir(before)
    return argparse.Namespace(returncode=code, stdout=out.getvalue(), stderr=err.getvalue())


def assert_trained_alike(run_a: Path, run_b: Path) -> None:
    """Two demo runs (``output_path`` = RUN/lora, ``log_dir`` = RUN/logs) trained the same: every LoRA tensor bit
    for bit, and rank 0's loss at every step."""
    import torch
    from safetensors.torch import load_file

    a, b = (load_file(run / "lora" / "lora.safetensors") for run in (run_a, run_b))
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key
    losses = [[r["loss"] for r in read_history(run / "logs", 0) if r.get("kind") is None] for run in (run_a, run_b)]
    assert losses[0] == losses[1]
