"""Ordered reference images in the sampling nodes (Qwen-Image-2.1: up to 10, any sizes) and RGBA output, for a
model whose family takes them (`Family.ordered_references`), sampled through its family's sampler module.

ComfyUI's IMAGE is RGB and a batch holds pictures of one size, so references travel as their own type: the
Reference Images node appends every picture of its IMAGE batch (with its MASK as alpha, ComfyUI's Load Image
convention: mask = 1 - alpha) to the references it is given, and chains for pictures of other sizes. The
Sampler takes its `image` batch and, after it, the chained references. Its output is IMAGE (RGB) plus MASK
(1 - alpha of the decoded picture; zeros where the model decodes no alpha).
"""

from __future__ import annotations

import dataclasses

import torch

from qwen_edit_core.adapters import lora
from qwen_edit_core.common.progress import Cancelled, CancelToken
from qwen_edit_core.families import FAMILIES
from qwen_edit_core.model import encode

from qwen_edit_core.families import variants
from . import comfy_runtime
from .common import CATEGORY, REFERENCES

#: the family taking the most references (the Reference Images chain holds at most its count)
_WIDEST = max((f for f in FAMILIES.values() if f.max_references), key=lambda f: f.max_references)
#: the most references one model takes
MAX_REFERENCES = _WIDEST.max_references


def rgba_pictures(image: torch.Tensor, mask: torch.Tensor | None = None) -> list:
    """An IMAGE batch (B, H, W, 3) in [0, 1] and an optional MASK ((B|1, H, W), 1 = transparent) -> PIL
    pictures, RGBA when a mask is given (alpha = 1 - mask), in batch order."""
    pictures = []
    for i, row in enumerate(image):
        if mask is None:
            pictures.append(encode.as_pil(row[..., :3]))
            continue
        m = mask[min(i, mask.shape[0] - 1)] if mask.ndim == 3 else mask
        if tuple(m.shape) != tuple(row.shape[:2]):
            raise ValueError(f"mask {tuple(m.shape)} and image {tuple(row.shape[:2])} differ in size; give the mask "
                             "Load Image returned with this image (or none)")
        pictures.append(encode.as_pil(torch.cat([row[..., :3], (1 - m.float()).unsqueeze(-1)], dim=-1)))
    return pictures


def split_alpha(images: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, H, W, 3|4) pictures in [0, 1] -> (IMAGE (B, H, W, 3), MASK (B, H, W) = 1 - alpha; zeros without
    alpha), ComfyUI's convention for transparency."""
    if images.shape[-1] == 4:
        return images[..., :3].contiguous(), (1 - images[..., 3]).contiguous()
    return images, torch.zeros(images.shape[:3])


def check_count(references: list, family=_WIDEST) -> list:
    """`references`, or ValueError when `family` takes fewer."""
    if len(references) > family.max_references:
        raise ValueError(f"{len(references)} reference images; {family.file_title} takes at most "
                         f"{family.max_references}: remove some from the image batch or the Reference Images chain")
    return references


def _preview(sampling, latents: torch.Tensor, width: int, height: int):
    """Three latent channels as RGB (no VAE decode per step)."""
    from PIL import Image
    grid = sampling.unpack(latents[:1].float().cpu(), width, height)[0, :3, 0]
    lo, hi = grid.amin(dim=(1, 2), keepdim=True), grid.amax(dim=(1, 2), keepdim=True)
    rgb = ((grid - lo) / (hi - lo + 1e-6) * 255).byte().permute(1, 2, 0).numpy()
    return ("JPEG", Image.fromarray(rgb), 256)


def run(model, prompt: str, references: list, settings, unique_id=None, preview_due=None):
    """Sample a model taking ordered references (the Sampler node's call) with its family's sampler module:
    (IMAGE, LATENT of raw VAE latents, MASK)."""
    from qwen_edit_core import jobs
    comps = model.components
    family = variants.get(comps.variant).family
    sampling = family.stage("sampler")
    jobs.REGISTRY.check_free(comps.transformer, "sample")  # a job may train on this very transformer
    lora.activate(comps.transformer, model.loras)
    settings = dataclasses.replace(settings, attention=model.attention,
                                   cfg_mode="sequential" if settings.do_cfg else settings.cfg_mode)
    cond = sampling.build_conditioning(comps, prompt, check_count(references, family), settings)
    bar = comfy_runtime.progress_bar(len(settings.sigmas or ()) or settings.num_inference_steps, node_id=unique_id)
    token = CancelToken()

    def progress(event):
        due = preview_due is None or preview_due(event.step, event.total)
        preview = _preview(sampling, event.preview, cond.width, cond.height) if due else None
        bar.update_absolute(event.step, event.total, preview)
        if comfy_runtime.interrupt_requested():
            token.cancel()

    try:
        latents = sampling.denoise(comps, cond, settings, progress=progress, cancel=token)
    except Cancelled:
        comfy_runtime.raise_if_interrupted()
        raise
    picture = sampling.decode(comps, latents, cond.width, cond.height)
    grid = sampling.unpack(latents, cond.width, cond.height)
    raw = encode.to_raw_latents(comps.vae, grid.to(next(comps.vae.parameters()).dtype)).float().cpu()
    image, mask = split_alpha(picture)
    return image, {"samples": raw}, mask


class QwenEditReferenceImages:
    """Ordered reference images for Qwen-Image-2.1 (up to 10, any sizes): every picture of the batch, after the
    references given; chain one node per size."""

    CATEGORY = f"{CATEGORY}/sampling"
    SEARCH_ALIASES = ["reference images", "multiple images", "image list", "qwen image 2.1", "references"]
    DESCRIPTION = ("Collects reference images in order for Qwen-Image-2.1 (up to 10, each its own size): every "
                   "picture of the image batch is added after the incoming references. Chain one node per "
                   "picture size, then connect to the Sampler's references (or Save Pair To Dataset's, for "
                   "training pairs).")
    RETURN_TYPES = (REFERENCES,)
    RETURN_NAMES = ("references",)
    FUNCTION = "collect"

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"image": ("IMAGE", {"tooltip": "one picture or a batch of same-size pictures, added "
                                                            "in batch order"})},
                "optional": {"mask": ("MASK", {"tooltip": "transparency from Load Image (1 = transparent): the "
                                                          "references are RGBA (alpha = 1 - mask); none: opaque"}),
                             "references": (REFERENCES, {"tooltip": "references that come first (another Reference "
                                                                    "Images node)"})}}

    def collect(self, image, mask=None, references=None):
        return (tuple(check_count(list(references or ()) + rgba_pictures(image, mask))),)
