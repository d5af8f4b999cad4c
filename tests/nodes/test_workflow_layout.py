"""The shipped workflows read left to right: a Note first, one group per stage, every node at least the size
ComfyUI's frontend gives it (measured sizes in workflows/frontend/node_sizes.json), no two nodes overlapping,
every link pointing right. The same checks run on the page's own rectangles in tools/comfy_test."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import nodes
from nodes.common import has_control_after_generate
from workflows.layout import TITLE, frontend_sizes, overlaps

ROOT = Path(__file__).resolve().parents[2]
WORKFLOWS = sorted((ROOT / "example_workflows").glob("*.json"))
WIDGET_TYPES = ("INT", "FLOAT", "STRING", "BOOLEAN")


def _frontend_widgets(node_id: str) -> list[str]:
    """Widget names the frontend creates for a node of ours, in order (seed widgets add their control)."""
    names = []
    spec = nodes.NODE_CLASS_MAPPINGS[node_id].INPUT_TYPES()
    for group in ("required", "optional"):
        for name, value in spec.get(group, {}).items():
            options = value[1] if len(value) > 1 else {}
            if (isinstance(value[0], list) or value[0] in WIDGET_TYPES) and not options.get("forceInput"):
                names.append(name)
                if has_control_after_generate(name, value):
                    names.append("control_after_generate")
    return names


@pytest.mark.parametrize("node_id", sorted(nodes.NODE_CLASS_MAPPINGS))
def test_measured_sizes_are_for_the_current_widgets(node_id):
    measured = frontend_sizes()
    assert node_id in measured, f"{node_id}: measure it (python tools/comfy_test/run.py --only sizes ...)"
    assert measured[node_id]["widgets"] == _frontend_widgets(node_id), (
        f"{node_id}: its widgets changed since its size was measured; run python tools/comfy_test/run.py "
        "--only sizes --comfyui-dir ..., then workflows/build_workflows.py")


def _rect(node):
    (x, y), (w, h) = node["pos"], node["size"]
    return x, y - TITLE, w, h + TITLE


@pytest.mark.parametrize("path", WORKFLOWS, ids=lambda p: p.name)
def test_workflow_reads_left_to_right_without_overlaps(path):
    graph = json.loads(path.read_text())
    measured = frontend_sizes()
    by_id = {n["id"]: n for n in graph["nodes"]}
    notes = [n for n in graph["nodes"] if n["type"] == "Note"]
    assert len(notes) == 1 and len(notes[0]["widgets_values"][0]) > 150, f"{path.name}: a Note explains it"
    assert "Change first" in notes[0]["widgets_values"][0] or "change first" in notes[0]["widgets_values"][0]
    assert not overlaps([_rect(n) for n in graph["nodes"]]), f"{path.name}: nodes overlap"
    for node in graph["nodes"]:
        w, h = measured[node["type"]]["size"]
        assert node["size"][0] >= w and node["size"][1] >= h, f"{path.name}: {node['type']} smaller than new"
    groups = [g["bounding"] for g in graph["groups"]]
    assert groups and not overlaps(groups), f"{path.name}: groups missing or overlapping"
    for node in graph["nodes"]:
        x, y, w, h = _rect(node)
        inside = [g for g in groups if g[0] <= x and g[1] <= y and x + w <= g[0] + g[2] and y + h <= g[1] + g[3]]
        assert node["type"] == "Note" or len(inside) == 1, f"{path.name}: {node['type']} not in one group"
    for _, src, _, dst, _, _ in graph["links"]:
        assert by_id[src]["pos"][0] <= by_id[dst]["pos"][0], f"{path.name}: link {src}->{dst} points left"
