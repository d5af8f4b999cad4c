"""The README's picture of the first workflow (`--only first_workflow`): ComfyUI's own frontend in headless
Chromium opens example_workflows/qwen_edit_train_then_sample.json as shipped and saves the page as
`first_workflow_loaded.png` in --out (copied to docs/first_workflow.png), then queues it, waits until it has
run (the LoRA trained, the Training Status node's live view holding its loss curve, the edited picture
saved) and saves `first_workflow.png`."""

from __future__ import annotations

import json
import logging
from pathlib import Path

from browser import Browser
from comfy import PACK, ComfyServer, poll

log = logging.getLogger("comfy_test")
FIRST_WORKFLOW = PACK / "example_workflows" / "qwen_edit_train_then_sample.json"

#: load the workflow, fit every node on the page, hide the minimap
LOAD_FIT = """(async () => {
  await app.loadGraphData(%s, true, false, null, {showMissingNodesDialog: false, showMissingModelsDialog: false});
  try { await app.extensionManager.setting.set('Comfy.Minimap.Visible', false); } catch (e) { /* older frontends: no minimap setting */ }
  const nodes = app.graph._nodes, x0 = Math.min(...nodes.map(n => n.pos[0])) - 30;
  const y0 = Math.min(...nodes.map(n => n.pos[1])) - 60;
  const x1 = Math.max(...nodes.map(n => n.pos[0] + n.size[0])) + 30;
  const y1 = Math.max(...nodes.map(n => n.pos[1] + n.size[1])) + 30;
  const el = app.canvas.canvas, scale = Math.min(1, (el.clientWidth - 120) / (x1 - x0), (el.clientHeight - 60) / (y1 - y0));
  app.canvas.ds.scale = scale; app.canvas.ds.offset = [90 / scale - x0, 50 / scale - y0];
  app.graph.setDirtyCanvas(true, true);
  return true;
})()"""
LIVE = "[...document.querySelectorAll('.qwen-edit-live')].some(e => +e.dataset.points >= 2)"


def _finished(server: ComfyServer) -> bool:
    """The queued prompt ran to the end (ComfyUI's /history holds it with a success status)."""
    history = server.get("/history")
    return any(item.get("status", {}).get("status_str") == "success" for item in history.values())


def first_workflow_shot(args) -> list[str]:
    with ComfyServer(args.comfyui_dir, args.python, log_dir=args.out) as server:
        browser = Browser(args.chromium, size=(1900, 1400))  # the whole graph at a zoom (>= 0.6) that draws text
        try:
            server.post("/settings/Comfy.TutorialCompleted", True)  # no first-run template dialog
            browser.open_comfy(server.url)
            browser.evaluate("document.querySelectorAll('.p-dialog-close-button').forEach(b => b.click())")
            browser.evaluate(LOAD_FIT % json.dumps(json.loads(FIRST_WORKFLOW.read_text())))
            browser.evaluate("new Promise(r => setTimeout(() => r(true), 3000))")
            loaded = Path(args.out) / "first_workflow_loaded.png"
            browser.screenshot(loaded)  # the workflow as it opens (the README's picture)
            if not getattr(args, "queue", True):
                return [f"{FIRST_WORKFLOW.name} opened in the frontend; screenshot {loaded}"]
            browser.evaluate("app.queuePrompt(0).then(() => true)")
            poll(lambda: _finished(server), 1800, "the workflow to finish", every=2)
            poll(lambda: browser._safe(LIVE), 60, "the loss curve on the page")
            browser.evaluate("app.graph.setDirtyCanvas(true, true); new Promise(r => setTimeout(() => r(true), 5000))")
            shot = Path(args.out) / "first_workflow.png"
            browser.screenshot(shot)
        finally:
            browser.close()
    return [f"{FIRST_WORKFLOW.name} ran in the frontend; screenshot {shot}"]
