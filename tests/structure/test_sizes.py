"""Small pieces: no module of the core or the nodes over 600 lines, no function over 60 lines (docstring
included).

A table (an argparse builder's flat list of `add_argument` calls, a node's `INPUT_TYPES`) reads best in one
place; such functions are listed in ALLOWED_LONG_FUNCTIONS by name, with the reason. Lines are never joined to
meet a limit: a module that outgrows it is split by what its parts do.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CORE = ROOT / "qwen_edit_core"
NODES = ROOT / "nodes"
MAX_MODULE_LINES = 600
MAX_FUNCTION_LINES = 60
#: "module path relative to the repository:function name" -> why it may be longer
ALLOWED_LONG_FUNCTIONS = {
    "qwen_edit_core/cli.py:build_parser": "argparse builder: one flat list of subcommands and their flags",
    "nodes/train_nodes.py:INPUT_TYPES": "a node's schema: one table of inputs, each with its tooltip",
}


def _modules() -> list[Path]:
    return sorted([*CORE.rglob("*.py"), *NODES.rglob("*.py")])


def _functions(tree: ast.AST):
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield node


@pytest.mark.parametrize("path", _modules(), ids=lambda p: str(p.relative_to(ROOT)))
def test_module_is_small(path: Path):
    lines = len(path.read_text().splitlines())
    assert lines <= MAX_MODULE_LINES, (f"{path.relative_to(ROOT)} has {lines} lines (limit {MAX_MODULE_LINES}): "
                                       "split it by what its parts do")


@pytest.mark.parametrize("path", _modules(), ids=lambda p: str(p.relative_to(ROOT)))
def test_functions_are_small(path: Path):
    rel = str(path.relative_to(ROOT))
    long = []
    for node in _functions(ast.parse(path.read_text(), filename=str(path))):
        lines = node.end_lineno - node.lineno + 1
        if lines > MAX_FUNCTION_LINES and f"{rel}:{node.name}" not in ALLOWED_LONG_FUNCTIONS:
            long.append(f"{node.name} (line {node.lineno}, {lines} lines)")
    assert not long, f"{rel}: functions over {MAX_FUNCTION_LINES} lines: {', '.join(long)}"


def test_exceptions_still_exist():
    """An exception for a function that no longer exists (or got short) is removed, not left to rot."""
    for key in ALLOWED_LONG_FUNCTIONS:
        rel, name = key.split(":")
        lengths = [n.end_lineno - n.lineno + 1 for n in _functions(ast.parse((ROOT / rel).read_text()))
                   if n.name == name]
        assert lengths and max(lengths) > MAX_FUNCTION_LINES, f"{key} is no longer long: drop its exception"
