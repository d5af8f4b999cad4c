"""Qwen-Image-2.1 encoders: reference images, prompt + references -> embeddings with their vision slots, latents.

The exact preprocessing of diffusers' `QwenImage21Pipeline` (diffusers 0.42.1, pipeline_qwenimage21.py), with
the pixel area as a parameter (the pipeline's `output_resolution ** 2`):
- each reference is resized once, at the area for its own aspect ratio (sides rounded to 32 px), as RGBA; the
  VAE reads all four channels, the vision-language encoder sees it composited over white;
- the prompt is "<image1><img> <image2><img> ...{prompt}" in the 2.1 template; the processor tokenizes it with the
  images (one vision slot per 32x32 pixels), the text encoder's last decoder layer is read *before* its final
  norm (transformers 5 ties `hidden_states[-1]` to the normed output; the pipeline hooks the norm away), and the
  system turn's tokens are dropped (their count is the processor's tokenization of the system message);
- `vision_slots` marks which of the kept tokens are vision slots: the transformer puts each reference's latent
  tokens there, 2x2 latent tokens per slot;
- latents are unpatched: (B, 64, 1, h, w) -> (B, h*w, 64), one token per 16x16 pixels.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
from diffusers.image_processor import VaeImageProcessor
from PIL import Image

from qwen_edit_core.families import variants
from qwen_edit_core.model.encode import EncodeError, as_pil
from qwen_edit_core.families import QWEN_IMAGE_21
from qwen_edit_core.model.geometry import calculate_dimensions

#: the pipeline's output sides are floored to this (the VAE's 16x times 2: a vision slot is 2x2 latent tokens)
SIZE_MULTIPLE = QWEN_IMAGE_21.vae_scale * 2
#: latent tokens per vision slot (the transformer expands each slot to 2x2 latent tokens)
TOKENS_PER_SLOT = 4

_IMAGE_PROCESSOR = VaeImageProcessor(vae_scale_factor=QWEN_IMAGE_21.vae_scale,
                                     vae_latent_channels=QWEN_IMAGE_21.latent_channels)


def to_rgba(image) -> Image.Image:
    """A PIL image, or an (H, W, 3|4) array/tensor in [0, 1] or uint8, as an RGBA PIL image (opaque without
    alpha), the mode the pipeline gives every reference before resizing it."""
    image = as_pil(image)
    return image if image.mode == "RGBA" else image.convert("RGBA")


def reference_size(image: Image.Image, area: int) -> tuple[int, int]:
    """(w, h) a reference is resized to: its aspect ratio at `area`, sides rounded to 32 (calculate_dimensions)."""
    width, height = calculate_dimensions(area, image.width / image.height)
    if width < SIZE_MULTIPLE or height < SIZE_MULTIPLE:
        raise EncodeError(f"area {area} gives a {width}x{height} reference for a {image.width}x{image.height} image;"
                          f" each side must be at least {SIZE_MULTIPLE} px: use a larger area")
    return width, height


def output_size(references: Sequence[Image.Image], area: int, width: int | None,
                height: int | None) -> tuple[int, int]:
    """The pipeline's output size: the given sides, else the last reference's aspect at `area` (no reference: the
    square of `area`), floored to multiples of 32."""
    side = int(round(area ** 0.5))
    if references:
        default_w, default_h = calculate_dimensions(area, references[-1].width / references[-1].height)
    else:
        default_w = default_h = side
    w, h = (width or default_w) // SIZE_MULTIPLE * SIZE_MULTIPLE, (height or default_h) // SIZE_MULTIPLE * SIZE_MULTIPLE
    if w < SIZE_MULTIPLE or h < SIZE_MULTIPLE:
        raise EncodeError(f"output size {width or default_w}x{height or default_h} is under {SIZE_MULTIPLE} px on a "
                          "side; give a larger width/height or area")
    return w, h


@dataclass(frozen=True)
class References:
    """Reference images as the pipeline prepares them, in the user's order."""

    #: resized RGBA images (the VL composites them over white)
    images: list[Image.Image]
    #: (1, 4, 1, H, W) float32 VAE inputs in [-1, 1], one per reference
    pixels: list[torch.Tensor]
    #: (w, h) of each
    sizes: list[tuple[int, int]]


def prepare_references(images: Sequence, area: int, sizes: Sequence[tuple[int, int]] | None = None) -> References:
    """Resize each reference once to its size at `area` (or the given `sizes`); the same resized image feeds the VL
    and the VAE."""
    rgba = [to_rgba(img) for img in images]
    if len(rgba) > QWEN_IMAGE_21.max_references:
        raise EncodeError(f"{QWEN_IMAGE_21.title} takes at most {QWEN_IMAGE_21.max_references} reference images, "
                          f"got {len(rgba)}")
    sizes = [tuple(s) for s in sizes] if sizes is not None else [reference_size(img, area) for img in rgba]
    resized = [_IMAGE_PROCESSOR.resize(img, width=w, height=h) for img, (w, h) in zip(rgba, sizes)]
    pixels = [_IMAGE_PROCESSOR.preprocess(img, width=w, height=h).unsqueeze(2) for img, (w, h) in zip(rgba, sizes)]
    return References(resized, pixels, list(sizes))


def over_white(image: Image.Image) -> Image.Image:
    """An RGBA image composited over white (what the VL encoder was trained to see); other modes unchanged."""
    if image.mode != "RGBA":
        return image
    white = Image.new("RGB", image.size, (255, 255, 255))
    white.paste(image, mask=image.getchannel("A"))
    return white


def system_tokens(processor) -> int:
    """Tokens of the system turn that the pipeline drops: the processor's chat template applied to the system
    message alone (`QwenImage21Pipeline._drop_idx`)."""
    from qwen_edit_core.families import templates
    message = [{"role": "system", "content": [{"type": "text", "text": templates.QWEN21_SYSTEM}]}]
    return len(processor.apply_chat_template(message, tokenize=True, return_dict=False)[0])


@dataclass(frozen=True)
class PromptWithSlots:
    """One prompt's embeddings (1, S, D) after the system turn, and its vision-slot mask (1, S) bool."""

    embeds: torch.Tensor
    slots: torch.Tensor


@torch.no_grad()
def encode_prompt(text_encoder, processor, prompt: str, references: Sequence[Image.Image], *,
                  device: torch.device, drop: int | None = None) -> PromptWithSlots:
    """Encode `prompt` with its (resized) references as the pipeline does for one prompt."""
    variant = variants.IMAGE_21
    text, _ = variant.format_prompt(prompt or " ", len(references))
    kwargs = {"text": [text], "padding": True, "padding_side": "left", "return_tensors": "pt"}
    if references:
        kwargs["images"] = [over_white(img) for img in references]
    inputs = processor(**kwargs).to(device)
    forward = {"input_ids": inputs.input_ids, "attention_mask": inputs.attention_mask, "output_hidden_states": True}
    if references:
        forward.update(pixel_values=inputs.pixel_values, image_grid_thw=inputs.image_grid_thw)
    if "mm_token_type_ids" in inputs:
        forward["mm_token_type_ids"] = inputs.mm_token_type_ids
    language = getattr(text_encoder.model, "language_model", text_encoder.model)
    # The last decoder layer's output before the final norm, as the transformer was trained on it.
    handle = language.norm.register_forward_hook(lambda module, args, output: args[0])
    try:
        hidden = text_encoder(**forward).hidden_states[-1]
    finally:
        handle.remove()
    drop = system_tokens(processor) if drop is None else drop
    valid = inputs.attention_mask[0].bool()
    embeds = hidden[0][valid][drop:]
    slots = (inputs.input_ids[0][valid] == processor.tokenizer.convert_tokens_to_ids("<|image_pad|>"))[drop:]
    return PromptWithSlots(embeds.unsqueeze(0), slots.unsqueeze(0))


def pack(latents: torch.Tensor) -> torch.Tensor:
    """(B, C, 1, h, w) latents -> (B, h*w, C) tokens: 2.1's transformer reads latents unpatched."""
    b, c, _, h, w = latents.shape
    return latents.reshape(b, c, h * w).transpose(1, 2)


def unpack(tokens: torch.Tensor, width: int, height: int) -> torch.Tensor:
    """(B, h*w, C) tokens of a width x height image -> (B, C, 1, h, w) latents."""
    b, _, c = tokens.shape
    scale = QWEN_IMAGE_21.vae_scale
    return tokens.transpose(1, 2).reshape(b, c, 1, height // scale, width // scale)


def token_grid(width: int, height: int) -> tuple[int, int, int]:
    """The (frames, rows, cols) `img_shapes` entry of an image of width x height pixels."""
    return 1, height // QWEN_IMAGE_21.vae_scale, width // QWEN_IMAGE_21.vae_scale


def vae_pixels(image, area: int) -> torch.Tensor:
    """(1, 4, 1, H, W) RGBA VAE input of `image` sized as the 2.1 pipeline sizes a reference at `area`."""
    return prepare_references([image], area).pixels[0]
