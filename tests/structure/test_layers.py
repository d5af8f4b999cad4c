"""The folders are the architecture: a module imports only from its own layer or the layers below it.

Layers, lowest first (docs/DESIGN.md draws the same picture): common < families (the descriptions) < speed < model <
adapters < data < sample < config < train < the application modules at the top of the package (api, jobs, cli,
demo, toys, bench). A family's subpackage (`families/<family>/`) holds one module per stage, each at its stage's
rank (`FAMILY_STAGES`); stages reach them through the family's description, never by import.
The core never imports ComfyUI (`comfy`, `folder_paths`, `server`) or the pack's `nodes/`.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

CORE = Path(__file__).resolve().parents[2] / "qwen_edit_core"
RANKS = {"common": 0, "families": 0.5, "speed": 1, "model": 2, "adapters": 3, "data": 4, "sample": 5, "config": 6,
         "train": 7, "preflight": 8, "api": 8, "jobs": 9, "job_hooks": 9, "shutdown": 9, "demo": 9, "toys": 9,
         "bench": 10, "cli": 11, "__init__": 11}
#: a family subpackage's module -> the stage (layer) it serves
FAMILY_STAGES = {"__init__": "families", "encode": "model", "tiny": "model", "single_file": "model",
                 "text_encoder_file": "model", "vae_file": "model", "example_tensors": "data", "sampler": "sample",
                 "prefix_cache": "sample", "batch": "train",
                 "pretrain": "toys", "fake_model": "bench", "sample_bench": "bench", "planner": "speed"}
FORBIDDEN_ROOTS = {"comfy", "comfy_extras", "folder_paths", "server", "nodes", "execution"}


def _layer(path: Path) -> str:
    rel = path.relative_to(CORE).parts
    if rel[0] == "families" and len(rel) > 2:
        return FAMILY_STAGES[path.stem]
    return rel[0] if len(rel) > 1 else path.stem


def _imports(path: Path) -> list[tuple[int, str]]:
    tree = ast.parse(path.read_text(), filename=str(path))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                raise AssertionError(f"{path}:{node.lineno}: relative import; the core uses absolute imports")
            base = node.module or ""
            found.append((node.lineno, base))
            if base == "qwen_edit_core" or base.startswith("qwen_edit_core.families."):
                # `from qwen_edit_core import speed` names a layer, `from ...families.<family> import batch` a stage
                found += [(node.lineno, f"{base}.{alias.name}") for alias in node.names]
    return found


def _modules() -> list[Path]:
    return sorted(p for p in CORE.rglob("*.py"))


def test_every_core_module_has_a_layer():
    unknown = {_layer(p) for p in _modules()} - RANKS.keys()
    assert not unknown, f"modules outside the layer map (add them to RANKS and docs/DESIGN.md): {unknown}"


@pytest.mark.parametrize("path", _modules(), ids=lambda p: str(p.relative_to(CORE)))
def test_imports_point_down(path: Path):
    own = RANKS[_layer(path)]
    bad = []
    for line, name in _imports(path):
        root = name.split(".")[0]
        if root in FORBIDDEN_ROOTS:
            bad.append(f"line {line}: {name} (the core never imports ComfyUI or the nodes)")
        parts = name.split(".")
        if root == "qwen_edit_core" and len(parts) > 1:
            target = FAMILY_STAGES.get(parts[3], parts[3]) if parts[1] == "families" and len(parts) > 3 else parts[1]
            if target in RANKS and RANKS[target] > own:
                bad.append(f"line {line}: {name} ({target} is above {_layer(path)})")
    assert not bad, f"{path.relative_to(CORE)} imports upward:\n" + "\n".join(bad)
