"""An option lives where it is declared and where it is read, not in every module it passes through: the names
spelled in code (docstrings and comments aside), and the parse of a list option and the precision's dtype done once."""

from __future__ import annotations

import ast
from pathlib import Path

import diffsynth_mbc

PACKAGE = Path(diffsynth_mbc.__file__).parent


def trees():
    for path in sorted(PACKAGE.rglob("*.py")):
        yield str(path.relative_to(PACKAGE)), ast.parse(path.read_text(encoding="utf-8"))


def modules_spelling(name: str) -> set[str]:
    """The modules whose code names ``name``: an identifier, attribute, keyword or a string holding it."""
    found = set()
    for module, tree in trees():
        docstrings = {id(node.body[0].value) for node in ast.walk(tree)
                      if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
                      and ast.get_docstring(node) is not None}
        for node in ast.walk(tree):
            if ((isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings
                 and name in node.value) or (isinstance(node, ast.Name) and node.id == name)
                    or (isinstance(node, ast.Attribute) and node.attr == name)
                    or (isinstance(node, (ast.keyword, ast.arg)) and node.arg == name)):
                found.add(module)
    return found


def calls_of(function: str) -> list[str]:
    return [f"{module}:{node.lineno}" for module, tree in trees() for node in ast.walk(tree)
            if isinstance(node, ast.Call) and function in (getattr(node.func, "id", None),
                                                           getattr(node.func, "attr", None))]


def test_the_early_stop_lives_in_its_component_its_declaration_its_status_fields_and_what_shows_them():
    assert modules_spelling("early_stop") <= {"training/options/run_options.py", "training/options/checks.py",
                                              "training/components/best_lora.py", "run_files.py", "monitor/view.py",
                                              "monitor/status.py"}


def test_an_option_is_spelled_where_it_is_declared_and_where_it_is_read():
    assert modules_spelling("early_stop_min_delta") == {"training/options/run_options.py",
                                                        "training/components/best_lora.py"}
    assert modules_spelling("val_timestep_quantiles") == {"training/options/run_options.py",
                                                          "training/evaluation/validation.py",
                                                          "training/plan/evaluation_cost.py"}


def test_the_stages_are_parsed_where_declared_and_by_the_cache_command_only():
    assert [call.split(":")[0] for call in calls_of("parse_stages")] == ["data/cache/cli.py"]   # its own flag
    assert "parse_stages" in (PACKAGE / "training/options/run_options.py").read_text()   # listed=parse_stages


def test_the_precision_s_dtype_is_written_once():
    spelled = {module for module, tree in trees() for node in ast.walk(tree)
               if isinstance(node, ast.Attribute) and node.attr in ("bfloat16", "float16")
               and isinstance(node.value, ast.Name) and node.value.id == "torch"}
    assert "gpu.py" in spelled and not spelled & {"training/loop.py", "sample/render.py", "data/cache/cli.py"}
