"""The package layout's rules (README, "Layout"), checked on the source and by importing."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "diffsynth_mbc"
MAX_MODULE_LINES = 400
MAX_FUNCTION_LINES = 80
# Pure logic: importable without torch (what it needs of torch, if anything, is imported inside functions).
TORCH_FREE = ["atomic.py", "errors.py", "run_files.py", "data/catalog.py", "data/selection.py", "data/cache/index.py",
              "models/model_files.py", "training/options/__init__.py", "training/options/run_options.py",
              "training/options/parser.py", "training/options/checks.py", "training/step_plan.py", "training/eta.py",
              "training/step_timing.py", "training/checkpoints.py", "training/status_writer.py",
              "training/history_appender.py", "training/log_folder.py",
              "training/run_control.py", "training/lora_format.py", "training/guards.py", "gpu.py", "doctor/memory.py",
              "doctor/speed.py", "doctor/projection.py", "doctor/estimates.py", "sample_prompts.py", "data/shapes.py",
              "training/batches.py", "training/step/compile_policy.py", "training/step/checkpointing.py",
              "data/file_checks.py", "data/captions.py", "data/caption_rules.py", "training/processes.py", "training/run_lock.py",
              "training/supervisor.py", "training/objective.py", "data/sample_draws.py",
              "doctor/disk.py", "doctor/advice.py", "training/checkpoint_folder.py", "yaml_input.py",
              "data/metadata_csv.py"]


def modules(folder: str = "") -> list[Path]:
    return sorted((PACKAGE / folder).rglob("*.py"))


def imports(path: Path, module_level_only: bool = False) -> set[str]:
    tree = ast.parse(path.read_text())
    nodes = tree.body if module_level_only else ast.walk(tree)
    found = set()
    for node in nodes:
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found |= {f"{node.module}.{alias.name}" for alias in node.names}
    return found


def offenders(paths, forbidden, module_level_only=False):
    return {str(p.relative_to(PACKAGE)): sorted(name for name in imports(p, module_level_only)
                                               if any(name == f or name.startswith(f + ".") for f in forbidden))
            for p in paths if any(name == f or name.startswith(f + ".") for name in imports(p, module_level_only)
                                  for f in forbidden)}


def test_data_and_monitor_never_import_training():
    assert offenders(modules("data") + modules("monitor"), ["diffsynth_mbc.training"]) == {}


def test_monitor_imports_neither_torch_diffsynth_nor_other_stages():
    assert offenders(modules("monitor"), ["torch", "diffsynth", "diffsynth_mbc.data", "diffsynth_mbc.models",
                                          "diffsynth_mbc.training", "safetensors"]) == {}


def test_models_import_no_other_stage():
    assert offenders(modules("models"), ["diffsynth_mbc.data", "diffsynth_mbc.training",
                                         "diffsynth_mbc.monitor"]) == {}


def test_pure_modules_import_no_torch_at_module_level():
    assert offenders([PACKAGE / name for name in TORCH_FREE], ["torch", "diffsynth", "accelerate"],
                     module_level_only=True) == {}


@pytest.mark.parametrize("module", ["diffsynth_mbc.monitor.cli", "diffsynth_mbc.monitor.server",
                                    "diffsynth_mbc.training.step_plan", "diffsynth_mbc.data.selection",
                                    "diffsynth_mbc.training.checkpoints", "diffsynth_mbc.training.options",
                                    "diffsynth_mbc.doctor.estimates", "diffsynth_mbc.training.plan"])
def test_light_modules_load_without_torch(module):
    code = f"import sys, {module}; print('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          check=True).stdout.strip() == "False"


def test_no_module_or_function_is_too_long():
    too_long = []
    for path in modules():
        source = path.read_text()
        if len(source.splitlines()) > MAX_MODULE_LINES:
            too_long.append(f"{path.relative_to(PACKAGE)}: {len(source.splitlines())} lines")
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = node.end_lineno - node.lineno + 1
                if length > MAX_FUNCTION_LINES:
                    too_long.append(f"{path.relative_to(PACKAGE)}:{node.lineno} {node.name}: {length} lines")
    assert too_long == []


def test_every_module_says_what_it_owns():
    assert [str(p.relative_to(PACKAGE)) for p in modules() if not ast.get_docstring(ast.parse(p.read_text()))] == []
