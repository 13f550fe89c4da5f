"""`bash install.sh` (``python3 -m diffsynth_mbc.install``): create ``.venv`` and install this package with the
torch build this machine's GPUs can run, chosen before anything is downloaded.

PyPI's newest torch has no kernels for Volta (Tesla V100/V100S, compute capability 7.0): the CUDA 13 builds
start at sm_75. So when ``nvidia-smi`` lists a GPU of capability 7.x below 7.5, the install runs with
``requirements-volta.txt`` as a pip constraints file (``-c``): torch and torchvision are pinned in the same
resolution as everything else, so one torch is downloaded, the right one. Otherwise (no GPU, Turing and newer)
it runs the plain ``pip install -e '.[dev]'``. Either way it first says in one line which build it chose and why.

Runs on a bare Python before anything is installed: standard library only; the choice is pure logic over
``nvidia-smi``'s text, tested without a GPU.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

from diffsynth_mbc.flags import FlagParser

ROOT = Path(__file__).resolve().parents[1]
VOLTA_CONSTRAINTS = "requirements-volta.txt"
SMI_QUERY = ["nvidia-smi", "--query-gpu=compute_cap,name", "--format=csv,noheader"]
CHOICES = ("auto", "volta", "default")


class InstallError(RuntimeError):
    """The install cannot choose a torch build (or was asked for something it cannot do)."""


@dataclasses.dataclass(frozen=True)
class Gpu:
    name: str
    capability: tuple[int, int]


@dataclasses.dataclass(frozen=True)
class Choice:
    build: str    # 'volta' (the requirements-volta.txt pins) or 'default' (what pyproject.toml allows)
    reason: str   # one line: which GPUs, which build, why


def parse_smi(stdout: str) -> list[Gpu]:
    """``nvidia-smi --query-gpu=compute_cap,name --format=csv,noheader`` -> the GPUs it lists."""
    gpus = []
    for line in stdout.splitlines():
        if not line.strip():
            continue
        capability, _, name = (part.strip() for part in line.partition(","))
        match = re.fullmatch(r"(\d+)\.(\d+)", capability)
        if not match:
            raise InstallError(f"nvidia-smi printed {line.strip()!r}, not 'compute capability, name'")
        gpus.append(Gpu(name or "unnamed GPU", (int(match.group(1)), int(match.group(2)))))
    return gpus


def query_gpus() -> list[Gpu]:
    """This machine's GPUs as nvidia-smi lists them ([] without nvidia-smi); InstallError when it fails."""
    if not shutil.which(SMI_QUERY[0]):
        return []
    try:
        result = subprocess.run(SMI_QUERY, capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as error:
        raise InstallError(f"nvidia-smi did not answer ({error}), so the GPUs' torch build cannot be chosen; "
                           "fix the driver or choose with --torch volta|default") from None
    if result.returncode != 0:
        said = (result.stderr.strip() or result.stdout.strip() or "no message").splitlines()[0]
        raise InstallError(f"nvidia-smi failed (exit {result.returncode}: {said}), so the GPUs' torch build "
                           "cannot be chosen; fix the driver or choose with --torch volta|default")
    return parse_smi(result.stdout)


def volta_pins(root: Path = ROOT) -> list[str]:
    """The pins of requirements-volta.txt (``torch==2.10.0``, ...), in file order."""
    lines = (root / VOLTA_CONSTRAINTS).read_text(encoding="utf-8").splitlines()
    return [line.split("#")[0].strip() for line in lines if line.split("#")[0].strip()]


def torch_range(root: Path = ROOT) -> str:
    """pyproject.toml's torch requirement (``torch>=2.10,<2.15``)."""
    match = re.search(r'^\s*"(torch[<>=!~][^"]*)"', (root / "pyproject.toml").read_text(encoding="utf-8"), re.M)
    return match.group(1) if match else "torch"


def _describe(gpus: list[Gpu]) -> str:
    names: dict[tuple[str, tuple[int, int]], int] = {}
    for gpu in gpus:
        names[(gpu.name, gpu.capability)] = names.get((gpu.name, gpu.capability), 0) + 1
    return ", ".join(f"{count} x {name} (compute capability {cap[0]}.{cap[1]})" for (name, cap), count in names.items())


def choose(gpus: list[Gpu], asked: str = "auto", root: Path = ROOT) -> Choice:
    """Which torch build to install for these GPUs ([]: none), or the one asked for."""
    volta = " + ".join(volta_pins(root))
    volta_why = f"{volta} from {VOLTA_CONSTRAINTS} (CUDA 12.8, the newest PyPI build with sm_70)"
    default = f"the newest {torch_range(root)} pyproject.toml allows"
    if asked == "volta":
        return Choice("volta", f"--torch volta: installing {volta_why}")
    if asked == "default":
        return Choice("default", f"--torch default: installing {default}")
    if asked != "auto":
        raise InstallError(f"--torch must be one of {', '.join(CHOICES)}, got {asked!r}")
    if not gpus:
        return Choice("default", f"no NVIDIA GPU found (no nvidia-smi, or it lists none): installing {default}")
    oldest = min(gpu.capability for gpu in gpus)
    if oldest < (7, 0):
        raise InstallError(f"found {_describe(gpus)}: no torch build this project allows runs on compute capability "
                           f"{oldest[0]}.{oldest[1]} (the oldest, {volta_pins(root)[0]}, starts at sm_70)")
    if oldest < (7, 5):
        return Choice("volta", f"found {_describe(gpus)}: installing {volta_why}; newer builds have no Volta kernels")
    return Choice("default", f"found {_describe(gpus)}: installing {default} (its CUDA builds run sm_75 and newer)")


def commands(choice: Choice, venv: str, extras: str = "dev", python: str = sys.executable) -> list[list[str]]:
    """The commands that install ``choice`` into ``venv``: create the venv, one pip resolution, then this package's
    bytecode compiled once (pip compiles what it installs, not an editable install's sources: every process would
    compile them again where bytecode is not written, ``PYTHONDONTWRITEBYTECODE``, as on CI machines)."""
    venv_python = str(Path(venv) / "bin" / "python")
    pip = [venv_python, "-m", "pip", "install", "-e", f".[{extras}]" if extras else "."]
    if choice.build == "volta":
        pip += ["-c", VOLTA_CONSTRAINTS]
    return [[python, "-m", "venv", venv], pip, [venv_python, "-m", "compileall", "-q", "diffsynth_mbc"]]


def build_parser() -> argparse.ArgumentParser:
    parser = FlagParser(
        prog="bash install.sh", description="Create a virtual environment and install diffsynth-mbc with the "
        "torch build this machine's GPUs can run (Volta: requirements-volta.txt's pins; else the newest allowed).")
    parser.add_argument("--torch", default="auto", choices=CHOICES,
                        help="auto: ask nvidia-smi (default); volta or default: choose, e.g. on a machine without the GPUs")
    parser.add_argument("--venv", default=".venv", help="the virtual environment to create or reuse (default: .venv)")
    parser.add_argument("--extras", default="dev", help="extras to install (default: dev, which the tests need; '' for none)")
    parser.add_argument("--dry_run", action="store_true",
                        help="say what would be chosen and print the commands, run nothing")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        choice = choose(query_gpus() if args.torch == "auto" else [], args.torch)
    except InstallError as error:
        print(f"install: {error}", file=sys.stderr)
        return 2
    print(f"install: {choice.reason}", flush=True)
    for command in commands(choice, args.venv, args.extras):
        print(("would run: " if args.dry_run else "+ ") + shlex.join(command), flush=True)
        if not args.dry_run:
            result = subprocess.run(command, cwd=ROOT)
            if result.returncode != 0:
                print(f"install: failed (exit {result.returncode}): {shlex.join(command)}", file=sys.stderr)
                return result.returncode
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
