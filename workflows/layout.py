"""Placement of the shipped workflows' nodes: left to right by stage, one group per stage, each node at least
the size ComfyUI's frontend gives it when added from the menu (frontend/node_sizes.json), none overlapping.

frontend/node_sizes.json (in a subfolder: ComfyUI offers every workflows/*.json as a template) is measured
in the real frontend (`LiteGraph.createNode(type).size`, the size a node gets when added from the menu) by
`python tools/comfy_test/run.py --only sizes --comfyui-dir ...`; it records the widget names it saw, and
tests/nodes/test_workflow_layout.py fails when a node's widgets changed since.
"""

from __future__ import annotations

import json
from pathlib import Path

SIZES_FILE = Path(__file__).resolve().parent / "frontend" / "node_sizes.json"
#: LiteGraph.NODE_TITLE_HEIGHT: a node's title bar sits above its `pos`
TITLE = 30
#: room for a group's title bar (font size 24) above its first node's title
GROUP_TITLE = 44
GAP = 40  # between nodes of a stage, and between stages
PAD = 20  # between a group's border and its nodes
TOP = 40
#: image outputs get room to show their pictures (the frontend draws them inside the node)
MIN_SIZE = {"SaveImage": (320, 320), "PreviewImage": (320, 320), "Note": (420, 240)}
GROUP_COLORS = ["#3f789e", "#8A8", "#b06634", "#a1309b", "#88A"]


def frontend_sizes(path: Path = SIZES_FILE) -> dict[str, dict]:
    """{node type: {"size": [w, h], "widgets": [names]}} as measured in the frontend."""
    return json.loads(path.read_text())["nodes"]


def node_size(node_type: str, sizes: dict[str, dict]) -> tuple[int, int]:
    """The frontend's size for a new node of this type (rounded up), at least MIN_SIZE."""
    if node_type not in sizes:
        raise KeyError(f"{node_type} has no measured size in {SIZES_FILE.name}: run `python tools/comfy_test/"
                       "run.py --only sizes --comfyui-dir ...` to measure it in ComfyUI's frontend")
    w, h = sizes[node_type]["size"]
    low_w, low_h = MIN_SIZE.get(node_type, (0, 0))
    return max(int(-(-w // 10) * 10), low_w), max(int(-(-h // 10) * 10), low_h)


def place(stages: list[tuple[str, list[dict]]], sizes: dict[str, dict], left: int = 40
          ) -> tuple[dict[int, tuple[list[int], list[int]]], list[dict]]:
    """Columns of stages, left to right; nodes of a stage top to bottom.

    stages: [(group title, [node specs with "id" and "type"])]. Returns ({node id: (pos, size)}, groups).
    `pos` is the top-left of a node's body (its title bar is TITLE above it), as LiteGraph stores it.
    """
    placed, groups, x = {}, [], left
    for index, (title, nodes) in enumerate(stages):
        width = max(node_size(n["type"], sizes)[0] for n in nodes)
        y = TOP + GROUP_TITLE + TITLE
        for node in nodes:
            w, h = node_size(node["type"], sizes)
            placed[node["id"]] = ([x + PAD, y], [max(w, width), h])
            y += h + TITLE + GAP
        if title:
            groups.append({"id": len(groups) + 1, "title": title,
                           "bounding": [x, TOP, width + 2 * PAD, y - GAP - TITLE + PAD - TOP],
                           "color": GROUP_COLORS[index % len(GROUP_COLORS)], "font_size": 24, "flags": {}})
        x += width + 2 * PAD + GAP
    return placed, groups


def overlaps(rects: list[tuple[float, float, float, float]]) -> list[tuple[int, int]]:
    """Index pairs of (x, y, w, h) rectangles that overlap (touching edges do not count)."""
    found = []
    for i, (ax, ay, aw, ah) in enumerate(rects):
        for j, (bx, by, bw, bh) in enumerate(rects[i + 1:], start=i + 1):
            if ax < bx + bw and bx < ax + aw and ay < by + bh and by < ay + ah:
                found.append((i, j))
    return found
