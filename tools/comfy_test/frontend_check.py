"""The live view and the labelled text boxes in ComfyUI's frontend beyond the plain canvas: a job's progress
reaches Train LoRA and Training Status moved into a subgraph, and with the opt-in Vue node renderer
(`Comfy.VueNodes.Enabled`) the live view is on screen and updates. A job's progress is fed to the page's
extension directly (its `window.qwenEditLive.jobs`, as the websocket event fills it), so no training runs."""

from __future__ import annotations

import contextlib
import json
import logging
from pathlib import Path

from browser import Browser
from comfy import TRAIN_WORKFLOW, ComfyServer

log = logging.getLogger("comfy_test")
JOB = "frontend_check"

LOAD = """(async () => {
  const wf = %s;
  for (const n of wf.nodes) if (n.type === 'QwenEditTrainLoRA') n.widgets_values[0] = '%s';
  await app.loadGraphData(wf, true, true, null, {showMissingNodesDialog: false, showMissingModelsDialog: false});
  await new Promise(r => requestAnimationFrame(() => requestAnimationFrame(r)));
  return true;
})()"""

#: a running job's entry, as GET /qwen_edit/jobs and the "qwen_edit.job" event give it, then every view redrawn
FEED = """(() => {
  window.qwenEditLive.jobs.set('%s', {entry: {name: '%s', state: 'training', step: 7, total: 20, loss: 0.125},
                                       history: [[5, 0.3], [6, 0.2], [7, 0.125]]});
  window.qwenEditLive.renderAll();
  return true;
})()"""

#: the views of the nodes inside the root graph's subgraphs (not drawn: their state is read off the nodes)
SUBGRAPH = """(() => {
  const root = app.graph.rootGraph ?? app.graph;
  const train = root._nodes.filter(n => ['QwenEditTrainLoRA', 'QwenEditTrainOptions', 'QwenEditTrainStatus']
                                        .includes(n.type));
  root.convertToSubgraph(new Set(train));
  const inside = [...root.subgraphs.values()].flatMap(g => g._nodes ?? g.nodes)
    .filter(n => n.__qwenEditLive).map(n => ({type: n.type, step: n.__qwenEditLive.root.dataset.step,
                                               text: n.__qwenEditLive.text.textContent}));
  return JSON.stringify({inside, outside: root._nodes.filter(n => n.__qwenEditLive).length});
})()"""

#: the live views and labelled text boxes the page shows
SHOWN = """JSON.stringify({
  views: [...document.querySelectorAll('.qwen-edit-live')].map(e => { const r = e.getBoundingClientRect();
    return {job: e.dataset.job, step: e.dataset.step, w: r.width, h: r.height,
            text: e.querySelector('.qwen-edit-live-text').textContent}; }),
  labels: [...document.querySelectorAll('textarea[data-qwen-edit-label]')].filter(t => t.offsetParent)
    .map(t => t.dataset.qwenEditLabel)})"""


#: whether the page shows the stock Note's text box (a DOM widget) on screen
STOCK_DOM = """JSON.stringify(app.graph._nodes.some(n => n.type === 'Note' && (n.widgets || []).some(w => {
  const el = w.inputEl ?? w.element; return el && el.isConnected && el.getBoundingClientRect().width > 0; })) ||
  [...document.querySelectorAll('textarea')].some(t => t.value.startsWith('Trains')))"""


@contextlib.contextmanager
def _session(args, vue: bool):
    """A fresh server and page (with the Vue node renderer setting on or off), the training workflow loaded;
    on leaving, the pack's script must have raised no error, and both are closed."""
    server = ComfyServer(args.comfyui_dir, args.python, log_dir=args.out).start()
    server.post("/settings/Comfy.TutorialCompleted", True)
    if vue:
        server.post("/settings/Comfy.VueNodes.Enabled", True)
    browser = Browser(args.chromium, size=(1920, 1080))
    browser.call("Emulation.setDeviceMetricsOverride", {"width": 1920, "height": 1080, "deviceScaleFactor": 1,
                                                        "mobile": False})
    browser.open_comfy(server.url)
    browser.evaluate("document.querySelectorAll('.p-dialog .p-dialog-close-button, .p-dialog "
                     "[aria-label=Close]').forEach(b => b.click()); true")
    browser.evaluate(LOAD % (TRAIN_WORKFLOW.read_text(), JOB))
    try:
        yield browser
        ours = [e for e in browser.errors if "qwen_edit_jobs.js" in str(e)]
        assert not ours, ours
    finally:
        browser.close()
        server.stop()


def _subgraph(args) -> str:
    with _session(args, vue=False) as browser:
        before = json.loads(browser.evaluate(SHOWN))
        assert {"validation prompt"} <= set(before["labels"]), before["labels"]
        moved = json.loads(browser.evaluate(SUBGRAPH))
        browser.evaluate(FEED % (JOB, JOB))
        inside = json.loads(browser.evaluate(SUBGRAPH.replace("root.convertToSubgraph(new Set(train));", "")))
        assert len(moved["inside"]) >= 2 and moved["outside"] == 0, moved
        assert all(v["step"] == "7" and "step 7/20" in v["text"] for v in inside["inside"]), inside
    return (f"subgraph: {len(inside['inside'])} live views inside a subgraph updated ('{inside['inside'][0]['text']}'); "
            f"text boxes labelled on the canvas: {sorted(set(before['labels']))}")


def _vue(args) -> str:
    with _session(args, vue=True) as browser:
        browser.evaluate(FEED % (JOB, JOB))
        shown = json.loads(browser.evaluate(SHOWN))
        views = [v for v in shown["views"] if v["job"] == JOB]
        version = browser.evaluate("window.__COMFYUI_FRONTEND_VERSION__ ?? '?'")
        if not views and not json.loads(browser.evaluate(STOCK_DOM)):
            return (f"Vue node renderer: frontend {version} draws no DOM widget in Vue nodes, not even the stock "
                    "Note's text (an early version of the renderer); run with --front-end-root of a newer "
                    "comfyui-frontend-package to check it")
        assert len(views) >= 2 and all(v["w"] > 100 and v["h"] > 50 for v in views), shown
        assert all(v["step"] == "7" and "step 7/20" in v["text"] for v in views), views
        shot = Path(args.out) / "vue_nodes_live_view.png"
        browser.screenshot(shot)
    return (f"Vue node renderer (frontend {version}): {len(views)} live views on screen and updated "
            f"('{views[0]['text']}'); {shot.name}")


def check_frontend(args) -> list[str]:
    """Subgraphs and the Vue node renderer (module docstring)."""
    results = [_subgraph(args), _vue(args)]
    for line in results:
        log.info(line)
    return results
