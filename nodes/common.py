"""Shared node plumbing: the objects that travel between our nodes, widgets, and IMAGE conversion."""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from qwen_edit_core.families import FAMILIES, Family
from qwen_edit_core.model.components import Components
from qwen_edit_core.model.devices import available_devices

from . import comfy_runtime

CATEGORY = "Qwen Edit"
TOY_MODEL = "qwen-edit-toy (built-in, pretrained: edits 128 px pictures)"
TINY_MODEL = "qwen-edit-tiny (built-in, random weights)"
TINY_21_MODEL = "qwen-image-2.1-tiny (built-in, random weights)"
TOY_21_MODEL = "qwen-image-2.1-toy (built-in, pretrained: edits 128 px pictures)"
DTYPES = ["float32", "bfloat16", "float16"]

MODEL = "QWEN_EDIT_MODEL"
TRANSFORMER = "QWEN_EDIT_TRANSFORMER"
VAE = "QWEN_EDIT_VAE"
TEXT_ENCODER = "QWEN_EDIT_TEXT_ENCODER"
SCHEDULER = "QWEN_EDIT_SCHEDULER"
CONDITIONING = "QWEN_EDIT_CONDITIONING"
LATENT = "QWEN_EDIT_LATENT"
REFERENCES = "QWEN_EDIT_REFERENCES"
DATASET = "QWEN_EDIT_DATASET"
JOB = "QWEN_EDIT_JOB"


@dataclass(frozen=True)
class ModelHandle:
    """A loaded model plus the LoRA stack a graph applies to it (ComfyUI-style: loading a LoRA makes a new
    handle over the same weights; the sampler activates the stack it is given)."""

    components: Components
    loras: tuple[tuple[str, float], ...] = ()
    #: uncond replicas for split CFG, by device (shared between handles over the same transformer)
    replicas: dict = field(default_factory=dict, compare=False)
    #: attention kernel tried first when sampling (QwenEditSpeed; speed.ATTENTION_KERNELS)
    attention: str = "auto"

    def with_lora(self, path: str, strength: float) -> "ModelHandle":
        return replace(self, loras=self.loras + ((path, strength),))


@dataclass(frozen=True)
class DatasetHandle:
    folder: Path
    report: object  # qwen_edit_core.data.dataset.DatasetReport: the pairs training reads
    cache_dir: Path | None = None
    resolution: int | None = None
    #: training leaves out the pairs with a problem (data.skip_invalid) instead of refusing the dataset
    skip_invalid: bool = False
    #: pairs without a caption, kept out of `report` for the Dataset Doctor to caption (training never reads them)
    captionless: tuple[str, ...] = ()


#: tooltips several nodes share (units and typical values; shown by the frontend on hover)
TIPS = {
    "model": "the loaded Qwen-Image-Edit model (Load Model, or Assemble Model for per-component loaders)",
    "device": "where this component's weights live and run: cpu, cuda:N or mps",
    "dtype": "weight dtype: bfloat16 on GPUs (half the memory of float32); float32 on the CPU and for the "
             "built-in tiny model",
    "quantize": "none, or int8 / nf4 weights via bitsandbytes (CUDA only; about 1/2 and 1/4 of bf16 memory)",
    "image": "the control image to edit (ComfyUI IMAGE, RGB in [0, 1])",
    "dataset": "a dataset from Dataset From Folder, Synthetic Demo Dataset or Build Cache",
}


def device_choices() -> list[str]:
    return available_devices()


def built_in_models() -> dict[str, tuple[Family, str]]:
    """Each built-in model choice -> (its family, "toy" or "tiny"): a pretrained toy and a random tiny model per
    family with a `Toy` description, named after its `label` (TOY_MODEL, TINY_MODEL, ... are these names)."""
    found = {}
    for family in FAMILIES.values():
        if family.toy is not None:
            found[f"{family.toy.label}-toy (built-in, pretrained: edits 128 px pictures)"] = (family, "toy")
            found[f"{family.toy.label}-tiny (built-in, random weights)"] = (family, "tiny")
    return found


def model_choices() -> list[str]:
    listed = [TOY_MODEL, TINY_MODEL, TINY_21_MODEL, TOY_21_MODEL]
    return listed + [name for name in built_in_models() if name not in listed] + comfy_runtime.model_dirs()


def resolve_model(name: str, path: str = "") -> Path:
    """The model directory of a loader's widgets: an explicit path, a built-in model (built on first use in the
    folder named before its parenthesis: the pretrained toy model of a family, or its random tiny one), or a
    directory of ComfyUI's models/qwen_edit folder."""
    if path and path.strip():
        return Path(path.strip()).expanduser()
    built_in = built_in_models()
    if name in built_in:
        family, kind = built_in[name]
        target = comfy_runtime.default_model_root() / name.split(" (")[0]
        if kind == "toy":
            from qwen_edit_core.toys.toy import ensure_toy, weights_of
            return ensure_toy(target, weights_of(family))
        if not (target / "model_index.json").is_file():
            from qwen_edit_core.model.tiny import build_tiny
            build_tiny(target, variant=family.toy.variant)
        return target
    found = comfy_runtime.model_dir_path(name)
    if found is None:
        raise FileNotFoundError(f"model {name!r} is not in ComfyUI's models/qwen_edit folder; give its path")
    return found


#: the picture side of a real Qwen-Image model (about one megapixel), and what a side input of 0 ("auto") means
#: for any model but the built-in toy ones
REAL_SIDE = 1024
#: what Train's steps and learning_rate of 0 ("auto") mean for a real model: a LoRA of an edit or style on 20-100
#: pairs at rank 16
REAL_STEPS, REAL_LEARNING_RATE = 1000, 1e-4
#: the lowest CFG input, "auto": the schedule's or sigma preset's scale, else the model's (`auto_cfg`)
AUTO_CFG = -1.0


def toy_recipe(handle) -> dict | None:
    """The recipe a built-in pretrained toy model was trained with (its weights' manifest, matched by the stamp
    `ensure_toy` leaves in the model directory), or None for any other model."""
    from qwen_edit_core.toys import toy
    stamp = Path(handle.components.model_dir) / toy.MANIFEST
    if stamp.is_file():
        built = json.loads(stamp.read_text()).get("sha256")
        for weights in (toy.weights_of(f) for f in FAMILIES.values() if f.toy is not None):
            info = toy.manifest(weights)
            if info["sha256"] == built:
                return info["recipe"]
    return None


def native_side(handle) -> int:
    """The picture side a loaded model is made for, what a side input of 0 ("auto") stands for: the built-in
    pretrained toy models' training size, else REAL_SIDE."""
    recipe = toy_recipe(handle)
    return int(recipe["size"]) if recipe else REAL_SIDE


def side_of(side: int, handle) -> int:
    """A side input's value in pixels: itself, or (0, "auto") the model's `native_side`."""
    return side if side > 0 else native_side(handle)


def auto_cfg(handle) -> float:
    """The true CFG scale a model samples at when the CFG input is "auto": 1 (off) for the built-in toy models,
    which learned their edits without CFG, else its family's pipeline default (4 for Qwen-Image-Edit, 1 for
    the CFG-distilled Qwen-Image-2.1)."""
    from qwen_edit_core.families import variants
    return 1.0 if toy_recipe(handle) else variants.get(handle.components.variant).family.pipeline_cfg


def training_defaults(handle) -> tuple[int, float]:
    """(steps, learning rate) that Train's inputs of 0 ("auto") stand for: the toy demo's (qwen_edit_core/demo.py)
    on a built-in toy model, else REAL_STEPS and REAL_LEARNING_RATE."""
    from qwen_edit_core import demo
    return (demo.STEPS, demo.LEARNING_RATE) if toy_recipe(handle) else (REAL_STEPS, REAL_LEARNING_RATE)


def image_to_pils(image: torch.Tensor) -> list:
    """ComfyUI IMAGE (B, H, W, C) in [0, 1] -> PIL images."""
    from qwen_edit_core.model.encode import to_pil
    return [to_pil(row) for row in image]


def pils_to_image(images) -> torch.Tensor:
    import numpy as np
    arrays = [np.asarray(img.convert("RGB"), dtype=np.float32) / 255.0 for img in images]
    return torch.from_numpy(np.stack(arrays))


def files_to_image(paths) -> torch.Tensor:
    """PNG files -> IMAGE (all resized to the first one's size); a 64x64 black image when there are none."""
    from PIL import Image
    paths = [p for p in paths if p]
    if not paths:
        return torch.zeros(1, 64, 64, 3)
    first = Image.open(paths[0]).convert("RGB")
    images = [first] + [Image.open(p).convert("RGB").resize(first.size) for p in paths[1:]]
    return pils_to_image(images)


def has_control_after_generate(name: str, spec: tuple) -> bool:
    """Whether ComfyUI's frontend adds a "control after generate" widget after this input (saved workflows
    then store one more widget value): an INT input's explicit `control_after_generate` option, else True
    for inputs named seed or noise_seed (the frontend's rule; comfyui-frontend widgets/useIntWidget)."""
    options = spec[1] if len(spec) > 1 else {}
    if spec[0] != "INT":
        return bool(options.get("control_after_generate"))
    return bool(options.get("control_after_generate", name in ("seed", "noise_seed")))

