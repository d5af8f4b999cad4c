"""Every shipped workflow as it opens on a 1920x1080 screen in ComfyUI's frontend (headless Chromium): its
saved view (extra.ds) is restored at 0.8 zoom or more, above LiteGraph's low-quality threshold (below it no
text is drawn), with every node wholly inside the canvas. Saves a screenshot of each (view_<name>.png)."""

from __future__ import annotations

import json
import logging
from pathlib import Path

from browser import Browser
from comfy import PACK, ComfyServer
from layout_check import _open

log = logging.getLogger("comfy_test")
SCREEN = (1920, 1080)

OPEN = """(async () => {
  await app.loadGraphData(%s, true, true, null, {showMissingNodesDialog: false, showMissingModelsDialog: false});
  await new Promise(r => requestAnimationFrame(() => requestAnimationFrame(r)));
  app.canvas.draw(true, true);
  const c = app.canvas, ds = c.ds, box = c.canvas.getBoundingClientRect();
  const threshold = c.low_quality_zoom_threshold ?? 0.6;
  const nodes = app.graph._nodes.map(n => {
    const b = n.getBounding();
    return {type: `${n.type} ${n.id}`, screen: [box.left + (b[0] + ds.offset[0]) * ds.scale,
      box.top + (b[1] + ds.offset[1]) * ds.scale, b[2] * ds.scale, b[3] * ds.scale]}; });
  return JSON.stringify({scale: ds.scale, threshold, low: !!c.low_quality, nodes,
                         canvas: [box.left, box.top, box.width, box.height]});
})()"""


def _inside(rect, outer) -> bool:
    """Whether screen rectangle `rect` (x, y, w, h) lies within `outer`, to a pixel."""
    return (outer[0] - 1 <= rect[0] and outer[1] - 1 <= rect[1] and rect[0] + rect[2] <= outer[0] + outer[2] + 1
            and rect[1] + rect[3] <= outer[1] + outer[3] + 1)


def check_view(args) -> list[str]:
    """Open each shipped workflow at 1920x1080 and check what is drawn readable (module docstring)."""
    results, failed = [], []
    with ComfyServer(args.comfyui_dir, args.python, log_dir=args.out) as server:
        browser = Browser(args.chromium, size=SCREEN)
        try:
            # the page itself 1920x1080 (a headless window's size includes its frame)
            browser.call("Emulation.setDeviceMetricsOverride", {"width": SCREEN[0], "height": SCREEN[1],
                                                                "deviceScaleFactor": 1, "mobile": False})
            _open(browser, server)
            for path in sorted((PACK / "example_workflows").glob("*.json")):
                page = json.loads(browser.evaluate(OPEN % path.read_text()))
                assert page["scale"] >= 0.8 and page["scale"] > page["threshold"] and not page["low"], \
                    f"{path.name}: opens at zoom {page['scale']:.2f} (low-quality threshold {page['threshold']})"
                off = [n["type"] for n in page["nodes"] if not _inside(n["screen"], page["canvas"])]
                if off:  # every workflow is checked, then all that failed are reported
                    failed.append(f"{path.name}: not wholly on screen at 1920x1080: {off}")
                    continue
                shot = Path(args.out) / f"view_{path.stem}.png"
                browser.screenshot(shot)
                results.append(f"{path.name}: opens at zoom {page['scale']:.2f} (threshold {page['threshold']}), "
                               f"all {len(page['nodes'])} nodes on screen ({shot.name})")
                log.info(results[-1])
        finally:
            browser.close()
    assert not failed, "\n".join(failed)
    return results
