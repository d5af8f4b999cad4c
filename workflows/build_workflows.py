"""Writes the shipped UI-format workflows from compact specs, with widget values in INPUT_TYPES order.

Run `.venv/bin/python workflows/build_workflows.py` after changing a node's inputs (it writes
example_workflows/, the one folder ComfyUI offers as templates); tests check the files
against the nodes (ids, widget counts, link types). Every workflow runs on the built-in tiny model, opens
with a Note saying what it does and what to change first, and is laid out left to right in the order of its
steps, one group per stage (layout.py, with node sizes measured in ComfyUI's frontend).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
#: the one folder ComfyUI's template browser reads for this pack (with a <name>.jpg thumbnail beside each)
OUT = HERE.parent / "example_workflows"
sys.path.insert(0, str(HERE.parent))

from nodes import NODE_CLASS_MAPPINGS  # noqa: E402
from nodes.common import TOY_21_MODEL, TOY_MODEL  # noqa: E402
from nodes.common import has_control_after_generate as control_after_generate  # noqa: E402
from workflows.timings import SECONDS, TIMED_BY  # noqa: E402
from workflows.layout import COLUMN_HEIGHT, TITLE, frontend_sizes, note_size, place, stack_columns, view  # noqa: E402

WIDGET_TYPES = ("INT", "FLOAT", "STRING", "BOOLEAN")
BUILTIN = {  # the built-in ComfyUI nodes the workflows use: inputs (name, type, is_widget), outputs
    "SaveImage": ([("images", "IMAGE", False), ("filename_prefix", "STRING", True)], []),
    "PreviewImage": ([("images", "IMAGE", False)], []),
    "Note": ([("text", "STRING", True)], []),  # frontend-only: not sent to the server
    "SolidMask": ([("value", "FLOAT", True), ("width", "INT", True), ("height", "INT", True)], [("MASK", "MASK")]),
    "MaskComposite": ([("destination", "MASK", False), ("source", "MASK", False), ("x", "INT", True),
                       ("y", "INT", True), ("operation", "COMBO", True)], [("MASK", "MASK")]),
    "ImageInvert": ([("image", "IMAGE", False)], [("IMAGE", "IMAGE")]),
    "ImageCompositeMasked": ([("destination", "IMAGE", False), ("source", "IMAGE", False), ("x", "INT", True),
                              ("y", "INT", True), ("resize_source", "BOOLEAN", True), ("mask", "MASK", False)],
                             [("IMAGE", "IMAGE")]),
}


def node_inputs(node_type: str) -> tuple[list[tuple[str, str, bool]], list[tuple[str, str]]]:
    """([(name, type, is_widget)], [(output name, type)]) of a node, in INPUT_TYPES order."""
    if node_type in BUILTIN:
        inputs, outputs = BUILTIN[node_type]
        return inputs, outputs
    cls = NODE_CLASS_MAPPINGS[node_type]
    spec = cls.INPUT_TYPES()
    inputs = []
    for group in ("required", "optional"):
        for name, value in spec.get(group, {}).items():
            kind = value[0]
            options = value[1] if len(value) > 1 else {}
            widget = (isinstance(kind, list) or kind in WIDGET_TYPES) and not options.get("forceInput")
            inputs.append((name, "COMBO" if isinstance(kind, list) else kind, widget))
    names = getattr(cls, "RETURN_NAMES", None) or cls.RETURN_TYPES
    return inputs, list(zip(names, cls.RETURN_TYPES))


def has_control_after_generate(node_type: str, name: str) -> bool:
    if node_type in BUILTIN:
        return False
    spec = NODE_CLASS_MAPPINGS[node_type].INPUT_TYPES()
    for group in ("required", "optional"):
        value = spec.get(group, {}).get(name)
        if value is not None:
            return control_after_generate(name, value)
    return False


def build(stages: list[tuple[str, list[dict]]], title: str, note: str, columns: list[list[str]] | None = None
          ) -> dict:
    """stages: [(group title, [{"id", "type", "widgets": {name: value}, "links": {input: (from id, output)}}])]
    in the order of the steps; a Note node with `note` comes first. columns: the stage titles of each column
    (NOTE for the Note), left to right, where stacking the stages in order does not fit the saved view."""
    numbered = iter(range(1, len(stages) + 1))
    titled = {t: (t if t == RESULTS else f"{next(numbered)}. {t}", group) for t, group in stages}
    stages = list(titled.values())
    nodes = [n for _, group in stages for n in group]
    note_node = {"id": max(n["id"] for n in nodes) + 1, "type": "Note", "widgets": {"text": note},
                 "min_size": note_size(note)}
    titled[NOTE] = ("", [note_node])
    if columns is None:
        columns = stack_columns([("", [note_node])] + stages, frontend_sizes(), COLUMN_HEIGHT)
    else:
        placed_titles = [t for column in columns for t in column]
        if sorted(placed_titles) != sorted(titled):
            raise ValueError(f"columns {columns} must name each stage and NOTE once: {sorted(titled)}")
        columns = [[titled[t] for t in column] for column in columns]
    placed, groups = place(columns, frontend_sizes())
    nodes = [note_node] + nodes
    by_id = {n["id"]: n for n in nodes}
    links, ui_nodes = [], []
    out_links: dict[tuple[int, str], list[int]] = {}
    for node in nodes:
        for name, (src, out_name) in node.get("links", {}).items():
            link_id = len(links) + 1
            outputs = dict(node_inputs(by_id[src]["type"])[1])
            links.append([link_id, src, [o for o, _ in node_inputs(by_id[src]["type"])[1]].index(out_name),
                          node["id"], name, outputs[out_name]])
            out_links.setdefault((src, out_name), []).append(link_id)
    for order, node in enumerate(nodes):
        inputs, outputs = node_inputs(node["type"])
        sockets, widgets = [], []
        for name, kind, widget in inputs:
            linked = [lk for lk in links if lk[3] == node["id"] and lk[4] == name]
            if widget:
                given = node.get("widgets", {})
                value = given[name] if name in given else _default(node["type"], name)
                widgets.append(value)
                if has_control_after_generate(node["type"], name):
                    widgets.append("fixed")
            else:
                sockets.append({"name": name, "type": kind, "link": linked[0][0] if linked else None})
        pos, size = placed[node["id"]]
        ui_nodes.append({
            "id": node["id"], "type": node["type"], "pos": pos, "size": size, "flags": {}, "order": order,
            "mode": 0, "inputs": sockets,
            "outputs": [{"name": name, "type": kind, "links": out_links.get((node["id"], name), []),
                         "slot_index": i} for i, (name, kind) in enumerate(outputs)],
            "properties": {"Node name for S&R": node["type"]}, "widgets_values": widgets})
    for link in links:  # target slot: index among the node's socket inputs
        target = next(n for n in ui_nodes if n["id"] == link[3])
        link[4] = [s["name"] for s in target["inputs"]].index(link[4])
    rects = [g["bounding"] for g in groups] + [(n["pos"][0], n["pos"][1] - TITLE, n["size"][0],
                                                 n["size"][1] + TITLE) for n in ui_nodes]
    return {"last_node_id": max(n["id"] for n in nodes), "last_link_id": len(links), "nodes": ui_nodes,
            "links": links, "groups": groups, "config": {}, "extra": {"title": title, "ds": view(rects)},
            "version": 0.4}


def _default(node_type: str, name: str):
    spec = NODE_CLASS_MAPPINGS[node_type].INPUT_TYPES() if node_type not in BUILTIN else {}
    for group in ("required", "optional"):
        value = spec.get(group, {}).get(name)
        if value is not None:
            if isinstance(value[0], list):
                return value[0][0]
            return value[1].get("default") if len(value) > 1 else None
    if node_type == "SaveImage" and name == "filename_prefix":
        return "qwen_edit"
    raise KeyError(f"{node_type}.{name} has no default; give it in the spec")


TINY_LOADER = {"id": 1, "type": "QwenEditModelLoader", "widgets": {"model": TOY_MODEL, "transformer_device": "cpu",
                                                                  "vae_device": "cpu", "text_encoder_device": "cpu",
                                                                  "dtype": "float32"}}
DEMO_DATA = {"id": 2, "type": "QwenEditSyntheticDataset", "widgets": {"count": 8}}
#: the toy model learns "invert the colors" keeping the shapes at rank 64 (its transformer's width) and lr 1e-2, as
#: the demo does (qwen_edit_core/demo.py, docs/TOY_MODEL.md); rank 16 at lr 3e-3 dissolved the shapes into blocks
TRAIN = {"lora_name": "qwen_edit_demo_lora", "steps": 150, "learning_rate": 0.01, "rank": 64, "targets": "all",
         "batch_size": 4, "resolution": 128, "checkpoint_every": 50}
#: the demo's step count, for the template that samples with the trained LoRA at the end
DEMO_STEPS = 250
#: the real-time template's: it encodes every batch as it goes (about 1.5 s a step on one CPU thread against 0.15 s
#: cached), so it trains fewer steps; its validation shows the inverted colours by step 100
REALTIME_STEPS = 100
SAMPLE = {"prompt": "invert the colors", "steps": 20, "true_cfg_scale": 1.0, "seed": 0, "vae_side": 128}

#: the 2.1 training workflow's edit: two ordered references, the target made from both
EDIT21 = "paste the second picture's left half onto the first picture's right half"
#: the 2.1 workflows' picture: the demo dataset's first of this seed, two bold squares. The toy 2.1 draws each 16 px
#: token on its own, so thin shapes barely survive even its VAE (the default seed's pasted pair: edge similarity 0.43
#: and 0.33 per half after the VAE's round trip alone); the training workflow's LoRA steps: 100 kept the colours of
#: each half but not the squares (BENCHMARKS.md, "Toy model builds")
SEED21, STEPS21 = 3, 300
#: in a folder of their own: a 2025 job training on the demo folder never sees its pictures replaced
DEMO_DATA21 = {**DEMO_DATA, "widgets": {**DEMO_DATA["widgets"], "seed": SEED21, "folder": "qwen_image21_demo_pairs"}}

LOAD, DATA, TRAINING, WATCH, SAMPLING = "Load the model", "Data", "Train", "Watch it learn", "Sample"
PAIRS = "Pair with ordered references"
PREVIEWS = "Validation previews"
RESULTS = "Results"  # the one group without a step number
NOTE = ""  # the Note's place in a workflow's COLUMNS
TINY_NOTE = ("It runs as shipped on the built-in toy model (pretrained on 128 px pictures of shapes: it keeps, "
             "grays or shifts them; CFG 1). For real edits pick your Qwen-Image-Edit folder of models/qwen_edit in Load Model "
             "(or its diffusion_models / vae / text_encoders files), devices cuda:0 and dtype bfloat16.")
TRAIN_NOTE = ("Change first: the dataset (Dataset From Folder on your folder of before/after pairs instead of "
              "the synthetic one), then in Train LoRA: lora_name, steps (500-3000), resolution (1024), "
              "learning_rate (1e-4) and rank (16)")
#: what the toy learns in the training workflows (the demo's edit)
LEARNS = "On the toy model the LoRA learns to invert the colours of the demo pictures, keeping their shapes."

WORKFLOWS = {
    "qwen_edit_train_cached": ("Train a LoRA from a folder (cached)", (
        "Trains a LoRA on edit pairs: writes a small demo dataset, encodes it once (Build Cache), trains in "
        "the background and shows the loss plot and a validation edit every 50 steps. The LoRA lands in "
        f"models/loras. {LEARNS}\n\n{TRAIN_NOTE}.\n\n{TINY_NOTE}"), [
        (LOAD, [TINY_LOADER]),
        (DATA, [DEMO_DATA, {"id": 3, "type": "QwenEditBuildCache", "widgets": {"resolution": 128},
                            "links": {"model": (1, "model"), "dataset": (2, "dataset")}}]),
        (TRAINING, [
            {"id": 4, "type": "QwenEditTrainLoRA", "widgets": {**TRAIN, "use_cache": True, "validation_every": 50,
                                                            "validation_prompt": "invert the colors"},
             "links": {"model": (1, "model"), "dataset": (3, "dataset"), "validation_image": (2, "example_control")}},
            ]),
        (WATCH, [{"id": 5, "type": "QwenEditTrainStatus", "links": {"job": (4, "job")}}]),
        (RESULTS, [{"id": 6, "type": "PreviewImage", "links": {"images": (5, "loss_plot")}},
                   {"id": 7, "type": "PreviewImage", "links": {"images": (5, "validation")}}])]),
    "qwen_edit_train_lightning_preview": ("Train a LoRA with a 4-step Lightning-style preview", (
        "Trains a LoRA like qwen_edit_train_cached and shows each validation edit twice, side by side and "
        "labelled: the base schedule at 8 steps and the few-step 'lightning' schedule at 4 steps, both at CFG 1 "
        f"as the toy runs: what you will get with a Lightning LoRA. {LEARNS}\n\n{TRAIN_NOTE}; in Train Options' "
        "validation_previews add lora=<your Lightning LoRA in models/loras> to the lightning line (e.g. "
        "lora=Qwen-Image-Edit-Lightning-4steps-V1.0.safetensors), and steps=30 cfg=4 on the base line."
        f"\n\n{TINY_NOTE}"), [
        (LOAD, [TINY_LOADER]),
        (DATA, [DEMO_DATA, {"id": 3, "type": "QwenEditBuildCache", "widgets": {"resolution": 64},
                            "links": {"model": (1, "model"), "dataset": (2, "dataset")}}]),
        (PREVIEWS, [
            {"id": 8, "type": "QwenEditTrainOptions", "widgets": {
                "validation_previews": "diffusers steps=8 cfg=1\nlightning steps=4 cfg=1"}}]),
        (TRAINING, [
            {"id": 4, "type": "QwenEditTrainLoRA", "widgets": {
                **TRAIN, "lora_name": "qwen_edit_lightning_preview_lora", "use_cache": True, "validation_every": 20,
                "validation_prompt": "invert the colors"},
             "links": {"model": (1, "model"), "dataset": (3, "dataset"), "validation_image": (2, "example_control"),
                       "options": (8, "options")}}]),
        (WATCH, [{"id": 5, "type": "QwenEditTrainStatus", "links": {"job": (4, "job")}}]),
        (RESULTS, [{"id": 6, "type": "PreviewImage", "links": {"images": (5, "loss_plot")}},
                   {"id": 7, "type": "PreviewImage", "links": {"images": (5, "validation")}}])]),
    "qwen_edit_train_realtime": ("Train a LoRA in real time (no cache)", (
        "Trains a LoRA encoding every batch as it goes (no cache: the text encoder and VAE stay loaded; use it "
        f"for changing data or augmentation). The LoRA lands in models/loras. {LEARNS}\n\n{TRAIN_NOTE}.\n\n"
        f"{TINY_NOTE}"), [
        (LOAD, [TINY_LOADER]),
        (DATA, [DEMO_DATA]),
        (TRAINING, [
            {"id": 4, "type": "QwenEditTrainLoRA", "widgets": {**TRAIN, "lora_name": "qwen_edit_realtime_lora",
                                                            "steps": REALTIME_STEPS, "use_cache": False,
                                                            "validation_every": 50,
                                                            "validation_prompt": "invert the colors"},
             "links": {"model": (1, "model"), "dataset": (2, "dataset"), "validation_image": (2, "example_control")}},
            ]),
        (WATCH, [{"id": 5, "type": "QwenEditTrainStatus", "links": {"job": (4, "job")}}]),
        (RESULTS, [{"id": 6, "type": "PreviewImage", "links": {"images": (5, "loss_plot")}},
                   {"id": 7, "type": "PreviewImage", "links": {"images": (5, "validation")}}])]),
    "qwen_edit_build_cache": ("Build the embedding cache only", (
        "Encodes a dataset once (VAE latents and prompt embeddings) into the cache that training reuses, so a "
        "later training run loads only the transformer.\n\nChange first: the dataset (Dataset From Folder on "
        f"your pairs) and Build Cache's resolution (1024 for real training).\n\n{TINY_NOTE}"), [
        (LOAD, [TINY_LOADER]),
        (DATA, [DEMO_DATA, {"id": 3, "type": "QwenEditBuildCache", "widgets": {"resolution": 128},
                            "links": {"model": (1, "model"), "dataset": (2, "dataset")}}]),
        (RESULTS, [{"id": 4, "type": "PreviewImage", "links": {"images": (2, "example_control")}}])]),
    "qwen_edit_sample_with_lora": ("Sample with a LoRA", (
        "Edits an image with true CFG, optionally through a LoRA. As shipped Load LoRA is (none), so it runs on "
        "a fresh install.\n\nChange first: pick your LoRA in Load LoRA (qwen_edit_train_cached writes "
        "qwen_edit_demo_lora), the control image (a Load Image node instead of the demo dataset's example) and "
        f"the prompt; steps 20-50 and true_cfg_scale 4.0 for real models.\n\n{TINY_NOTE}"), [
        (LOAD, [TINY_LOADER, {"id": 3, "type": "QwenEditLoraLoader", "widgets": {"lora_name": "(none)",
                                                                                 "strength": 1.0},
                              "links": {"model": (1, "model")}}]),
        (DATA, [DEMO_DATA]),
        (SAMPLING, [{"id": 4, "type": "QwenEditSampler", "widgets": SAMPLE,
                     "links": {"model": (3, "model"), "image": (2, "example_control")}}]),
        (RESULTS, [{"id": 5, "type": "SaveImage", "widgets": {"filename_prefix": "qwen_edit_lora_sample"},
                    "links": {"images": (4, "image")}}])]),
    "qwen_edit_train_then_sample": ("Train, then sample with the new LoRA, in one graph", (
        "Trains a LoRA, waits for it (Training Status with wait on), then edits the demo image through it.\n\n"
        f"{LEARNS}\n\n{TRAIN_NOTE}; in the Sampler: the prompt and steps.\n\n{TINY_NOTE}"), [
        (LOAD, [TINY_LOADER]),
        (DATA, [DEMO_DATA]),
        (TRAINING, [
            {"id": 4, "type": "QwenEditTrainLoRA", "widgets": {**TRAIN, "lora_name": "qwen_edit_train_then_sample",
                                                            "steps": DEMO_STEPS},
             "links": {"model": (1, "model"), "dataset": (2, "dataset")}},
            ]),
        (WATCH, [{"id": 5, "type": "QwenEditTrainStatus", "widgets": {"wait": True}, "links": {"job": (4, "job")}}]),
        (SAMPLING, [
            {"id": 6, "type": "QwenEditLoraLoader", "widgets": {"lora_name": "(none)", "strength": 1.0},
             "links": {"model": (1, "model"), "lora_path": (5, "lora_path")}},
            {"id": 7, "type": "QwenEditSampler", "widgets": SAMPLE,
             "links": {"model": (6, "model"), "image": (2, "example_control")}}]),
        (RESULTS, [{"id": 8, "type": "SaveImage", "widgets": {"filename_prefix": "qwen_edit_after_training"},
                    "links": {"images": (7, "image")}}])]),
    "qwen_edit_masked_pairs": ("Build a dataset with region masks", (
        "Saves a before/after pair with the mask of its edited region into a dataset folder (Save Pair To "
        "Dataset: input/qwen_edit_masked_pairs/pair_00001.png, pair_00001_control.png, pair_00001.txt and "
        "pair_00001_mask.png, white = edited); each run with other pictures or caption adds the next pair. As "
        "shipped the before picture is the demo's, the after picture has its left half's colours inverted and "
        "the mask marks that half "
        "(stock mask nodes, 1 = edited).\n\nChange first: use two Load Image nodes for your before and after "
        "pictures, paint the edited region on the after picture (right click > Open in MaskEditor) and connect "
        "that Load Image's MASK to Save Pair's mask; write the caption. Then train on the folder: Dataset From "
        "Folder (folder qwen_edit_masked_pairs) into Train LoRA; Train Options' mask_weight (2-5) sets how "
        "much the edited region counts in the loss. Needs no model."), [
        ("Before picture", [DEMO_DATA]),
        ("Edited region (mask)", [
            {"id": 3, "type": "SolidMask", "widgets": {"value": 0.0, "width": 128, "height": 128}},
            {"id": 4, "type": "SolidMask", "widgets": {"value": 1.0, "width": 64, "height": 128}},
            {"id": 5, "type": "MaskComposite", "widgets": {"x": 0, "y": 0, "operation": "add"},
             "links": {"destination": (3, "MASK"), "source": (4, "MASK")}}]),
        ("After picture", [
            {"id": 6, "type": "ImageInvert", "links": {"image": (2, "example_control")}},
            {"id": 7, "type": "ImageCompositeMasked", "widgets": {"x": 0, "y": 0, "resize_source": False},
             "links": {"destination": (2, "example_control"), "source": (6, "IMAGE"), "mask": (5, "MASK")}}]),
        ("Save the pair", [
            {"id": 8, "type": "QwenEditSavePair", "widgets": {"caption": "invert the colors on the left",
                                                              "folder": "qwen_edit_masked_pairs"},
             "links": {"before": (2, "example_control"), "after": (7, "IMAGE"), "mask": (5, "MASK")}}]),
        (RESULTS, [{"id": 9, "type": "PreviewImage", "links": {"images": (7, "IMAGE")}}])]),
    "qwen_image21_sample_references": ("Qwen-Image-2.1: edit with ordered reference images", (
        "Samples Qwen-Image-2.1 with two reference images in order: the demo picture (the Sampler's image "
        "input; a batch adds each of its pictures) and its inverted copy (Reference Images: chain one per "
        "picture size, up to 10 references in all). The Sampler returns the picture and its transparency as a "
        "MASK (2.1 decodes RGBA). As shipped it runs the built-in toy 2.1 model (pretrained on 128 px pictures "
        "of shapes: it keeps, grays or shifts the first reference) at 20 steps and CFG 1, graying the first "
        "picture; the second reference leaves that edit as it is (the toy is not "
        "distilled: a few-step sigma list such as qwen21-dmd-6step gives it a blur).\n\nChange first: in Load Model pick your "
        "Qwen-Image-2.1 folder of models/qwen_edit (or its diffusion_models file), devices cuda:0 and dtype "
        "bfloat16; the pictures (Load Image nodes; connect a Load Image's MASK to Reference Images for "
        "transparency) and the prompt; vae_side 1024; sigmas empty with steps 40 for the base model, or the "
        "list your few-step adapter was made for. Qwen-Image-2.1 is under the Qwen Research License "
        "(non-commercial research and evaluation)."), [
        (LOAD, [{**TINY_LOADER, "widgets": {**TINY_LOADER["widgets"], "model": TOY_21_MODEL}}]),
        (DATA, [DEMO_DATA21, {"id": 3, "type": "ImageInvert", "links": {"image": (2, "example_control")}},
                {"id": 4, "type": "QwenEditReferenceImages", "links": {"image": (3, "IMAGE")}}]),
        (SAMPLING, [{"id": 5, "type": "QwenEditSampler",
                     "widgets": {**SAMPLE, "prompt": "make it grayscale", "sigmas": ""},
                     "links": {"model": (1, "model"), "image": (2, "example_control"),
                               "references": (4, "references")}}]),
        (RESULTS, [{"id": 6, "type": "SaveImage", "widgets": {"filename_prefix": "qwen_image21_sample"},
                    "links": {"images": (5, "image")}}])]),
    "qwen_image21_train_references": ("Qwen-Image-2.1: train an edit LoRA on pairs with ordered references", (
        "Builds a Qwen-Image-2.1 training pair with two ordered references in the graph (Save Pair To Dataset: "
        "before is the first reference, the Reference Images chain on references adds the rest, up to 10 in "
        "all), trains a LoRA on it (Train LoRA, watched by Training Status), then samples the pair's "
        "references through the new LoRA. The edit: the first picture with the second picture's left half "
        "pasted on its right half (order matters). As shipped it runs the built-in toy 2.1 model (pretrained on "
        "128 px pictures of shapes: it keeps, grays or shifts the first reference, and copies it for a prompt it "
        "does not know): the LoRA learns the pasted half, which the picture sampled after training shows; Train "
        "LoRA's live view draws the loss curve.\n\nChange first: in Load Model pick your Qwen-Image-2.1 folder of models/qwen_edit, devices "
        "cuda:0 and dtype bfloat16; your pictures (Load Image nodes: before, a Reference Images node per "
        "picture size, after) and caption, or Dataset From Folder on a folder of pairs (NAME_control_1.png .. "
        "NAME_control_10.png, NAME.png, NAME.txt); in Train LoRA: lora_name, steps (500-3000), resolution "
        "(1024), learning_rate (1e-4), rank (16), batch_size. Qwen-Image-2.1 is under the Qwen Research "
        "License (non-commercial research and evaluation)."), [
        (PAIRS, [
            DEMO_DATA21,
            {"id": 3, "type": "ImageInvert", "links": {"image": (2, "example_control")}},
            {"id": 5, "type": "ImageCompositeMasked", "widgets": {"x": 64, "y": 0, "resize_source": False},
             "links": {"destination": (2, "example_control"), "source": (3, "IMAGE")}},
            {"id": 4, "type": "QwenEditReferenceImages", "links": {"image": (3, "IMAGE")}},
            {"id": 6, "type": "QwenEditSavePair", "widgets": {"caption": EDIT21, "folder": "qwen_image21_pairs"},
             "links": {"before": (2, "example_control"), "after": (5, "IMAGE"), "references": (4, "references")}}]),
        (LOAD, [{**TINY_LOADER, "widgets": {**TINY_LOADER["widgets"], "model": TOY_21_MODEL}}]),
        (TRAINING, [
            {"id": 7, "type": "QwenEditTrainLoRA", "widgets": {
                **TRAIN, "lora_name": "qwen_image21_edit_lora", "steps": STEPS21, "rank": 32, "batch_size": 1,
                "use_cache": False},
             "links": {"model": (1, "model"), "dataset": (6, "dataset")}}]),
        (WATCH, [{"id": 8, "type": "QwenEditTrainStatus", "widgets": {"wait": True}, "links": {"job": (7, "job")}}]),
        (SAMPLING, [
            {"id": 9, "type": "QwenEditLoraLoader", "widgets": {"lora_name": "(none)", "strength": 1.0},
             "links": {"model": (1, "model"), "lora_path": (8, "lora_path")}},
            {"id": 10, "type": "QwenEditSampler", "widgets": {**SAMPLE, "prompt": EDIT21, "vae_side": 128},
             "links": {"model": (9, "model"), "image": (2, "example_control"), "references": (4, "references")}},
            {"id": 11, "type": "SaveImage", "widgets": {"filename_prefix": "qwen_image21_after_training"},
             "links": {"images": (10, "image")}}])]),
    "qwen_edit_two_gpu_cfg": ("Two-GPU true CFG", (
        "Edits an image with true CFG, the conditional branch on the model's device and the unconditional one "
        "on uncond_device, both at once.\n\nChange first: Load Model's transformer_device to cuda:0 and the "
        "Sampler's uncond_device to cuda:1 (as shipped both are the CPU, so it runs anywhere), and raise "
        "true_cfg_scale above 1 (4.0 for real models) with a negative_prompt: at CFG 1, as shipped for the toy "
        "model, the unconditional branch is skipped and uncond_device does nothing. Then the control image "
        f"and prompt.\n\n{TINY_NOTE}"), [
        (LOAD, [TINY_LOADER]),
        (DATA, [DEMO_DATA]),
        (SAMPLING, [{"id": 4, "type": "QwenEditSampler", "widgets": {**SAMPLE, "uncond_device": "cpu"},
                     "links": {"model": (1, "model"), "image": (2, "example_control")}}]),
        (RESULTS, [{"id": 5, "type": "SaveImage", "widgets": {"filename_prefix": "qwen_edit_two_gpu"},
                    "links": {"images": (4, "image")}}])]),
}


#: columns of stages where stacking them in order does not fit the saved view at 0.8 zoom (tests/nodes/
#: test_workflow_view.py): Train LoRA and Training Status stacked are taller than the screen and five columns wider,
#: so the model loads above Train, the Note stands under Training Status and the picture is saved in the Sample group
COLUMNS = {"qwen_image21_train_references": [[PAIRS], [LOAD, TRAINING], [WATCH, NOTE], [SAMPLING]]}


def timed(name: str, note: str) -> str:
    """The Note with the time its workflow took and the command that measured it (none yet: the Note as it is, which
    tests/nodes/test_workflow_notes.py refuses)."""
    if name not in SECONDS:
        return note
    seconds = SECONDS[name]
    took = f"{seconds:.0f} s" if seconds < 90 else f"{seconds / 60:.0f} min"
    return (f"{note}\n\nAs shipped it took {took} on a 2-core CPU "
            f"(`{TIMED_BY.format(name=name)}`).")


def main() -> None:
    for name, (title, note, stages) in WORKFLOWS.items():
        graph = build(stages, title, timed(name, note), COLUMNS.get(name))
        (OUT / f"{name}.json").write_text(json.dumps(graph, indent=1) + "\n")


if __name__ == "__main__":
    main()
