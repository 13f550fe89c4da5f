"""The README and docs/ say only what the code does: their commands are checked against the real CLIs.

Every shell command in a ```bash block, and every inline `python -m diffsynth_mbc.X ...` / `bash launchers/...`
/ `bash install.sh ...` / `sbatch ...` span, must name a real module or script, and each of its --flags must be one
that command's --help lists (launchers: their own flags in launchers/common.sh, or the training's, which they pass
through; `sbatch [sbatch's options] launchers/train.sbatch FLAGS`: the launchers' flags after the script). Repository paths and links must exist, and the LoRA key example must be what the training writes.

Flags are compared with '-' and '_' taken as the same character: the underscore spelling (DiffSynth's) is the
one the docs use, and the CLIs accept it beside the dash spelling.
"""

from __future__ import annotations

import functools
import importlib.util
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from diffsynth_mbc.training.lora.file_format import convert
from diffsynth_mbc.training.options import DEFAULTS

REPO = Path(__file__).resolve().parents[1]
DOCUMENTS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
INLINE = re.compile(r"`((?:python3? -m diffsynth_mbc\.|bash launchers/|bash install\.sh|sbatch )[^`]*)`")


def _name(path: Path) -> str:
    return str(path.relative_to(REPO))


def shell_commands(text: str) -> list[list[str]]:
    """The commands (token lists, split at &&, ||, |, ;) of a document's bash blocks and inline command spans."""
    lines = []
    for block in re.findall(r"```(?:bash|sh)\n(.*?)```", text, re.S):
        lines += block.replace("\\\n", " ").splitlines()
    lines += INLINE.findall(text)
    commands = []
    for line in lines:
        try:
            tokens = shlex.split(line, comments=True)
        except ValueError:   # an inline span cut mid-quote: its unquoted words still count
            tokens = line.split()
        current: list[str] = []
        for token in tokens + ["&&"]:
            if token in ("&&", "||", "|", ";"):
                if current:
                    commands.append(current)
                current = []
            else:
                current.append(token.strip("[]"))
        commands = [command for command in commands if command]
    return commands


def _normal(flag: str) -> str:
    return flag.split("=")[0]


@functools.lru_cache(maxsize=None)
def help_flags(module: str) -> frozenset[str]:
    """The --flags `python -m MODULE --help` lists."""
    result = subprocess.run([sys.executable, "-m", module, "--help"], capture_output=True, text=True, cwd=REPO,
                            timeout=300)
    assert result.returncode == 0, f"python -m {module} --help: {result.stderr[-500:]}"
    return frozenset(_normal(flag) for flag in re.findall(r"(?<![\w-])--[A-Za-z][\w-]*", result.stdout))


@functools.lru_cache(maxsize=None)
def launcher_flags() -> frozenset[str]:
    """The launchers' own flags (the case labels of mbc_launch in launchers/common.sh) and the training's."""
    common = (REPO / "launchers" / "common.sh").read_text(encoding="utf-8")
    labels = re.findall(r"^\s*((?:-h\|)?--[\w|=*-]+)\)", common, re.M)
    own = {_normal(flag) for label in labels for flag in label.split("|") if flag.startswith("--")}
    return frozenset(own | {flag.rstrip("*") for flag in own} | help_flags("diffsynth_mbc.train"))


def expected_flags(command: list[str]) -> tuple[str, frozenset[str]] | None:
    """(what the command runs, the flags it accepts), or None for a command these docs do not own."""
    words = [word for word in command if not re.fullmatch(r"[A-Z_]+=\S*", word)]   # VAR=value prefixes
    if any(re.search(r"<|\.\.\.|\bX\b", word) for word in words[:3]):
        return None   # a placeholder: `python -m diffsynth_mbc.<command>`, `bash launchers/... --resume latest`
    if "-m" in words and words[words.index("-m") + 1].startswith("diffsynth_mbc"):
        module = words[words.index("-m") + 1]
        assert importlib.util.find_spec(module) is not None, f"no module {module}"
        flags = help_flags(module)
        if module == "diffsynth_mbc.doctor":        # the doctor takes every training flag too
            flags |= help_flags("diffsynth_mbc.train")
        return module, flags
    if words[:1] == ["sbatch"]:   # sbatch's own options, then the batch script and the launchers' flags
        script = next((word for word in words[1:] if word.endswith(".sbatch")), None)
        assert script and (REPO / script).is_file(), f"no batch script in: {shlex.join(words)}"
        return script, launcher_flags()
    if words[:1] == ["bash"] and len(words) > 1:
        script = words[1]
        assert (REPO / script).is_file(), f"no script {script}"
        if script == "install.sh":
            return script, help_flags("diffsynth_mbc.install")
        if script == "launchers/stop.sh":
            return script, help_flags("diffsynth_mbc.stop")
        if script.startswith("launchers/"):
            return script, launcher_flags()
    if words[:1] in (["python"], ["python3"]) and len(words) > 1 and words[1].endswith(".py"):
        assert (REPO / words[1]).is_file(), f"no script {words[1]}"
    return None


def _flags_after_program(command: list[str]) -> list[str]:
    if "-m" in command:
        command = command[command.index("-m") + 2:]
    scripts = [index for index, word in enumerate(command) if word.endswith(".sbatch")]
    if command[:1] == ["sbatch"] and scripts:
        command = command[scripts[0] + 1:]
    return [word for word in command if word.startswith("--") and len(word) > 2]


@pytest.mark.parametrize("document", DOCUMENTS, ids=_name)
def test_every_command_names_a_real_program_and_real_flags(document):
    problems = []
    commands = shell_commands(document.read_text(encoding="utf-8"))
    for command in commands:
        program = expected_flags(command)
        if program is None:
            continue
        name, flags = program
        for flag in _flags_after_program(command):
            if _normal(flag) not in flags:
                problems.append(f"{name} has no {flag}: {shlex.join(command)}")
    assert not problems, "\n".join(problems)


def test_the_readme_shows_the_day_one_path_in_order_after_the_quickstart():
    text = (REPO / "README.md").read_text(encoding="utf-8")
    order = ["## Quickstart", "bash install.sh", "python -m diffsynth_mbc.convert", "python -m diffsynth_mbc.doctor",
             "--cached", "python -m diffsynth_mbc.monitor", "python -m diffsynth_mbc.export", "## Reference"]
    places = [text.find(marker, text.find("## Day one")) if i else text.find(marker) for i, marker in enumerate(order)]
    assert -1 not in places and places[1:] == sorted(places[1:]), dict(zip(order, places))
    assert len(text.splitlines()) < 120, "the README is the quickstart and the day-one path; reference goes to docs/"


@pytest.mark.parametrize("document", DOCUMENTS, ids=_name)
def test_repository_paths_and_links_exist(document):
    text = document.read_text(encoding="utf-8")
    missing = []
    for path in re.findall(r"(?<![\w/.-])((?:configs|launchers|docs|tools|benchmarks|diffsynth_mbc|tests)/[\w./-]*\w)"
                           r"(?![\w{<*])", text):   # not a pattern: configs/train_{test,full}.yaml
        if not (REPO / path).exists():
            missing.append(path)
    for link in re.findall(r"\]\(([^)#\s]+)", text):
        if not re.match(r"[a-z]+://", link) and not (document.parent / link).exists():
            missing.append(link)
    for name in re.findall(r"(?<![\w/.-])((?:install\.sh|requirements-volta\.txt|pyproject\.toml))", text):
        assert (REPO / name).exists(), name
    assert not missing, missing


def _lora_keys(text: str) -> list[str]:
    return re.findall(r"`((?:[\w]+\.)*blocks\.\d+\.[\w.]*lora_[AB][\w.]*weight)`", text)


def test_the_lora_key_example_is_what_the_training_writes():
    peft = {"blocks.0.self_attn.q.lora_A.default.weight": [[1.0, 0.0]],
            "blocks.0.self_attn.q.lora_B.default.weight": [[1.0], [1.0]]}
    import torch

    tensors = {key: torch.tensor(value) for key, value in peft.items()}
    written = {layout: sorted(convert(tensors, layout)) for layout in ("comfyui", "diffsynth")}
    default = written[DEFAULTS["lora_format"]]
    readme = _lora_keys((REPO / "README.md").read_text(encoding="utf-8"))
    assert readme and readme[0] == default[0], (readme, default)        # the files' layout, shown first
    assert set(readme) <= set(written["comfyui"]) | set(written["diffsynth"]), readme
    training = (REPO / "docs" / "training.md").read_text(encoding="utf-8")
    output = training[training.index("- **Output**"):training.index("- **Exit codes**")]
    assert _lora_keys(output) == [default[0]], _lora_keys(output)


def test_the_convert_guide_says_the_hash_and_sizes_as_the_code_does_and_data_is_ignored():
    """The duplicate hash has 63 bits (the DC term of the 8x8 block carries no sign), sizes are width x height as
    the buckets print them, and the README's convert output folder data/ stays out of git."""
    guide = (REPO / "docs" / "convert.md").read_text()
    assert "63-bit perceptual hash" in guide and "64-bit" not in guide
    assert "704 x 1280" not in guide and "1280 x 704 as width x height" in guide
    ignored = subprocess.run(["git", "check-ignore", "-q", "data/mbc_full/metadata.csv"], cwd=REPO)
    assert ignored.returncode == 0
