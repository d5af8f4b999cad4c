"""Region masks of edit pairs: white marks the edited region, black the rest (`NAME_mask.png` beside the
target, or `masks/NAME.png` in the dataset folder).

A mask becomes per-token loss weights on the target's latent grid: the mask is read as greyscale in [0, 1]
and area-averaged onto the grid of 16x16-pixel tokens of the target's bucket (one token = one 2x2 patch of
8x-downscaled latents), so a token half inside the region gets 0.5. The trainer weights each token's
squared error by `unmasked_weight + (mask_weight - unmasked_weight) * m`.
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from PIL import ImageOps

from qwen_edit_core.data.images import ImageCheck, _decode
from qwen_edit_core.model.geometry import open_bounded

MASKS_DIR = "masks"
_MASK_STEM = re.compile(r"^(?P<base>.+)_mask$", re.IGNORECASE)
#: a mask's aspect ratio may differ from its target's by this fraction (rounding of a scaled copy)
ASPECT_TOLERANCE = 0.02
#: greyscale masks saved as RGB (or JPEG) may differ between channels by this much (of 255)
COLOUR_TOLERANCE = 16
_GREY_MODES = ("1", "L", "LA", "La", "P", "PA", "RGB", "RGBA", "RGBa", "I", "F")
#: pixels per token side: the VAE's 8x downscale times the transformer's 2x2 patch
TOKEN_PIXELS = 16


def split_mask_stems(images: dict[str, Path]) -> tuple[dict[str, Path], dict[str, Path]]:
    """(images that are not masks, {target name: mask path}): `NAME_mask` is a mask when `NAME` is one of the
    other images, so a target that happens to end in `_mask` stays a target."""
    masks, rest = {}, {}
    for stem, path in images.items():
        match = _MASK_STEM.match(stem)
        if match and match["base"] in images:
            masks[match["base"]] = path
        else:
            rest[stem] = path
    return rest, masks


def _grey_array(path: Path) -> tuple[np.ndarray | None, str | None]:
    """The mask as float32 (H, W) in [0, 1] as displayed, or the problem with it."""
    with open_bounded(path, "mask") as img:
        return _grey_of(img)


def _grey_of(img) -> tuple[np.ndarray | None, str | None]:
    """`_grey_array` of an opened (or already decoded) mask picture."""
    img = ImageOps.exif_transpose(img)
    if img.mode not in _GREY_MODES and not img.mode.startswith("I;16"):
        return None, (f"mask mode {img.mode} cannot be read as greyscale; save it as a black-and-white (greyscale) "
                      "PNG, white = the edited region")
    if img.mode in ("I", "F") or img.mode.startswith("I;16"):
        values = np.asarray(img).astype(np.float64)
        top = 65535.0 if img.mode.startswith("I;16") or values.max(initial=0) > 255 else 255.0
        return np.clip(values / top, 0, 1).astype(np.float32), None
    rgb = np.asarray(img.convert("RGB")).astype(np.int16)
    spread = int(np.abs(rgb - rgb.mean(axis=-1, keepdims=True)).max(initial=0))
    if spread > COLOUR_TOLERANCE:
        return None, ("mask has colours, not shades of grey; save it as a black-and-white (greyscale) image, white "
                      "= the edited region")
    return (rgb.mean(axis=-1) / 255.0).astype(np.float32), None


def inspect_mask(path: Path, target_size: tuple[int, int], max_pixels: int = 64_000_000) -> ImageCheck:
    """What is wrong with a mask for a target of `target_size` (w, h, as displayed) as an ImageCheck: the problem,
    or the mask's sha256 and picture (decoded once)."""
    check = _decode(Path(path), max_pixels)
    if check.problem:
        return check
    grey, problem = _grey_of(check.image)
    if problem:
        return ImageCheck(problem=problem)
    (h, w), (tw, th) = grey.shape, target_size
    if abs((w / h) / (tw / th) - 1) > ASPECT_TOLERANCE:
        return ImageCheck(problem=f"mask is {w}x{h}, its aspect differs from its target's {tw}x{th}; accepted: "
                                  "the target's size or a scaled copy of it")
    if float(grey.max(initial=0)) <= 0:
        return ImageCheck(problem="mask is all black (no edited region); paint the edited region white, or "
                                  "remove the mask")
    return check


def mask_tokens(path: Path, width: int, height: int) -> torch.Tensor:
    """Loss-weight fractions (N,) float32 of the target resized to (`width`, `height`): the mask area-averaged
    onto its (height / 16) x (width / 16) token grid, row-major like the packed latents."""
    grey, problem = _grey_array(Path(path))
    if problem:
        raise ValueError(f"{path}: {problem}")
    grid = (height // TOKEN_PIXELS, width // TOKEN_PIXELS)
    pooled = F.interpolate(torch.from_numpy(grey)[None, None], size=grid, mode="area")
    return pooled.reshape(-1).float().contiguous()


def token_weights(fractions: torch.Tensor, mask_weight: float, unmasked_weight: float) -> torch.Tensor:
    """Per-token loss weights: `unmasked_weight` outside the region, `mask_weight` inside, linear between."""
    return unmasked_weight + (mask_weight - unmasked_weight) * fractions.float()
