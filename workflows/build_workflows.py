"""Writes the shipped UI-format workflows from compact specs, with widget values in INPUT_TYPES order.

Run `.venv/bin/python workflows/build_workflows.py` after changing a node's inputs; tests check the files
against the nodes (ids, widget counts, link types). Every workflow runs on the built-in tiny model.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from nodes import NODE_CLASS_MAPPINGS  # noqa: E402
from nodes.common import TINY_MODEL  # noqa: E402
from nodes.common import has_control_after_generate as control_after_generate  # noqa: E402

WIDGET_TYPES = ("INT", "FLOAT", "STRING", "BOOLEAN")
BUILTIN = {  # the built-in ComfyUI nodes the workflows use: inputs (name, type, is_widget), outputs
    "SaveImage": ([("images", "IMAGE", False), ("filename_prefix", "STRING", True)], []),
    "PreviewImage": ([("images", "IMAGE", False)], []),
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


def build(nodes: list[dict], title: str) -> dict:
    """nodes: [{"id", "type", "widgets": {name: value}, "links": {input name: (from id, output name)}}]."""
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
                value = node.get("widgets", {}).get(name, _default(node["type"], name))
                widgets.append(value)
                if has_control_after_generate(node["type"], name):
                    widgets.append("fixed")
            else:
                sockets.append({"name": name, "type": kind, "link": linked[0][0] if linked else None})
        ui_nodes.append({
            "id": node["id"], "type": node["type"], "pos": [40 + 330 * (order % 4), 60 + 380 * (order // 4)],
            "size": [300, 200], "flags": {}, "order": order, "mode": 0, "inputs": sockets,
            "outputs": [{"name": name, "type": kind, "links": out_links.get((node["id"], name), []),
                         "slot_index": i} for i, (name, kind) in enumerate(outputs)],
            "properties": {"Node name for S&R": node["type"]}, "widgets_values": widgets})
    for link in links:  # target slot: index among the node's socket inputs
        target = next(n for n in ui_nodes if n["id"] == link[3])
        link[4] = [s["name"] for s in target["inputs"]].index(link[4])
    return {"last_node_id": max(n["id"] for n in nodes), "last_link_id": len(links), "nodes": ui_nodes,
            "links": links, "groups": [], "config": {}, "extra": {"title": title}, "version": 0.4}


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


TINY_LOADER = {"id": 1, "type": "QwenEditModelLoader", "widgets": {"model": TINY_MODEL, "transformer_device": "cpu",
                                                                  "vae_device": "cpu", "text_encoder_device": "cpu",
                                                                  "dtype": "float32"}}
DEMO_DATA = {"id": 2, "type": "QwenEditSyntheticDataset", "widgets": {"count": 8}}
TRAIN = {"lora_name": "qwen_edit_demo_lora", "steps": 40, "learning_rate": 0.002, "rank": 8, "alpha": 8.0,
         "targets": "all", "batch_size": 2, "resolution": 64, "checkpoint_every": 20}
SAMPLE = {"prompt": "invert the colors", "steps": 8, "true_cfg_scale": 4.0, "seed": 0, "vae_side": 128}

WORKFLOWS = {
    "qwen_edit_train_cached": ("Train a LoRA from a folder (cached)", [
        TINY_LOADER, DEMO_DATA,
        {"id": 3, "type": "QwenEditBuildCache", "widgets": {"resolution": 64},
         "links": {"model": (1, "model"), "dataset": (2, "dataset")}},
        {"id": 4, "type": "QwenEditTrain", "widgets": {**TRAIN, "use_cache": True, "validation_every": 20,
                                                        "validation_prompt": "invert the colors"},
         "links": {"model": (1, "model"), "dataset": (3, "dataset"), "validation_image": (2, "example_control")}},
        {"id": 5, "type": "QwenEditTrainStatus", "links": {"job": (4, "job")}},
        {"id": 6, "type": "PreviewImage", "links": {"images": (5, "loss_plot")}},
        {"id": 7, "type": "PreviewImage", "links": {"images": (5, "validation")}}]),
    "qwen_edit_train_realtime": ("Train a LoRA in real time (no cache)", [
        TINY_LOADER, DEMO_DATA,
        {"id": 4, "type": "QwenEditTrain", "widgets": {**TRAIN, "lora_name": "qwen_edit_realtime_lora",
                                                        "use_cache": False},
         "links": {"model": (1, "model"), "dataset": (2, "dataset")}},
        {"id": 5, "type": "QwenEditTrainStatus", "links": {"job": (4, "job")}},
        {"id": 6, "type": "PreviewImage", "links": {"images": (5, "loss_plot")}}]),
    "qwen_edit_build_cache": ("Build the embedding cache only", [
        TINY_LOADER, DEMO_DATA,
        {"id": 3, "type": "QwenEditBuildCache", "widgets": {"resolution": 64},
         "links": {"model": (1, "model"), "dataset": (2, "dataset")}}]),
    "qwen_edit_sample_with_lora": ("Sample with a LoRA (qwen_edit_train_cached writes this one; or pick yours)", [
        TINY_LOADER, DEMO_DATA,
        {"id": 3, "type": "QwenEditLoraLoader", "widgets": {"lora_name": "qwen_edit_demo_lora.safetensors",
                                                             "strength": 1.0},
         "links": {"model": (1, "model")}},
        {"id": 4, "type": "QwenEditSampler", "widgets": SAMPLE,
         "links": {"model": (3, "model"), "image": (2, "example_control")}},
        {"id": 5, "type": "SaveImage", "widgets": {"filename_prefix": "qwen_edit_lora_sample"},
         "links": {"images": (4, "image")}}]),
    "qwen_edit_train_then_sample": ("Train, then sample with the new LoRA, in one graph", [
        TINY_LOADER, DEMO_DATA,
        {"id": 4, "type": "QwenEditTrain", "widgets": {**TRAIN, "lora_name": "qwen_edit_train_then_sample"},
         "links": {"model": (1, "model"), "dataset": (2, "dataset")}},
        {"id": 5, "type": "QwenEditTrainStatus", "widgets": {"wait": True}, "links": {"job": (4, "job")}},
        {"id": 6, "type": "QwenEditLoraLoader", "widgets": {"lora_name": "(none)", "strength": 1.0},
         "links": {"model": (1, "model"), "lora_path": (5, "lora_path")}},
        {"id": 7, "type": "QwenEditSampler", "widgets": SAMPLE,
         "links": {"model": (6, "model"), "image": (2, "example_control")}},
        {"id": 8, "type": "SaveImage", "widgets": {"filename_prefix": "qwen_edit_after_training"},
         "links": {"images": (7, "image")}}]),
    "qwen_edit_two_gpu_cfg": ("Two-GPU true CFG: pick cuda:0 for the model and cuda:1 as uncond_device", [
        TINY_LOADER, DEMO_DATA,
        {"id": 4, "type": "QwenEditSampler", "widgets": {**SAMPLE, "uncond_device": "cpu"},
         "links": {"model": (1, "model"), "image": (2, "example_control")}},
        {"id": 5, "type": "SaveImage", "widgets": {"filename_prefix": "qwen_edit_two_gpu"},
         "links": {"images": (4, "image")}}]),
}


def main() -> None:
    for name, (title, nodes) in WORKFLOWS.items():
        (HERE / f"{name}.json").write_text(json.dumps(build(nodes, title), indent=1) + "\n")


if __name__ == "__main__":
    main()
