"""Each shipped workflow opens readable on a 1920x1080 screen: its saved view (extra.ds) is at 0.8 zoom or
more (the frontend draws no text below 0.6), with every node and every group wholly on screen (the Note, the Train
node's live view and the results included) in the canvas of both frontends (workflows/layout.py `CANVAS`); group
steps are numbered without gaps."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from workflows.layout import MIN_SCALE, TITLE, on_screen

ROOT = Path(__file__).resolve().parents[2]
WORKFLOWS = sorted((ROOT / "example_workflows").glob("*.json"))


@pytest.mark.parametrize("path", WORKFLOWS, ids=lambda p: p.name)
def test_saved_view_is_readable_with_every_node_on_screen(path):
    graph = json.loads(path.read_text())
    ds = graph["extra"]["ds"]
    assert ds["scale"] >= MIN_SCALE >= 0.8
    off = [f"{node['type']} {node['id']}" for node in graph["nodes"]
           if not on_screen((node["pos"][0], node["pos"][1] - TITLE, node["size"][0], node["size"][1] + TITLE), ds)]
    off += [f"group {group['title']!r}" for group in graph["groups"] if not on_screen(group["bounding"], ds)]
    assert not off, f"{path.name}: off screen at {ds}: {off}"
    assert "QwenEditTrain" not in {n["type"] for n in graph["nodes"]}, "the deprecated full Train node"


@pytest.mark.parametrize("path", WORKFLOWS, ids=lambda p: p.name)
def test_group_steps_are_numbered_in_order(path):
    numbers = [int(m.group(1)) for g in json.loads(path.read_text())["groups"]
               if (m := re.match(r"(\d+)\. ", g["title"]))]
    assert numbers == list(range(1, len(numbers) + 1)), numbers
