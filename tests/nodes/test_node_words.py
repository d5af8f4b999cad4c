"""What the nodes tell a ComfyUI user, in the graph's words, and what the live view shows: too many control
images name the inputs and the models that take them (not the command line's variants); a retrained name shows
no picture of its previous run; the Vue node renderer that never mounts the view's DOM widget shows it in the
node's body."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

import nodes
from nodes.common import TINY_MODEL

ROOT = Path(__file__).resolve().parents[2]


def test_two_images_on_a_one_image_model_say_what_to_connect_and_load(tmp_path, monkeypatch):
    monkeypatch.setenv("QWEN_EDIT_HOME", str(tmp_path))
    with torch.inference_mode():
        (model,) = nodes.QwenEditModelLoader().load(TINY_MODEL, "cpu", "cpu", "cpu", "float32")
    image = torch.rand(1, 64, 64, 3)
    with pytest.raises(ValueError) as refused:
        nodes.QwenEditEncodePrompt().encode(model, image, "x", "", 64, 64, 64, image2=image)
    words = str(refused.value)
    assert "disconnect image2" in words and "Load Model" in words and "variant" not in words


#: the live view's script run by Node with the frontend's app and api stubbed: one Train node, then job events
LIVE_VIEW = """
import { app, api, events } from "./scripts/app.js";
const el = () => ({ style: {}, dataset: {}, append() {}, getContext: () => new Proxy({}, { get: () => () => {} }),
                    removeAttribute(name) { delete this[name]; } });
globalThis.document = { createElement: el };
globalThis.window = {};
globalThis.HTMLTextAreaElement = class {};
globalThis.MutationObserver = class { observe() {} };
await import("./extensions/pack/qwen_edit_jobs.js");
const node = { comfyClass: "QwenEditTrainLoRA", widgets: [{ name: "lora_name", value: "same_name" }],
               addDOMWidget: (name, type, root) => ({}) };
app.graph._nodes.push(node);
await app.extension.setup();
await app.extension.nodeCreated(node);
const seen = [];
for (const entry of JSON.parse(process.argv[2])) {
  events["qwen_edit.job"]({ detail: entry });
  const img = node.__qwenEditLive.img;
  seen.push([img.src ?? null, img.style.display ?? null, node.__qwenEditLive.text.textContent]);
}
console.log(JSON.stringify(seen));
"""

STUBS = """
export const events = {};
export const app = { graph: { _nodes: [] }, registerExtension(ext) { app.extension = ext; } };
export const api = { addEventListener(name, fn) { events[name] = fn; }, apiURL: (u) => "http://x" + u,
                     fetchApi: async () => ({ ok: false }) };
"""


@pytest.mark.skipif(shutil.which("node") is None, reason="needs Node.js to run the live view's script")
def test_a_retrained_name_shows_no_picture_of_its_previous_run_and_a_failure_says_why(tmp_path):
    (tmp_path / "scripts").mkdir()
    (tmp_path / "scripts" / "app.js").write_text(STUBS)
    (tmp_path / "extensions" / "pack").mkdir(parents=True)
    shutil.copy(ROOT / "web" / "qwen_edit_jobs.js", tmp_path / "extensions" / "pack")
    (tmp_path / "scripts" / "api.js").write_text('export { api } from "./app.js";\n')
    (tmp_path / "run.mjs").write_text(LIVE_VIEW)
    base = {"name": "same_name", "total": 10, "loss": 0.5, "outcome": ""}
    runs = [{**base, "state": "training", "step": 5, "point": [5, 0.5], "validation_url": "/v?step=5"},
            {**base, "state": "training", "step": 1, "point": [1, 0.5], "validation_url": None},  # retrained
            {**base, "state": "failed", "step": 2, "point": None, "validation_url": None,
             "outcome": "failed: NotImplementedError: Cannot copy out of meta tensor; no data!"}]
    out = subprocess.run(["node", str(tmp_path / "run.mjs"), json.dumps(runs)], capture_output=True, text=True,
                         cwd=tmp_path, check=True).stdout
    first, retrained, failed = json.loads(out)
    assert first[:2] == ["http://x/v?step=5", "block"]
    assert retrained[:2] == [None, "none"], "the previous run's validation picture is still shown"
    assert "Cannot copy out of meta tensor" in failed[2]


#: the live view's script under frontend 1.27's Vue node renderer: each node an element [data-node-id] with a body,
#: a DOM widget of a type it does not know never mounted; node 4 in the graph on screen, node 7 in another graph
VUE_NODES = """
import { app, api, events } from "./scripts/app.js";
const el = (tag) => ({ tag, style: {}, dataset: {}, children: [], isConnected: false, className: "",
  append(...kids) { for (const k of kids) { k.isConnected = this.isConnected; this.children.push(k); } },
  getContext: () => new Proxy({}, { get: () => () => {} }), removeAttribute(name) { delete this[name]; } });
const bodies = {};
for (const id of ["4", "7"]) {
  const body = bodies[id] = el("div");
  body.isConnected = true;
  bodies[id].node = { querySelector: (q) => q === `[data-testid="node-body-${id}"]` ? body : null };
}
let observed = null;
globalThis.document = { createElement: el, body: {},
  querySelector: (q) => (bodies[(q.match(/^\\[data-node-id="(\\d+)"\\]$/) ?? [])[1]] ?? {}).node ?? null };
globalThis.window = {};
globalThis.CSS = { escape: (v) => v };
globalThis.HTMLTextAreaElement = class {};
globalThis.MutationObserver = class { constructor(fn) { observed = fn; } observe() {} };
globalThis.requestAnimationFrame = (fn) => fn();
await import("./extensions/pack/qwen_edit_jobs.js");
const shown = { _nodes: [] }, other = { _nodes: [] };
const make = (id, graph) => ({ id: Number(id), graph, comfyClass: "QwenEditTrainLoRA",
  widgets: [{ name: "lora_name", value: "vue_job" }], addDOMWidget: () => ({}) });
const node = make("4", shown), elsewhere = make("7", other);
app.graph = shown; app.canvas = { graph: shown };
shown._nodes.push(node); shown.subgraphs = new Map([["s", other]]); other._nodes.push(elsewhere);
await app.extension.setup();
await app.extension.nodeCreated(node);
await app.extension.nodeCreated(elsewhere);
observed?.([]);  // the renderer mounted its node elements
events["qwen_edit.job"]({ detail: { name: "vue_job", state: "training", step: 3, total: 9, loss: 0.25,
                                    point: [3, 0.25] } });
console.log(JSON.stringify({ mounted: bodies["4"].children.map((c) => c.className),
  connected: node.__qwenEditLive.root.isConnected, text: node.__qwenEditLive.text.textContent,
  elsewhere: bodies["7"].children.length }));
"""


@pytest.mark.skipif(shutil.which("node") is None, reason="needs Node.js to run the live view's script")
def test_the_vue_node_renderer_that_never_mounts_the_views_widget_shows_it_in_the_nodes_body(tmp_path):
    (tmp_path / "scripts").mkdir()
    (tmp_path / "scripts" / "app.js").write_text(STUBS)
    (tmp_path / "extensions" / "pack").mkdir(parents=True)
    shutil.copy(ROOT / "web" / "qwen_edit_jobs.js", tmp_path / "extensions" / "pack")
    (tmp_path / "scripts" / "api.js").write_text('export { api } from "./app.js";\n')
    (tmp_path / "run.mjs").write_text(VUE_NODES)
    out = subprocess.run(["node", str(tmp_path / "run.mjs")], capture_output=True, text=True, cwd=tmp_path,
                         check=True).stdout
    shown = json.loads(out)
    assert shown["mounted"] == ["qwen-edit-live"] and shown["connected"], shown
    assert "step 3/9" in shown["text"], shown
    assert shown["elsewhere"] == 0, "a node of a graph not on screen took the view of the node with its id"


def test_fresh_nodes_size_pictures_for_their_model_the_default_toy_at_128(tmp_path, monkeypatch):
    from nodes.common import TINY_21_MODEL, TOY_21_MODEL, TOY_MODEL, ModelHandle, resolve_model, side_of
    from qwen_edit_core.model.components import Components
    monkeypatch.setenv("QWEN_EDIT_HOME", str(tmp_path))
    for node, name in ((nodes.QwenEditSampler, "vae_side"), (nodes.QwenEditEncodePrompt, "vae_side"),
                       (nodes.QwenEditTrainLoRA, "resolution"), (nodes.QwenEditBuildCache, "resolution")):
        assert node.INPUT_TYPES()["required"][name][1]["default"] == 0, f"{node.__name__}.{name}: not auto"

    def handle(name):
        return ModelHandle(Components(model_dir=resolve_model(name), variant="edit", scheduler_config={}))

    toy, toy21, tiny21 = handle(TOY_MODEL), handle(TOY_21_MODEL), handle(TINY_21_MODEL)
    assert side_of(0, toy) == side_of(0, toy21) == 128  # what the built-in toy models were trained at
    assert side_of(0, tiny21) == 1024 and side_of(512, toy) == 512  # else a real model's side; a set side stays


def test_the_built_in_model_choices_are_each_familys_toy_and_tiny_models_under_their_saved_names():
    """Saved workflows hold the built-in choices' names: each family with a toy gives its two, under those names."""
    from nodes.common import TINY_21_MODEL, TINY_MODEL, TOY_21_MODEL, TOY_MODEL, built_in_models, model_choices
    from qwen_edit_core import families
    built_in = built_in_models()
    assert {name: (family.name, kind) for name, (family, kind) in built_in.items()} == {
        TOY_MODEL: ("qwen-image", "toy"), TINY_MODEL: ("qwen-image", "tiny"),
        TOY_21_MODEL: ("qwen-image-2.1", "toy"), TINY_21_MODEL: ("qwen-image-2.1", "tiny")}
    assert model_choices()[:4] == [TOY_MODEL, TINY_MODEL, TINY_21_MODEL, TOY_21_MODEL]
    assert [f.toy.variant for f in families.FAMILIES.values()] == ["edit", "image-2.1"]
