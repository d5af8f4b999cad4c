"""The live training view in a real browser: ComfyUI's own frontend in headless Chromium loads the shipped
cached-training workflow, queues it, and the page's Train/Status nodes must show the job's progress and loss
curve updating (read from the page's DOM), then a validation image; a screenshot is kept."""

from __future__ import annotations

import json
import logging
from pathlib import Path

from browser import Browser
from comfy import TRAIN_WORKFLOW, ComfyServer, poll
from convert import widget_names

log = logging.getLogger("comfy_test")
#: node types that live only in the frontend (the workflows' Note)
FRONTEND_ONLY = ("Note", "MarkdownNote")

VIEWS = """JSON.stringify([...document.querySelectorAll('.qwen-edit-live')].map(e => ({
  job: e.dataset.job, state: e.dataset.state, step: +e.dataset.step, points: +e.dataset.points,
  text: e.querySelector('.qwen-edit-live-text').textContent,
  image: e.querySelector('.qwen-edit-live-validation').naturalWidth || 0})))"""


def _views(browser: Browser) -> list[dict]:
    return [v for v in json.loads(browser.evaluate(VIEWS)) if v["job"] == "browser_lora"]


def _load_and_queue(browser: Browser, workflow: dict) -> None:
    browser.evaluate(f"""(async () => {{
      await app.loadGraphData({json.dumps(workflow)}, true, false, null,
                              {{showMissingNodesDialog: false, showMissingModelsDialog: false}});
      const train = app.graph._nodes.find(n => n.type === 'QwenEditTrainLoRA');
      const set = (name, value) => {{ train.widgets.find(w => w.name === name).value = value; }};
      set('lora_name', 'browser_lora'); set('steps', 400); set('validation_every', 10);
      const nodes = app.graph._nodes, x0 = Math.min(...nodes.map(n => n.pos[0])) - 40;
      const y0 = Math.min(...nodes.map(n => n.pos[1])) - 60;
      const x1 = Math.max(...nodes.map(n => n.pos[0] + n.size[0])) + 40;
      const y1 = Math.max(...nodes.map(n => n.pos[1] + n.size[1])) + 260;  // room for the live views
      const el = app.canvas.canvas, scale = Math.min(1, (el.clientWidth - 80) / (x1 - x0), (el.clientHeight - 80) / (y1 - y0));
      app.canvas.ds.scale = scale; app.canvas.ds.offset = [60 / scale - x0, 60 / scale - y0];
      app.graph.setDirtyCanvas(true, true);
      await app.queuePrompt(0);
      return true;
    }})()""")


def _widget_counts(browser: Browser, server: ComfyServer) -> None:
    """The view is not saved into the workflow: widget values per node stay what the schema says."""
    info = server.get("/object_info")
    saved = json.loads(browser.evaluate("JSON.stringify(app.graph.serialize().nodes.map(n => "
                                        "[n.type, (n.widgets_values || []).length]))"))
    for node_type, count in saved:
        if node_type in FRONTEND_ONLY:
            continue  # never sent to the server, so /object_info has no schema for it
        expected = sum(2 if control else 1 for _, control in widget_names(info[node_type]))
        assert count == expected, f"{node_type}: {count} saved widget values, the schema has {expected}"


def check_browser(args) -> list[str]:
    with ComfyServer(args.comfyui_dir, args.python, log_dir=args.out) as server:
        browser = Browser(args.chromium)
        try:
            server.post("/settings/Comfy.TutorialCompleted", True)  # no first-run template dialog
            browser.open_comfy(server.url)
            browser.evaluate("document.querySelectorAll('.p-dialog-close-button').forEach(b => b.click())")
            _load_and_queue(browser, json.loads(TRAIN_WORKFLOW.read_text()))
            first = poll(lambda: [v for v in _views(browser) if v["state"] == "training" and v["points"] >= 2],
                         600, "the live view to show training steps")[0]
            later = poll(lambda: [v for v in _views(browser) if v["step"] >= first["step"] + 5
                                  and v["points"] > first["points"]], 600, "the live view to update")[0]
            browser.screenshot(Path(args.out) / "live_training_view_running.png")
            views = poll(lambda: (lambda vs: vs if len(vs) >= 2 and all(v["image"] for v in vs) else None)(
                _views(browser)), 600, "a validation image on the Train and Status nodes")
            assert all("loss" in v["text"] for v in views), views
            _widget_counts(browser, server)
            shot = Path(args.out) / "live_training_view.png"
            browser.screenshot(shot)
            server.post("/qwen_edit/jobs/browser_lora/stop")
            server.job_where("browser_lora", lambda j: j["finished"], 300, "stopping")
            ours = [e for e in browser.errors if "qwen_edit_jobs.js" in str(e)]
            assert not ours, ours
        finally:
            browser.close()
    return [f"live view on {len(views)} nodes: '{first['text']}' -> '{later['text']}' "
            f"({first['points']} -> {later['points']} loss points), validation image shown; screenshots {shot} and live_training_view_running.png"]
