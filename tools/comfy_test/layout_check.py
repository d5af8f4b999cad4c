"""The shipped workflows as a person sees them: node sizes measured in ComfyUI's own frontend (`--only sizes`
writes workflows/frontend/node_sizes.json for the workflow builder), and every shipped workflow loaded
in headless Chromium with no two node rectangles (title bar included) overlapping, no node smaller than the
frontend makes it, every node inside its stage's group, and no group overlapping another."""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path

from browser import Browser
from comfy import PACK, ComfyServer, poll

log = logging.getLogger("comfy_test")
BUILTIN_TYPES = ("SaveImage", "PreviewImage", "Note", "SolidMask", "MaskComposite", "ImageInvert",
                 "ImageCompositeMasked")
READY = "!!(window.app && window.app.graph && window.app.canvas && window.LiteGraph)"

#: the size a new node takes: createNode's size, grown to computeSize() (which counts DOM widgets such as the
#: live training view; the frontend grows a loaded node to it, so a layout from the smaller size overlaps)
FRESH = """const freshSize = n => { const c = n.computeSize();
  return [Math.max(n.size[0], c[0]), Math.max(n.size[1], c[1])]; };"""
MEASURE = "(() => {" + FRESH + """ return JSON.stringify(Object.fromEntries(%s.map(t => {
  const n = LiteGraph.createNode(t);
  return [t, {size: freshSize(n), widgets: (n.widgets || []).filter(w => w.serialize !== false).map(w => w.name)}];
})));})()"""

RECTS = """(async () => {
  """ + FRESH + """
  await app.loadGraphData(%s, true, false, null, {showMissingNodesDialog: false, showMissingModelsDialog: false});
  app.canvas.draw(true, true);  // node bounding rectangles are computed when drawn
  const nodes = app.graph._nodes.map(n => { const fresh = LiteGraph.createNode(n.type);
    return {id: n.id, type: n.type, rect: Array.from(n.getBounding()), size: [n.size[0], n.size[1]],
            fresh: freshSize(fresh)}; });
  const groups = app.graph._groups.map(g => ({title: g.title, rect: Array.from(g._bounding || g.bounding)}));
  return JSON.stringify({nodes, groups});
})()"""


def _open(browser: Browser, server: ComfyServer) -> None:
    browser.call("Page.navigate", {"url": server.url + "/"})
    poll(lambda: browser._safe(READY), 180, "the ComfyUI frontend to load")
    browser.errors.clear()  # the page's own start-up; loading the workflows must add none
    browser.evaluate("document.querySelectorAll('.p-dialog .p-dialog-close-button, .p-dialog "
                     "[aria-label=Close]').forEach(b => b.click()); true")  # the first-visit template picker


def measure_sizes(args) -> list[str]:
    """Write workflows/frontend/node_sizes.json: the size of each node type as the frontend creates it."""
    sys.path.insert(0, str(PACK))
    from nodes import NODE_CLASS_MAPPINGS
    types = sorted(NODE_CLASS_MAPPINGS) + list(BUILTIN_TYPES)
    with ComfyServer(args.comfyui_dir, args.python, log_dir=args.out) as server:
        browser = Browser(args.chromium)
        try:
            _open(browser, server)
            measured = json.loads(browser.evaluate(MEASURE % json.dumps(types)))
            version = server.get("/system_stats")["system"].get("comfyui_version", "?")
        finally:
            browser.close()
    path = PACK / "workflows" / "frontend" / "node_sizes.json"
    lines = [f"  {json.dumps(t)}: {json.dumps({'size': [round(v, 1) for v in m['size']], 'widgets': m['widgets']})}"
             for t, m in sorted(measured.items())]
    path.write_text("{\n" + f' "measured_with": "ComfyUI {version}, LiteGraph.createNode(type).size",\n'
                    + ' "nodes": {\n' + ",\n".join(lines) + "\n }\n}\n")
    return [f"{len(measured)} node sizes written to {path} (regenerate the workflows with "
            "workflows/build_workflows.py)"]


def _inside(inner, outer) -> bool:
    return (outer[0] <= inner[0] and outer[1] <= inner[1] and inner[0] + inner[2] <= outer[0] + outer[2]
            and inner[1] + inner[3] <= outer[1] + outer[3])


def check_layout(args) -> list[str]:
    """Each shipped workflow in the real frontend: no overlaps, no squeezed node, nodes inside their groups."""
    sys.path.insert(0, str(PACK))
    from workflows.layout import overlaps
    results = []
    with ComfyServer(args.comfyui_dir, args.python, log_dir=args.out) as server:
        browser = Browser(args.chromium)
        try:
            _open(browser, server)
            for path in sorted((PACK / "example_workflows").glob("*.json")):
                page = json.loads(browser.evaluate(RECTS % path.read_text()))
                nodes, groups = page["nodes"], page["groups"]
                clashes = [(nodes[i]["type"], nodes[j]["type"])
                           for i, j in overlaps([n["rect"] for n in nodes])]
                assert not clashes, f"{path.name}: overlapping nodes {clashes}"
                squeezed = [n["type"] for n in nodes if n["size"][0] < n["fresh"][0] - 0.5
                            or n["size"][1] < n["fresh"][1] - 0.5]
                assert not squeezed, f"{path.name}: smaller than the frontend makes them: {squeezed}"
                assert not overlaps([g["rect"] for g in groups]), f"{path.name}: groups overlap"
                loose = [n["type"] for n in nodes if n["type"] != "Note"
                         and not any(_inside(n["rect"], g["rect"]) for g in groups)]
                assert not loose, f"{path.name}: nodes outside every group: {loose}"
                assert any(n["type"] == "Note" for n in nodes), f"{path.name}: no Note"
                browser.evaluate("app.canvas.ds.scale = 0.62; app.canvas.ds.offset = [10, 10]; "
                                 "app.canvas.draw(true, true); true")
                shot = Path(args.out) / f"layout_{path.stem}.png"
                browser.screenshot(shot)
                results.append(f"{path.name}: {len(nodes)} nodes, {len(groups)} groups, no overlap ({shot.name})")
                log.info(results[-1])
            assert not browser.errors, browser.errors
        finally:
            browser.close()
    return results
