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
MIN_SIZE = {"SaveImage": (280, 280), "PreviewImage": (280, 280), "Note": (420, 240)}
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


def _size(node: dict, sizes: dict[str, dict]) -> tuple[int, int]:
    """A node's size: the frontend's, or the spec's "min_size" where larger (a Note sized to its text)."""
    w, h = node_size(node["type"], sizes)
    low_w, low_h = node.get("min_size", (0, 0))
    return max(w, low_w), max(h, low_h)


def note_size(text: str, width: int = 460) -> tuple[int, int]:
    """Room for a Note's text without scrolling: the frontend's textarea (14 px sans-serif) takes about 7 px
    per character and 17 px per line at 100% zoom; 20 px of padding; the browser check shows no overflow."""
    per_line = (width - 20) // 7
    lines = sum(max(1, -(-len(paragraph) // per_line)) for paragraph in text.split("\n"))
    return width, lines * 17 + 30


def place(stages: list, sizes: dict[str, dict], left: int = 40
          ) -> tuple[dict[int, tuple[list[int], list[int]]], list[dict]]:
    """Columns of stages, left to right; nodes of a stage top to bottom.

    stages: [(group title, [node specs with "id" and "type"])]; an entry that is a list of such stages puts
    them in one column, one group under the other (a short graph fits a screen at a readable zoom).
    Returns ({node id: (pos, size)}, groups). `pos` is the top-left of a node's body (its title bar is TITLE
    above it), as LiteGraph stores it.
    """
    placed, groups, x = {}, [], left
    for index, column in enumerate(stages):
        column = column if isinstance(column, list) else [column]
        width = max(_size(n, sizes)[0] for _, nodes in column for n in nodes)
        top = TOP
        for title, nodes in column:
            y = top + GROUP_TITLE + TITLE
            for node in nodes:
                w, h = _size(node, sizes)
                placed[node["id"]] = ([x + PAD, y], [max(w, width), h])
                y += h + TITLE + GAP
            bottom = y - GAP - TITLE + PAD
            if title:
                groups.append({"id": len(groups) + 1, "title": title, "bounding": [x, top, width + 2 * PAD,
                                                                                  bottom - top],
                               "color": GROUP_COLORS[(index + len(groups)) % len(GROUP_COLORS)], "font_size": 24,
                               "flags": {}})
            top = bottom + GAP
        x += width + 2 * PAD + GAP
    return placed, groups


def stage_height(nodes: list, sizes: dict[str, dict]) -> int:
    """The height `place` gives a stage's group: its title, then each node under its title bar, then padding."""
    return GROUP_TITLE + PAD - GAP + sum(_size(n, sizes)[1] + TITLE + GAP for n in nodes)


def stack_columns(stages: list, sizes: dict[str, dict], height: float) -> list:
    """`stages` ([(title, nodes)], in the order of the steps) as `place`'s columns: each stage under the one before
    while the column stays within `height` canvas units, else at the top of the next column, so a graph of many
    stages is as wide as it must be and every node fits the saved view (links still point right or down)."""
    columns, used = [], height
    for stage in stages:
        need = stage_height(stage[1], sizes)
        if columns and used + GAP + need <= height:
            columns[-1].append(stage)
            used += GAP + need
        else:
            columns.append([stage])
            used = need
    return columns


#: the screen a shipped workflow is opened on, and the part of the frontend's canvas element that its menus leave
#: to the graph, in the canvas element's pixels (what the saved view maps the graph to) under both frontends:
#: 1.27.10 (ComfyUI 0.3.64's) puts a 1856x1002 canvas right of its 64 px side bar and below its 78 px menus,
#: 1.58.1 spans the screen with menus floating over its left 60 and top 50 px (tools/comfy_test/view_check.py)
SCREEN = (1920, 1080)
CANVAS = (60, 50, 1856, 1002)  # left, top, right, bottom
#: below 0.6 the frontend draws no text (LiteGraph's low-quality threshold); 0.8 keeps 14 px text legible
MIN_SCALE, MAX_SCALE = 0.8, 1.0
#: the graph height the saved view shows at MIN_SCALE (less 2 units for the view's rounding)
COLUMN_HEIGHT = (CANVAS[3] - CANVAS[1]) / MIN_SCALE - 2


def view(rects: list[tuple[float, float, float, float]]) -> dict:
    """The saved view (`extra.ds`) that shows the graph's (x, y, w, h) rectangles from their top-left corner,
    as large as fits the canvas, between MIN_SCALE and MAX_SCALE (at MIN_SCALE a wide graph's right end may
    lie beyond the screen's edge)."""
    x0, y0 = min(r[0] for r in rects), min(r[1] for r in rects)
    x1, y1 = max(r[0] + r[2] for r in rects), max(r[1] + r[3] for r in rects)
    fit = min((CANVAS[2] - CANVAS[0]) / (x1 - x0), (CANVAS[3] - CANVAS[1]) / (y1 - y0))
    scale = round(min(MAX_SCALE, max(MIN_SCALE, fit)), 3)
    return {"scale": scale, "offset": [round(CANVAS[0] / scale - x0, 1), round(CANVAS[1] / scale - y0, 1)]}


def on_screen(rect: tuple[float, float, float, float], ds: dict) -> bool:
    """Whether a canvas rectangle lies wholly inside the canvas part of the screen under view `ds`."""
    (ox, oy), s = ds["offset"], ds["scale"]
    left, top = (rect[0] + ox) * s, (rect[1] + oy) * s
    return (CANVAS[0] - 1 <= left and CANVAS[1] - 1 <= top and left + rect[2] * s <= CANVAS[2] + 1
            and top + rect[3] * s <= CANVAS[3] + 1)


def overlaps(rects: list[tuple[float, float, float, float]]) -> list[tuple[int, int]]:
    """Index pairs of (x, y, w, h) rectangles that overlap (touching edges do not count)."""
    found = []
    for i, (ax, ay, aw, ah) in enumerate(rects):
        for j, (bx, by, bw, bh) in enumerate(rects[i + 1:], start=i + 1):
            if ax < bx + bw and bx < ax + aw and ay < by + bh and by < ay + ah:
                found.append((i, j))
    return found
