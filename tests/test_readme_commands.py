"""The README opens with two commands; CI runs exactly those, so what CI sees is what a newcomer sees."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def readme_commands() -> list[str]:
    text = (REPO / "README.md").read_text(encoding="utf-8")
    block = re.search(r"```bash\n(.*?)```", text, re.S).group(1)
    return [line for line in block.splitlines() if line.strip() and not line.lstrip().startswith("#")]


def test_the_readme_opens_with_an_install_and_demo_command_and_a_test_command():
    install, test = readme_commands()
    # The install script chooses the torch build for this machine's GPUs before pip downloads one
    # (tests/test_install.py); a bare `pip install` would take the newest torch, which has no V100 kernels.
    assert install.startswith("bash install.sh && . .venv/bin/activate && ")
    assert install.endswith("bash launchers/train_test.sh --demo")
    assert "pip install" not in install
    assert test.endswith("python -m pytest -q")


def test_ci_runs_the_readme_commands_word_for_word_and_pins_nothing_of_its_own():
    ci = (REPO / ".ci" / "run").read_text(encoding="utf-8")
    lines = [line.strip() for line in ci.splitlines()]
    for command in readme_commands():
        assert command.strip() in lines, command
    installs = [line for line in lines if re.search(r"\bpip\b.*\binstall\b|install\.sh", line)]
    assert installs == [readme_commands()[0].strip()], installs   # no pins or extra installs beside the README's
