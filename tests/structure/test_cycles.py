"""No import circle inside a folder: the modules of one folder, joined by the imports between them, form a graph
without a cycle, so every folder reads bottom-up (a module's helpers sit below it) and any module can be
imported, tested or moved on its own.

Every import counts, those inside functions too (a deferred import that closes a circle only hides it); imports
under `if TYPE_CHECKING:` do not, since they never run (they name a type for an annotation).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("qwen_edit_core", "nodes")


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _runtime_nodes(tree: ast.AST):
    """Every node of `tree` except those inside an `if TYPE_CHECKING:` block."""
    stack = [tree]
    while stack:
        node = stack.pop()
        yield node
        if isinstance(node, ast.If) and getattr(node.test, "id", getattr(node.test, "attr", "")) == "TYPE_CHECKING":
            stack.extend(node.orelse)
            continue
        stack.extend(ast.iter_child_nodes(node))


def _imported(path: Path, modules: set[str]) -> set[str]:
    """Dotted names of `modules` that `path` imports at run time: `from a import b` imports the module `a.b` when
    there is one (a package's submodule), else `a`."""
    package = _module_name(path) if path.stem == "__init__" else _module_name(path).rpartition(".")[0]
    found: set[str] = set()
    for node in _runtime_nodes(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative (the nodes/ pack): resolved against this module's package
                anchor = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, *([base] if base else [])])
            found |= {f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names}
    return found & modules


def _folders() -> dict[Path, list[Path]]:
    folders: dict[Path, list[Path]] = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            folders.setdefault(path.parent, []).append(path)
    return folders


def find_cycle(graph: dict[str, set[str]]) -> list[str]:
    """One cycle of `graph` (node -> successors) as [a, b, ..., a], or [] when it has none."""
    state: dict[str, int] = {}  # 1: on the current path, 2: finished
    path: list[str] = []

    def visit(node: str) -> list[str]:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        state[node] = 2
        path.pop()
        return []

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return []


def test_find_cycle_finds_one():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) == []


@pytest.mark.parametrize("folder", sorted(_folders()), ids=lambda p: str(p.relative_to(ROOT)))
def test_no_import_circle_inside_a_folder(folder: Path):
    names = {_module_name(p): p for p in _folders()[folder]}
    graph = {name: _imported(path, set(names)) - {name} for name, path in names.items()}
    cycle = find_cycle(graph)
    assert not cycle, (f"import circle inside {folder.relative_to(ROOT)}: {' -> '.join(cycle)}; move what the "
                       "lower module needs into it (or into a module below both) instead of importing upward")
