"""`bash install.sh`: the torch build is chosen from nvidia-smi before anything is downloaded.

The choice is pure logic over nvidia-smi's text; the script itself runs with a fake nvidia-smi first on PATH
(a V100S, an A100, a mixed box, none, a failing driver) in --dry_run mode, which prints the commands it would
run and runs none of them.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from diffsynth_mbc.gpu import VOLTA_TORCH
from diffsynth_mbc.install import Gpu, InstallError, choose, commands, parse_smi, volta_pins

REPO = Path(__file__).resolve().parents[1]
V100S = "7.0, Tesla V100S-PCIE-32GB"
A100 = "8.0, NVIDIA A100-SXM4-80GB"
T4 = "7.5, Tesla T4"


def test_nvidia_smis_lines_are_read_as_capability_and_name():
    assert parse_smi(f"{V100S}\n{V100S}\n\n") == [Gpu("Tesla V100S-PCIE-32GB", (7, 0))] * 2
    assert parse_smi("") == []
    with pytest.raises(InstallError, match="not 'compute capability, name'"):
        parse_smi("[N/A], Tesla V100S-PCIE-32GB")


@pytest.mark.parametrize("lines, build", [
    ([V100S, V100S], "volta"),
    ([A100], "default"),
    ([T4], "default"),           # sm_75 is in the newest builds
    ([A100, V100S], "volta"),    # one Volta GPU decides: it is the one the newest build cannot run
    ([], "default"),             # no GPU: CPU
])
def test_the_build_is_chosen_by_the_oldest_gpu(lines, build):
    choice = choose(parse_smi("\n".join(lines)))
    assert choice.build == build
    if build == "volta":
        assert "torch==2.10.0 + torchvision==0.25.0" in choice.reason and "sm_70" in choice.reason
        assert "Tesla V100S-PCIE-32GB (compute capability 7.0)" in choice.reason
    else:
        assert "torch>=" in choice.reason and "pyproject.toml" in choice.reason


def test_a_gpu_no_allowed_torch_runs_on_is_refused_and_a_choice_can_be_forced():
    with pytest.raises(InstallError, match=r"compute capability 6\.1"):
        choose([Gpu("Tesla P40", (6, 1))])
    assert choose([], "volta").build == "volta"
    assert choose(parse_smi(V100S), "default").build == "default"


def test_the_volta_install_is_one_pip_resolution_with_the_pins_as_constraints():
    create, pip, compiled = commands(choose(parse_smi(V100S)), ".venv", python="python3")
    assert create == ["python3", "-m", "venv", ".venv"]
    assert compiled == [".venv/bin/python", "-m", "compileall", "-q", "diffsynth_mbc"]
    assert pip == [".venv/bin/python", "-m", "pip", "install", "-e", ".[dev]", "-c", "requirements-volta.txt"]
    plain = commands(choose([]), ".venv", python="python3")[1]
    assert plain == [".venv/bin/python", "-m", "pip", "install", "-e", ".[dev]"]


def test_the_volta_pins_are_the_ones_the_training_names_in_its_fix():
    assert volta_pins() == VOLTA_TORCH.split()


def _run_install(tmp_path: Path, smi: str | None, *args: str) -> subprocess.CompletedProcess:
    """bash install.sh with PATH holding only a fake nvidia-smi (or none) and dirname."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    os.symlink(shutil.which("dirname"), bin_dir / "dirname")
    if smi is not None:
        (bin_dir / "nvidia-smi").write_text(f"#!/bin/sh\n{smi}\n")
        (bin_dir / "nvidia-smi").chmod(0o755)
    env = {**os.environ, "PATH": str(bin_dir), "PYTHON": sys.executable}
    return subprocess.run(["/bin/bash", str(REPO / "install.sh"), "--dry_run", "--venv", str(tmp_path / "venv"), *args],
                          capture_output=True, text=True, env=env, timeout=120)


def _answers(*lines: str) -> str:
    return 'case "$*" in *compute_cap,name*) printf "%s\\n" ' + " ".join(f"'{line}'" for line in lines) + ' ;; *) exit 9 ;; esac'


@pytest.mark.parametrize("smi, constrained, said", [
    (_answers(V100S, V100S), True, "found 2 x Tesla V100S-PCIE-32GB (compute capability 7.0): installing torch==2.10.0"),
    (_answers(A100), False, "found 1 x NVIDIA A100-SXM4-80GB (compute capability 8.0): installing the newest torch>="),
    (None, False, "no NVIDIA GPU found"),
])
def test_install_sh_asks_nvidia_smi_and_says_which_build_before_running_pip(tmp_path, smi, constrained, said):
    result = _run_install(tmp_path, smi)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0].startswith("install: " + said), lines
    pip = [line for line in lines if " -m pip install " in line]
    assert len(pip) == 1 and pip[0].startswith("would run: "), lines   # one resolution, one torch
    assert pip[0].endswith("-e '.[dev]' -c requirements-volta.txt" if constrained else "-e '.[dev]'"), pip
    assert not (tmp_path / "venv").exists()                               # a dry run creates nothing


def test_install_sh_stops_naming_the_failure_when_nvidia_smi_fails(tmp_path):
    result = _run_install(tmp_path, 'echo "NVIDIA-SMI has failed because it couldn\'t communicate with the NVIDIA driver."; exit 9')
    assert result.returncode == 2
    assert result.stdout == ""
    message = result.stderr.strip()
    assert len(message.splitlines()) == 1
    assert "nvidia-smi failed (exit 9: NVIDIA-SMI has failed because" in message and "--torch volta|default" in message
    (tmp_path / "forced").mkdir()
    forced = _run_install(tmp_path / "forced", "exit 9", "--torch", "volta")   # nvidia-smi is not asked then
    assert forced.returncode == 0 and forced.stdout.startswith("install: --torch volta: installing torch==2.10.0"), forced
