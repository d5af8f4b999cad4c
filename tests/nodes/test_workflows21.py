"""The shipped Qwen-Image-2.1 workflows, node by node as ComfyUI runs them (each node called with its widget values,
missing ones at their defaults): the training workflow's picture, sampled through the new LoRA, shows the pasted edit
and keeps the shapes of both halves by the 2025 demo's edge similarity; the sample workflow's grey picture keeps
reference 1's light and dark. `make comfy-test` checks the same pictures in a real ComfyUI
(tools/comfy_test/edit_check.py)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest
import torch

import nodes
from qwen_edit_core.data import synthetic
from qwen_edit_core.demo import edge_similarity, luminance_correlation

from conftest import KEEPS_THE_LUMINANCE, KEEPS_THE_SHAPES

ROOT = Path(__file__).resolve().parents[2]
#: the sampled right half is closer to the target's than to reference 1's by this factor (edit_check.py's MARGIN)
MARGIN = 0.5


def _workflow_nodes(name: str) -> dict[int, dict]:
    """Workflow `name`'s node specs by id, from the script that writes the shipped JSON (tests/nodes/test_nodes.py
    checks that the shipped files are its output)."""
    spec = importlib.util.spec_from_file_location("build_workflows", ROOT / "workflows" / "build_workflows.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    _, _, stages = module.WORKFLOWS[name]
    return {node["id"]: node for _, group in stages for node in group}


def _run(spec: dict, **links):
    """Call a pack node as ComfyUI does: keyword arguments, widgets not given in the workflow at their defaults (a
    list's first choice unless it names another)."""
    cls = nodes.NODE_CLASS_MAPPINGS[spec["type"]]
    widgets = dict(spec.get("widgets", {}))
    for name, (kind, *options) in cls.INPUT_TYPES()["required"].items():
        if name in widgets or name in links:
            continue
        default = options[0].get("default") if options else None
        widgets[name] = kind[0] if isinstance(kind, list) and default is None else default
    out = getattr(cls(), cls.FUNCTION)(**widgets, **links)
    return out["result"] if isinstance(out, dict) else out


def _composite(destination: torch.Tensor, source: torch.Tensor, x: int, y: int) -> torch.Tensor:
    """ComfyUI's ImageCompositeMasked without a mask or resizing: `source` pasted at (x, y), clipped to
    `destination`."""
    out = destination.clone()
    h, w = min(source.shape[1], out.shape[1] - y), min(source.shape[2], out.shape[2] - x)
    out[:, y:y + h, x:x + w] = source[:, :h, :w]
    return out


@pytest.mark.slow  # 300 real-time training steps: about a minute of CPU
def test_the_shipped_21_training_workflow_samples_its_edit_with_the_shapes_kept(env):
    spec = _workflow_nodes("qwen_image21_train_references")
    assert spec[3]["type"] == "ImageInvert" and spec[5]["type"] == "ImageCompositeMasked"
    with torch.inference_mode():
        _, before = _run(spec[2])
        inverted = 1.0 - before
        after = _composite(before, inverted, spec[5]["widgets"]["x"], spec[5]["widgets"]["y"])
        (refs,) = _run(spec[4], image=inverted)
        dataset, _ = _run(spec[6], before=before, after=after, references=refs)
        (model,) = _run(spec[1])
        (job,) = _run(spec[7], model=model, dataset=dataset)
        lora_name, lora_path, *_ = _run(spec[8], job=job)
        assert lora_name == f"{spec[7]['widgets']['lora_name']}.safetensors", job.status().error
        (with_lora,) = _run(spec[9], model=model, lora_path=lora_path)
        picture = _run(spec[10], model=with_lora, image=before, references=refs)[0]
    picture, target, reference = (t[0, ..., :3].double().numpy() for t in (picture, after, before))
    half = target.shape[1] // 2
    to_target = np.abs(picture[:, half:] - target[:, half:]).mean()
    to_reference = np.abs(picture[:, half:] - reference[:, half:]).mean()
    assert to_target < MARGIN * to_reference, (to_target, to_reference)
    for part in (slice(None, half), slice(half, None)):
        assert edge_similarity(picture[:, part], target[:, part]) >= KEEPS_THE_SHAPES


def test_the_shipped_21_sample_workflows_grey_picture_keeps_reference_1s_light_and_dark(env):
    """Why luminance and not edges for a grey picture: tests/toys/test_toy21.py, which checks the same on held-out
    pictures."""
    from PIL import Image

    spec = _workflow_nodes("qwen_image21_sample_references")
    assert spec[3]["type"] == "ImageInvert" and spec[5]["widgets"]["prompt"] == "make it grayscale"
    with torch.inference_mode():
        _, before = _run(spec[2])
        (refs,) = _run(spec[4], image=1.0 - before)
        (model,) = _run(spec[1])
        picture = _run(spec[5], model=model, image=before, references=refs)[0]
    control = Image.fromarray((before[0].numpy() * 255).round().astype(np.uint8))
    grey = np.asarray(synthetic.EDITS["make it grayscale"](control).convert("RGB"), dtype=np.float64) / 255
    assert luminance_correlation(picture[0, ..., :3].double().numpy(), grey) >= KEEPS_THE_LUMINANCE
