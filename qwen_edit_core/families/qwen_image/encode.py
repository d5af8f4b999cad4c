"""The 2025 Qwen-Image family's encoding (Edit, Edit Plus): control images as the pipelines prepare them, prompts
through the variant's template with the control images' vision tokens, latents packed in 2x2 patches.

These are the exact steps of diffusers' Qwen-Image-Edit pipelines, with the pixel areas as parameters (the
pipelines hard-code 1024*1024 and 384*384); model/encode.py holds the steps every family shares.
"""

from __future__ import annotations

from typing import Sequence

import torch
from PIL import Image

from qwen_edit_core.families import variants
from qwen_edit_core.families.templates import MAX_SEQUENCE_LENGTH
from qwen_edit_core.model import encode
from qwen_edit_core.model.encode import (LATENT_MULTIPLE, EncodeError, check_prompt_lengths, image_size_at_area,
                                         pixels_for_vae, resize)

#: the VAE's 8x spatial downscale
VAE_SCALE = 8


def prepare_controls(images: Sequence[Image.Image], variant: str, *, vae_area: int, vl_area: int,
                     sizes: Sequence[tuple[int, int]] | None = None):
    """Control images as the pipelines prepare them: (VL images, VAE pixels, VAE sizes (w, h)).

    Edit (`vl_own_area` False) resizes once to the VAE area and feeds that same image to the VL and the VAE; Edit
    Plus resizes each image to `vl_area` for the VL and to `vae_area` for the VAE. Training and sampling both call
    this, so they see the same inputs. `sizes` ((w, h) per control, multiples of 16) replaces the VAE-area sizing:
    pixel-aligned pairs resize every control to exactly the target's size (`control_size: target`).
    """
    if not images:
        raise EncodeError("at least one control image is required")
    spec = variants.get(variant)
    if spec.max_controls is not None and len(images) > spec.max_controls:
        raise EncodeError(f"a {spec.title} model takes {spec.controls_text()}, got {len(images)}; "
                          + ("use an Edit Plus (2509/2511) model for several" if spec.max_controls == 1
                             else spec.more_controls_hint()))
    vae_sizes = [tuple(s) for s in sizes] if sizes is not None else [image_size_at_area(img, vae_area)
                                                                     for img in images]
    if not spec.vl_own_area:
        resized = resize(images[0], *vae_sizes[0])
        return [resized], [pixels_for_vae(resized, *vae_sizes[0])], vae_sizes
    vl_images = [resize(img, *image_size_at_area(img, vl_area)) for img in images]
    return vl_images, [pixels_for_vae(img, *size) for img, size in zip(images, vae_sizes)], vae_sizes


@torch.no_grad()
def encode_prompts(text_encoder, processor, prompts: Sequence[str], images: Sequence[Sequence[Image.Image]],
                   variant: str, *, device: torch.device, dtype: torch.dtype | None = None,
                   max_tokens: int = MAX_SEQUENCE_LENGTH) -> list[torch.Tensor]:
    """Encode each prompt with its VL-sized control image(s); return per-sample (S_i, D) valid embeddings.

    The template prefix is dropped (64 tokens for Edit and Edit Plus), as the pipelines do. Images must
    already be resized for the VL (`resize(image, *image_size_at_area(image, area))`).
    """
    if len(prompts) != len(images):
        raise EncodeError(f"{len(prompts)} prompts but {len(images)} image lists")
    if variants.get(variant).drop is None:
        raise EncodeError(f"{variants.get(variant).title} prompts are encoded with their reference images' vision "
                          "slots (families/qwen_image_21/encode.py, used by the sampler); this encoder is the 2025 "
                          "family's")
    check_prompt_lengths(processor, prompts, max_tokens)
    texts, drops = zip(*(variants.get(variant).format_prompt(p, len(imgs)) for p, imgs in zip(prompts, images)))
    flat = [img for imgs in images for img in imgs]
    inputs = processor(text=list(texts), images=flat or None, padding=True, return_tensors="pt").to(device)
    out = text_encoder(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"],
                       pixel_values=inputs.get("pixel_values"), image_grid_thw=inputs.get("image_grid_thw"),
                       output_hidden_states=True)
    hidden = out.hidden_states[-1]
    valid = inputs["attention_mask"].bool()
    result = []
    for i, drop in enumerate(drops):
        sample = hidden[i][valid[i]][drop:]
        result.append(sample.to(dtype or sample.dtype))
    return result


def pack(latents: torch.Tensor) -> torch.Tensor:
    """(B, C, 1, h, w) latents -> (B, h/2 * w/2, C*4) tokens (2x2 patches), the transformer's layout."""
    b, c, _, h, w = latents.shape
    x = latents.view(b, c, h // 2, 2, w // 2, 2).permute(0, 2, 4, 1, 3, 5)
    return x.reshape(b, (h // 2) * (w // 2), c * 4)


def unpack(tokens: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """(B, N, C*4) tokens of an image of `height` x `width` pixels -> (B, C, 1, H/8, W/8) latents."""
    b, _, c4 = tokens.shape
    h, w = height // VAE_SCALE, width // VAE_SCALE
    x = tokens.view(b, h // 2, w // 2, c4 // 4, 2, 2).permute(0, 3, 1, 4, 2, 5)
    return x.reshape(b, c4 // 4, 1, h, w)


def packed_shape(width: int, height: int) -> tuple[int, int, int]:
    """The (frames, rows, cols) entry of `img_shapes` for an image of width x height pixels."""
    return 1, height // LATENT_MULTIPLE, width // LATENT_MULTIPLE


def vae_pixels(image, area: int) -> torch.Tensor:
    """(1, 3, 1, H, W) VAE input of `image` resized to its aspect at `area` (sides multiples of 32), as the
    pipelines size a control image."""
    pil = encode.to_pil(image)
    return encode.pixels_for_vae(pil, *encode.image_size_at_area(pil, area))
