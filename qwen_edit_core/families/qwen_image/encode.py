"""How the 2025 Qwen-Image family turns an image into its VAE's input (model/encode.py holds the rest of its
encoding, which the stages call directly)."""

from __future__ import annotations

import torch

from qwen_edit_core.model import encode


def vae_pixels(image, area: int) -> torch.Tensor:
    """(1, 3, 1, H, W) VAE input of `image` resized to its aspect at `area` (sides multiples of 32), as the
    pipelines size a control image."""
    pil = encode.to_pil(image)
    return encode.pixels_for_vae(pil, *encode.image_size_at_area(pil, area))
