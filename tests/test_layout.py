"""The package layout's rules (README, "Layout"), checked on the source and by importing."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "diffsynth_mbc"
# Pure logic: importable without torch (what it needs of torch, if anything, is imported inside functions).
TORCH_FREE = [
    "atomic.py", "errors.py", "run_files.py", "run_layout.py", "gpu.py", "sample_prompts.py", "yaml_input.py",
    "values.py", "environment.py",
    "models/model_files.py",
    "data/convert/catalogue_rows.py", "data/convert/selection.py", "data/convert/file_checks.py",
    "data/convert/caption_lengths.py", "data/cache/index.py", "data/media/shapes.py", "data/caption_rules.py",
    "data/sample_draws.py", "data/metadata_csv.py", "data/inspect/measure_store.py", "data/media/size_table.py",
    "data/media/row_buckets.py", "training/checkpoints/row_sizes.py", "data/media/stages.py",
    "data/inspect/measures.py", "data/inspect/duplicates.py", "data/inspect/reasons.py",
    "lifecycle/processes.py", "lifecycle/run_lock.py", "lifecycle/supervisor.py", "lifecycle/signals.py",
    "lifecycle/stop_command.py",
    "training/options/__init__.py", "training/options/run_options.py", "training/options/parser.py",
    "training/options/checks.py", "training/options/run_record.py", "sample/lora_files.py", "sample/sweep_plan.py",
    "sample/sheet.py",
    "training/plan/step_plan.py", "training/plan/batches.py", "training/plan/memory.py", "training/plan/speed.py",
    "training/plan/run_length.py", "training/plan/estimates.py", "training/plan/compile_policy.py",
    "training/plan/recompute.py", "training/plan/evaluation_cost.py",
    "training/step/objective.py", "training/evaluation/health_flags.py",
    "training/components/protocol.py", "training/components/guards.py", "training/components/best_lora.py",
    "training/components/schedules.py", "training/components/stages.py", "training/components/ema.py",
    "training/components/progress.py", "training/components/sample_clips.py",
    "training/lora/file_format.py", "training/lora/read.py",
    "training/checkpoints/state.py", "training/checkpoints/folder.py",
    "training/reporting/eta.py", "training/reporting/step_timing.py", "training/reporting/status_writer.py",
    "training/reporting/history_appender.py", "training/reporting/log_folder.py",
    "doctor/disk.py", "doctor/advice.py",
]


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


def module_graph(package: Path) -> dict[str, set[str]]:
    """Each module of ``package`` -> the package's modules it imports (anywhere in it; ``TYPE_CHECKING`` blocks
    aside). ``from a.b import c`` counts module ``a.b.c`` when it is one, else ``a.b``."""
    names = {}
    for path in sorted(package.rglob("*.py")):
        parts = path.relative_to(package.parent).with_suffix("").parts
        names[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path

    def known(name: str) -> str | None:
        while name and name not in names:
            name = name.rpartition(".")[0]
        return name or None

    graph = {}
    for name, path in names.items():
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
                node.body = []
        found = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                found |= {known(alias.name) for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                found |= {known(f"{node.module}.{alias.name}") for alias in node.names}
        graph[name] = {other for other in found if other and other != name}
    return graph


def import_circles(package: Path) -> list[list[str]]:
    """The import circles of ``package``: each a sorted list of the modules that import each other, round."""
    graph, order, low, stack, on_stack, circles = module_graph(package), {}, {}, [], set(), []

    def visit(module: str) -> None:
        order[module] = low[module] = len(order)
        stack.append(module)
        on_stack.add(module)
        for other in sorted(graph[module]):
            if other not in order:
                visit(other)
                low[module] = min(low[module], low[other])
            elif other in on_stack:
                low[module] = min(low[module], order[other])
        if low[module] == order[module]:
            members = []
            while not members or members[-1] != module:
                members.append(stack.pop())
                on_stack.discard(members[-1])
            if len(members) > 1:
                circles.append(sorted(members))

    for module in sorted(graph):
        if module not in order:
            visit(module)
    return sorted(circles)


def test_data_and_monitor_never_import_training():
    assert offenders(modules("data") + modules("monitor"), ["diffsynth_mbc.training"]) == {}


def test_training_never_imports_the_doctor():
    """The cost model lives in training/plan/: the doctor reads it, the training never asks the doctor."""
    assert offenders(modules("training"), ["diffsynth_mbc.doctor"]) == {}


def test_monitor_imports_neither_torch_diffsynth_nor_other_stages():
    assert offenders(modules("monitor"), ["torch", "diffsynth", "diffsynth_mbc.data", "diffsynth_mbc.models",
                                          "diffsynth_mbc.training", "diffsynth_mbc.doctor", "diffsynth_mbc.lifecycle",
                                          "safetensors"]) == {}


def test_models_import_no_other_stage():
    assert offenders(modules("models"), ["diffsynth_mbc.data", "diffsynth_mbc.training",
                                         "diffsynth_mbc.monitor"]) == {}


def test_no_import_circles():
    assert import_circles(PACKAGE) == []


def test_a_planted_circle_is_found(tmp_path):
    """The circle check on a package with one planted: a -> b -> c -> a (one import inside a function)."""
    package = tmp_path / "diffsynth_mbc"
    (package / "stage").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "stage" / "__init__.py").write_text("")
    (package / "stage" / "a.py").write_text("from diffsynth_mbc.stage import b\n")
    (package / "stage" / "b.py").write_text("from diffsynth_mbc.stage.c import thing\n")
    (package / "stage" / "c.py").write_text("def thing():\n    import diffsynth_mbc.stage.a\n")
    (package / "stage" / "d.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                                            "    from diffsynth_mbc.stage import e\n")
    (package / "stage" / "e.py").write_text("from diffsynth_mbc.stage import d\n")
    assert import_circles(package) == [["diffsynth_mbc.stage.a", "diffsynth_mbc.stage.b", "diffsynth_mbc.stage.c"]]


def test_options_are_read_as_typed_attributes_never_with_getattr():
    """The training's options and every command's parsed flags (``args``: the converter read its --height, --width
    and --source_fps with getattr)."""
    reads = [f"{path.relative_to(PACKAGE)}:{node.lineno}" for path in modules()
             for node in ast.walk(ast.parse(path.read_text())) if isinstance(node, ast.Call)
             and isinstance(node.func, ast.Name) and node.func.id == "getattr" and node.args
             and isinstance(node.args[0], ast.Name) and node.args[0].id in ("options", "opts", "train_options", "args")]
    assert reads == []


def code_strings(path: Path) -> list[str]:
    """The string constants of a module's code: docstrings aside, the parts of f-strings included."""
    tree = ast.parse(path.read_text())
    docstrings = {id(node.body[0].value) for node in ast.walk(tree)
                  if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
                  and ast.get_docstring(node) is not None}
    return [node.value for node in ast.walk(tree)
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings]


def test_each_environment_name_is_spelled_in_one_module():
    """Every ``MBC_*`` name in code (docstrings aside) is ``diffsynth_mbc/environment.py``'s."""
    spelled = {}
    for path in modules():
        for text in code_strings(path):
            for name in re.findall(r"\bMBC_[A-Z_]+", text):
                spelled.setdefault(name, set()).add(str(path.relative_to(PACKAGE)))
    assert spelled and {name: sorted(where) for name, where in spelled.items() if where != {"environment.py"}} == {}


# A run's file and folder names as code would spell them: each only in run_layout.py (docstrings aside).
RUN_FILE_NAMES = {
    "checkpoint.json": r"checkpoint\.json", "the status files": r"training_gpu", "lora-best": r"lora-best",
    "lora.safetensors": r"\blora(_ema)?\.safetensors", "the step-N pattern": r"step-(?:[{\\(\[%*]|$)",
    "the EMA twins": r"_ema\.safetensors|^_ema$", "run_options.json": r"run_options\.json",
    "size_table.json": r"size_table\.json", "sweep.json / .html": r"sweep\.(?:json|html)|\.sweep-records",
    "row_sizes.json": r"row_sizes\.json", "ema_state": r"ema_state\.safetensors", "prompts.json": r"prompts\.json",
    "old histories": r"\.jsonl\.old", "replaced-RUN_ID": r"(?:^|/)replaced-", "damaged-": r"(?:^|/)damaged-",
    "the checkpoint temp folder": r"^\.tmp-", "the launch's log": r"train-\*?\.log|^train-$",
    "the default folders": r"^(?:\./)?training_logs$|^tracking$|^latent_cache(?:_val)?$",
    "the cache's files": r"cache\.json|failures\.csv|sample_prompts\.safetensors",
    "the lock": r"^\.train(?:\.|$)",
}


def test_each_run_file_name_is_spelled_in_one_module():
    """The names of a run's files and folders (checkpoint.json, step-N, lora-best, the status files, sweep.json, ...)
    are ``diffsynth_mbc/run_layout.py``'s: every reader and writer imports them (#61 item 4)."""
    spelled = {}
    for path in modules():
        for text in code_strings(path):
            for what, pattern in RUN_FILE_NAMES.items():
                if re.search(pattern, text):
                    spelled.setdefault(what, set()).add(str(path.relative_to(PACKAGE)))
    assert set(spelled) == set(RUN_FILE_NAMES)   # each pattern finds its name where it is spelled
    assert {what: sorted(where) for what, where in spelled.items() if where != {"run_layout.py"}} == {}


def test_pure_modules_import_no_torch_at_module_level():
    assert offenders([PACKAGE / name for name in TORCH_FREE], ["torch", "diffsynth", "accelerate"],
                     module_level_only=True) == {}


@pytest.mark.parametrize("module", ["diffsynth_mbc.monitor.cli", "diffsynth_mbc.monitor.server",
                                    "diffsynth_mbc.training.plan.step_plan", "diffsynth_mbc.data.convert.selection",
                                    "diffsynth_mbc.training.checkpoints.state", "diffsynth_mbc.training.options",
                                    "diffsynth_mbc.training.plan.estimates", "diffsynth_mbc.training.plan.command"])
def test_light_modules_load_without_torch(module):
    code = f"import sys, {module}; print('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          check=True).stdout.strip() == "False"


MAX_FIELDS = 15   # a class holding more state than this does more than one job


def state_fields(node: ast.ClassDef) -> set[str]:
    """A class's fields: its annotated class attributes (a dataclass's) and every ``self.X`` it assigns."""
    fields = {item.target.id for item in node.body if isinstance(item, ast.AnnAssign)
              and isinstance(item.target, ast.Name)}
    for item in ast.walk(node):
        targets = item.targets if isinstance(item, ast.Assign) else [item.target] \
            if isinstance(item, (ast.AnnAssign, ast.AugAssign)) else []
        for target in targets:
            for each in target.elts if isinstance(target, ast.Tuple) else [target]:
                if isinstance(each, ast.Attribute) and isinstance(each.value, ast.Name) and each.value.id == "self":
                    fields.add(each.attr)
    return fields


def test_no_training_class_holds_more_than_15_fields():
    """The training's parts, position and components each own a little state (options and the plan are declarations,
    not state)."""
    crowded = {f"{path.relative_to(PACKAGE)}:{node.name}": len(fields) for path in modules("training")
               if "options" not in path.parts and "plan" not in path.parts
               for node in ast.walk(ast.parse(path.read_text())) if isinstance(node, ast.ClassDef)
               and len(fields := state_fields(node)) > MAX_FIELDS}
    assert crowded == {}


def test_every_module_says_what_it_owns():
    assert [str(p.relative_to(PACKAGE)) for p in modules() if not ast.get_docstring(ast.parse(p.read_text()))] == []


def test_test_files_have_names_of_their_own():
    """pytest imports test files by their name (no packages under tests/): two files of one name stop collection."""
    names: dict[str, list[str]] = {}
    for path in sorted((PACKAGE.parent / "tests").rglob("test_*.py")):
        names.setdefault(path.name, []).append(str(path.relative_to(PACKAGE.parent)))
    assert not {name: paths for name, paths in names.items() if len(paths) > 1}
