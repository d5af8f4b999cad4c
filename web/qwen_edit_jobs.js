// Live training view of the Qwen Edit node pack: progress, loss curve, the held-out pairs' error and latest
// validation image of each training job, drawn on the Train / Training Status / Stop Training nodes. Plain
// JavaScript, no build step.
// Fed by the pack's websocket event "qwen_edit.job" (every step) and its route GET /qwen_edit/jobs (on load
// and after a reconnect); jobs live beside ComfyUI's queue, so the view updates while other prompts run.
import { app } from "../../scripts/app.js";
import { api } from "../../scripts/api.js";

const TRAIN_NODES = ["QwenEditTrainLoRA", "QwenEditTrain"];
const NODES = [...TRAIN_NODES, "QwenEditTrainStatus", "QwenEditStopTraining"];
const jobs = new Map(); // name -> {entry, history: [[step, loss], ...]}

function update(entry, history) {
  const job = jobs.get(entry.name) ?? { entry, history: [] };
  job.entry = entry;
  if (history) job.history = history.filter((p) => p[1] !== null);
  else if (entry.point && entry.point[1] !== null) {
    // a step at or before the last one drawn: a new run of that name started over (not a resume)
    job.history = job.history.filter((p) => p[0] < entry.point[0]).concat([entry.point]);
  }
  jobs.set(entry.name, job);
  renderAll();
}

async function refresh() {
  try {
    const res = await api.fetchApi("/qwen_edit/jobs");
    if (!res.ok) return;
    for (const entry of (await res.json()).jobs) update(entry, entry.history);
  } catch (err) {
    console.warn("qwen_edit: could not list training jobs", err);
  }
}

function widgetValue(node, name) {
  const w = (node.widgets || []).find((x) => x.name === name);
  return w ? String(w.value ?? "").trim() : "";
}

// The job a node shows: its job_name widget, else the Train node's name (job_name, else lora_name), following
// the "job" input link to the Train node for the status and stop nodes.
// The node connected to input `name` (LiteGraph's getInputNode; the graph's link table on frontends before it).
function inputOrigin(node, name) {
  const slot = (node.inputs || []).findIndex((i) => i.name === name);
  if (slot < 0) return null;
  if (typeof node.getInputNode === "function") return node.getInputNode(slot) ?? null;
  const id = node.inputs[slot].link;
  const link = id == null ? null : node.graph?.links?.[id] ?? node.graph?.links?.get?.(id);
  return link ? node.graph.getNodeById(link.origin_id) : null;
}

// The job a node shows: its job_name widget (the compact Train node's: its Train Options'), else the Train
// node's lora_name, following the "job" input to the Train node for the status and stop nodes.
function jobNameOf(node, depth = 0) {
  const options = node.comfyClass === "QwenEditTrainLoRA" ? inputOrigin(node, "options") : null;
  const own = widgetValue(node, "job_name") || (options ? widgetValue(options, "job_name") : "");
  if (own) return own.replace(/\.safetensors$/, "");
  if (TRAIN_NODES.includes(node.comfyClass)) return widgetValue(node, "lora_name").replace(/\.safetensors$/, "");
  const origin = depth > 4 ? null : inputOrigin(node, "job");
  return origin ? jobNameOf(origin, depth + 1) : "";
}

// One series scaled to the canvas over the steps [x0, x1]; returns its [min, max] or null when it has no points.
function drawSeries(ctx, pts, color, x0, x1, w, h) {
  if (!pts.length) return null;
  const ys = pts.map((p) => p[1]);
  const y0 = Math.min(...ys), y1 = Math.max(...ys);
  ctx.strokeStyle = color;
  ctx.fillStyle = color;
  ctx.lineWidth = 1.5;
  ctx.beginPath();
  pts.forEach(([x, y], i) => {
    const px = 4 + ((x - x0) / Math.max(x1 - x0, 1e-9)) * (w - 8);
    const py = h - 4 - ((y - y0) / Math.max(y1 - y0, 1e-12)) * (h - 8);
    i ? ctx.lineTo(px, py) : ctx.moveTo(px, py);
    if (pts.length < 3) ctx.fillRect(px - 2, py - 2, 4, 4); // a curve of one or two points: mark them
  });
  ctx.stroke();
  return [y0, y1];
}

// The training loss (blue) and, with held-out pairs, their pixel error to the targets (orange), each on its
// own scale over the same steps: the loss falls while the held-out error says whether the edit is learned.
function drawCurve(canvas, history, heldout) {
  const ctx = canvas.getContext("2d");
  const w = (canvas.width = canvas.clientWidth || 240), h = (canvas.height = canvas.clientHeight || 70);
  ctx.clearRect(0, 0, w, h);
  ctx.fillStyle = "#1b1b1b";
  ctx.fillRect(0, 0, w, h);
  const pts = history.filter((p) => Number.isFinite(p[1]));
  const held = heldout.filter((p) => Number.isFinite(p[1]));
  if (pts.length < 2 && !held.length) return;
  const xs = pts.concat(held).map((p) => p[0]);
  const x0 = Math.min(...xs), x1 = Math.max(...xs);
  const loss = pts.length >= 2 ? drawSeries(ctx, pts, "#4fc3f7", x0, x1, w, h) : null;
  const err = drawSeries(ctx, held, "#ffb74d", x0, x1, w, h);
  ctx.font = "10px sans-serif";
  if (loss) {
    ctx.fillStyle = "#aaa";
    ctx.fillText(`loss ${loss[1].toPrecision(3)}`, 6, 11);
    ctx.fillText(`${loss[0].toPrecision(3)}`, 6, h - 6);
  }
  if (err) {
    ctx.fillStyle = "#ffb74d";
    ctx.textAlign = "right";
    ctx.fillText(`held-out ${held[held.length - 1][1].toPrecision(3)}`, w - 6, 11);
    ctx.textAlign = "left";
  }
}

// The held-out pairs' pixel error per validation step ([[step, mse], ...]) from a job entry.
function heldoutPoints(entry) {
  return (entry.validation_metrics ?? []).filter((r) => r.pixel_mse !== null).map((r) => [r.step, r.pixel_mse]);
}

function render(node) {
  const view = node.__qwenEditLive;
  if (!view) return;
  const name = jobNameOf(node);
  const job = jobs.get(name);
  view.root.dataset.job = name;
  if (!job) {
    view.text.textContent = name ? `${name}: no job yet (queue the graph to train)` : "no job";
    view.root.dataset.state = "none";
    view.root.dataset.step = "0";
    view.root.dataset.points = "0";
    view.bar.value = 0;
    return;
  }
  const e = job.entry;
  const loss = e.loss === null || e.loss === undefined ? "-" : Number(e.loss).toFixed(4);
  const held = heldoutPoints(e);
  const heldText = held.length ? ` · held-out pixel MSE ${held[held.length - 1][1].toFixed(4)}` : "";
  // a finished job's outcome: a failure's reason, or the checkpoint a stop saved and where the LoRA went
  view.text.textContent = `${e.name}: ${e.state} · step ${e.step}/${e.total} · loss ${loss}` + heldText +
    (e.outcome ? ` · ${e.outcome}` : "");
  view.text.style.color = e.state === "failed" ? "#ff8a80" : "";
  Object.assign(view.root.dataset, { state: e.state, step: String(e.step), points: String(job.history.length),
                                     loss: loss, heldout: String(held.length) });
  view.bar.max = e.total || 1;
  view.bar.value = e.step;
  drawCurve(view.canvas, job.history, held);
  // this run's latest validation picture, or none: a new run under the same name has none until its first
  // validation, and must not go on showing the previous run's
  const url = e.validation_url ?? "";
  if (view.img.dataset.src !== url) {
    view.img.dataset.src = url;
    if (url) view.img.src = api.apiURL(url);
    else view.img.removeAttribute("src");
    view.img.style.display = url ? "block" : "none";
  }
}

// Every node of the workflow, those inside subgraphs included (a subgraph node's own graph, and the root graph's
// subgraph definitions on frontends that keep them there).
function* allNodes(graph, seen = new Set()) {
  if (!graph || seen.has(graph)) return;
  seen.add(graph);
  for (const node of graph._nodes ?? graph.nodes ?? []) {
    yield node;
    if (node.subgraph) yield* allNodes(node.subgraph, seen);
  }
  for (const sub of graph.subgraphs?.values?.() ?? []) yield* allNodes(sub, seen);
}

function renderAll() {
  for (const node of allNodes(app.rootGraph ?? app.graph?.rootGraph ?? app.graph)) {
    mountInVueNode(node);
    render(node);
  }
}

// With the Vue node renderer (setting Comfy.VueNodes.Enabled) a node is an HTML element, [data-node-id], and early
// versions of it (frontend 1.27) draw only the widget types they know: a DOM widget of another type, such as the
// live view, is never mounted. Then the view goes at the end of the node's body itself. Only nodes of the graph
// on screen (node ids repeat inside subgraphs); a renderer that mounts the widget (1.58) is left to do so.
function mountInVueNode(node) {
  const view = node.__qwenEditLive, shown = app.canvas?.graph;
  if (!view || view.root.isConnected || !shown || node.graph !== shown) return;
  const element = document.querySelector(`[data-node-id="${CSS.escape(String(node.id))}"]`);
  if (!element) return;
  const body = element.querySelector(`[data-testid="node-body-${CSS.escape(String(node.id))}"]`) ?? element;
  view.root.style.padding = "0 12px";
  body.append(view.root);
}

// Vue nodes are mounted after the graph is configured, and again when the graph on screen changes: mount the
// views once they exist (at most once a frame)
let mountQueued = false;
function watchVueNodes() {
  new MutationObserver(() => {
    if (mountQueued) return;
    mountQueued = true;
    requestAnimationFrame(() => {
      mountQueued = false;
      for (const node of allNodes(app.rootGraph ?? app.graph?.rootGraph ?? app.graph)) mountInVueNode(node);
    });
  }).observe(document.body, { childList: true, subtree: true });
}

// A multiline box shows its name only while empty (the placeholder): the pack's prompt boxes carry their label
// in a strip above the text, drawn as the textarea's background, so a filled box still says what it is.
function labelTextBoxes(node) {
  for (const widget of node.widgets ?? []) {
    const box = widget.inputEl ?? widget.element;
    if (!(box instanceof HTMLTextAreaElement) || box.dataset.qwenEditLabel) continue;
    const label = String(widget.label ?? widget.name).replace(/_/g, " ");
    const text = label.replace(/[&<>"']/g, (c) => `&#${c.charCodeAt(0)};`);
    const svg = `<svg xmlns="http://www.w3.org/2000/svg" width="400" height="14"><text x="0" y="10" ` +
      `font-family="sans-serif" font-size="10" fill="#8a8a8a">${text}</text></svg>`;
    box.dataset.qwenEditLabel = label;
    box.title = label;
    Object.assign(box.style, {
      backgroundImage: `url("data:image/svg+xml,${encodeURIComponent(svg)}")`,
      backgroundRepeat: "no-repeat", backgroundPosition: "6px 2px", paddingTop: "15px",
    });
  }
}

function addView(node) {
  const root = document.createElement("div");
  root.className = "qwen-edit-live";
  root.style.cssText = "display:flex;flex-direction:column;gap:3px;font:11px sans-serif;color:#ddd;";
  const text = document.createElement("div");
  text.className = "qwen-edit-live-text";
  const bar = document.createElement("progress");
  bar.style.width = "100%";
  const canvas = document.createElement("canvas");
  canvas.className = "qwen-edit-live-loss";
  canvas.style.cssText = "width:100%;height:70px;";
  const img = document.createElement("img");
  img.className = "qwen-edit-live-validation";
  img.style.cssText = "display:none;max-width:100%;max-height:96px;object-fit:contain;";
  root.append(text, bar, canvas, img);
  const widget = node.addDOMWidget("live_training", "qwen_edit_live", root, {
    serialize: false, hideOnZoom: false, getMinHeight: () => 210,
  });
  widget.serialize = false; // never saved into the workflow's widget values
  node.__qwenEditLive = { root, text, bar, canvas, img };
  render(node);
}

app.registerExtension({
  name: "qwen_edit.live_training",
  async setup() {
    api.addEventListener("qwen_edit.job", ({ detail }) => update(detail, null));
    api.addEventListener("reconnected", refresh);
    watchVueNodes();
    await refresh();
  },
  async nodeCreated(node) {
    if (NODES.includes(node.comfyClass)) addView(node);
    if (node.comfyClass?.startsWith("QwenEdit")) labelTextBoxes(node);
  },
  async afterConfigureGraph() {
    // newer frontends may create a node's text boxes after nodeCreated: label them once the graph is loaded
    for (const node of allNodes(app.rootGraph ?? app.graph?.rootGraph ?? app.graph)) {
      if (node.comfyClass?.startsWith("QwenEdit")) labelTextBoxes(node);
    }
    renderAll();
  },
});

window.qwenEditLive = { jobs, refresh, renderAll };
