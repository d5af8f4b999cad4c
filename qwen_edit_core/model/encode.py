"""Encoding steps every model family shares: images in and out (PIL, arrays, files, sizes at a pixel area, the
pipelines' resize and VAE input), prompt embeddings padded into a batch, image <-> normalized latents.

These are the exact preprocessing steps of the diffusers pipelines, with the pixel areas as parameters, so
training, caching and sampling all see the same inputs. A family's own steps (its prompt template, control or
reference layout, latent tokens) are its encode stage (families/<family>/encode.py). Every function takes the
component it runs and moves inputs to that component's device.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch
from diffusers.image_processor import VaeImageProcessor
from PIL import Image

from qwen_edit_core.model.geometry import calculate_dimensions, open_bounded
from qwen_edit_core.families.templates import MAX_SEQUENCE_LENGTH

#: pixels per transformer token along each side (`Family.token_pixels`, the same in every family): image sides
#: must be multiples of this.
LATENT_MULTIPLE = 16

# The pipelines' image processor (resize with Lanczos, normalize to [-1, 1]); stateless, so one instance.
_IMAGE_PROCESSOR = VaeImageProcessor(vae_scale_factor=LATENT_MULTIPLE)


class EncodeError(ValueError):
    """An input the encoders cannot take; the message names it and what is accepted."""


def as_pil(image) -> Image.Image:
    """A PIL image as it is, or an (H, W, 3|4) array/tensor in [0, 1] (ComfyUI's IMAGE row) or uint8 as an RGB or
    RGBA PIL image (alpha kept); what `to_pil` converts."""
    if isinstance(image, Image.Image):
        return image
    if isinstance(image, torch.Tensor):
        image = image.detach().to("cpu", torch.float32).numpy()
    if isinstance(image, np.ndarray):
        if image.ndim == 4 and image.shape[0] == 1:
            image = image[0]
        if image.ndim != 3 or image.shape[-1] not in (3, 4):
            raise EncodeError(f"image array must be (H, W, 3) or (H, W, 4), got shape {tuple(image.shape)}")
        if image.dtype != np.uint8:
            image = (np.clip(image, 0.0, 1.0) * 255.0).round().astype(np.uint8)
        return Image.fromarray(image)
    raise EncodeError(f"expected a PIL image, numpy array or torch tensor, got {type(image).__name__}")


def to_pil(image, mode: str = "RGB") -> Image.Image:
    """Accept a PIL image, an (H, W, 3|4) array/tensor in [0, 1] (ComfyUI's IMAGE row) or uint8; return a PIL image
    in `mode` ("RGB"; the 2.1 encoder's references: "RGBA", opaque without alpha)."""
    image = as_pil(image)
    return image if image.mode == mode else image.convert(mode)


def image_size_at_area(image: Image.Image, area: int, minimum: int = LATENT_MULTIPLE,
                       what: str = "image") -> tuple[int, int]:
    """(width, height) the pipelines resize `image` to for a pixel area: its aspect ratio at `area`, sides rounded to
    32 (calculate_dimensions); refuses a side under `minimum` px (one latent patch), naming the input `what`."""
    width, height = calculate_dimensions(area, image.width / image.height)
    if width < minimum or height < minimum:
        raise EncodeError(f"area {area} gives {width}x{height} for a {image.width}x{image.height} {what}; each side "
                          f"must be at least {minimum} px: use a larger area")
    return width, height


def resize(image: Image.Image, width: int, height: int) -> Image.Image:
    """Lanczos resize exactly as the pipelines' VaeImageProcessor.resize."""
    return _IMAGE_PROCESSOR.resize(image, height, width)


def pixels_for_vae(image: Image.Image, width: int, height: int) -> torch.Tensor:
    """(1, 3, 1, H, W) float32 in [-1, 1]: the VAE input the pipelines build for a control image."""
    return _IMAGE_PROCESSOR.preprocess(image, height, width).unsqueeze(2)


def postprocess(pixels: torch.Tensor) -> torch.Tensor:
    """VAE output (B, 3, H, W) in [-1, 1] -> (B, H, W, 3) float32 in [0, 1] (ComfyUI's IMAGE layout)."""
    return (pixels.float() / 2 + 0.5).clamp(0, 1).permute(0, 2, 3, 1).contiguous()


@dataclass(frozen=True)
class PromptEmbeds:
    """Right-padded prompt embeddings (B, S, D), a 0/1 mask (B, S) and each sample's valid token count.

    `lengths` is a host-side fact (from the unpadded inputs, or read once from the mask when not given), so
    deciding whether a call needs the mask never reads the device in the denoising or training loop.
    """

    embeds: torch.Tensor
    mask: torch.Tensor
    lengths: tuple[int, ...] = ()

    def __post_init__(self):
        if not self.lengths:
            object.__setattr__(self, "lengths", tuple(int(n) for n in self.mask.sum(dim=1).tolist()))

    def mask_or_none(self) -> torch.Tensor | None:
        """The mask, or None when nothing is padded, so attention stays on the fused kernels."""
        return None if all(n == self.mask.shape[1] for n in self.lengths) else self.mask

    def valid(self, b: int) -> torch.Tensor:
        """Sample b's valid (S_b, D) embeddings (a slice: no device read)."""
        return self.embeds[b, : self.lengths[b]]

    def padded(self, multiple: int) -> "PromptEmbeds":
        """The same prompts right-padded (with the mask) to a multiple of `multiple` tokens; itself when its
        length already is one. Padded tokens are masked out of attention, so the model's output is the same."""
        if self.embeds.shape[1] % multiple == 0:
            return self
        return pad_embeddings([self.valid(b) for b in range(len(self.lengths))], multiple)

    def to(self, device: torch.device, dtype: torch.dtype | None = None) -> "PromptEmbeds":
        return PromptEmbeds(self.embeds.to(device=device, dtype=dtype or self.embeds.dtype), self.mask.to(device),
                            self.lengths)


def pad_embeddings(items: Sequence[torch.Tensor], multiple: int = 1) -> PromptEmbeds:
    """Stack per-sample (S_i, D) valid-token embeddings into (B, S, D) with a right-padding 0/1 mask; S is the
    longest S_i rounded up to a multiple of `multiple` (text-length buckets keep compiled shapes few)."""
    lengths = tuple(item.shape[0] for item in items)
    longest = -(-max(lengths) // multiple) * multiple
    embeds = torch.stack([torch.cat([e, e.new_zeros(longest - e.shape[0], e.shape[1])]) for e in items])
    mask = torch.stack([torch.cat([torch.ones(n, dtype=torch.long), torch.zeros(longest - n, dtype=torch.long)])
                        for n in lengths])
    return PromptEmbeds(embeds, mask.to(embeds.device), lengths)


def check_prompt_lengths(processor, prompts: Sequence[str], max_tokens: int = MAX_SEQUENCE_LENGTH) -> None:
    """EncodeError when a prompt's own text is more than `max_tokens` tokens of the processor's tokenizer (the
    count the dataset's caption check makes). The control images' vision tokens are not counted: they come on
    top (1,369 for one control at 1 MP), as in diffusers' edit pipelines, which truncate nothing."""
    for i, prompt in enumerate(prompts):
        tokens = len(processor.tokenizer(prompt, add_special_tokens=False, verbose=False)["input_ids"])
        if tokens > max_tokens:
            raise EncodeError(f"prompt {i} is {tokens} tokens; the text encoder takes at most {max_tokens}: "
                              "shorten the prompt")


@torch.no_grad()
def encode_latents(vae, pixels: torch.Tensor) -> torch.Tensor:
    """(B, 3, 1, H, W) in [-1, 1] -> normalized latents (B, 16, 1, H/8, W/8): distribution mode, then
    (z - latents_mean) / latents_std, on the VAE's device and dtype."""
    param = next(vae.parameters())
    z = vae.encode(pixels.to(param.device, param.dtype)).latent_dist.mode()
    mean, std = _latent_stats(vae, z)
    return (z - mean) / std


@torch.no_grad()
def decode_latents(vae, latents: torch.Tensor) -> torch.Tensor:
    """Normalized latents (B, 16, 1, h, w) -> pixels (B, 3, H, W) in [-1, 1]."""
    param = next(vae.parameters())
    latents = latents.to(param.device, param.dtype)
    mean, std = _latent_stats(vae, latents)
    return vae.decode(latents * std + mean, return_dict=False)[0][:, :, 0]


def to_raw_latents(vae, latents: torch.Tensor) -> torch.Tensor:
    """Normalized latents -> the VAE's own (raw) latents, z * latents_std + latents_mean: what ComfyUI keeps
    in a LATENT's "samples" for Qwen-Image (its VAEEncode returns the raw latent; the model's latent format,
    Wan21 in ComfyUI's comfy/latent_formats.py, normalizes inside sampling)."""
    mean, std = _latent_stats(vae, latents)
    return latents * std + mean


def from_raw_latents(vae, raw: torch.Tensor) -> torch.Tensor:
    """The VAE's raw latents (a ComfyUI LATENT's "samples", (B, 16, 1, h, w) or (B, 16, h, w)) -> normalized
    latents (B, 16, 1, h, w)."""
    if raw.ndim == 4:
        raw = raw.unsqueeze(2)
    if raw.ndim != 5 or raw.shape[1] != vae.config.z_dim or raw.shape[2] != 1:
        raise EncodeError(f"LATENT samples of shape {tuple(raw.shape)}: expected (batch, {vae.config.z_dim}, 1, "
                          "height/8, width/8) from a Qwen-Image VAE (VAE Encode with the Qwen-Image VAE)")
    mean, std = _latent_stats(vae, raw)
    return (raw - mean) / std


def _latent_stats(vae, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    channels = vae.config.z_dim
    mean = torch.tensor(vae.config.latents_mean).view(1, channels, 1, 1, 1).to(like.device, like.dtype)
    std = torch.tensor(vae.config.latents_std).view(1, channels, 1, 1, 1).to(like.device, like.dtype)
    return mean, std


def open_image(path, keep_alpha: bool = False) -> Image.Image:
    """Open an image file as RGB (RGBA when it has transparency and `keep_alpha`: Qwen-Image-2.1 reads alpha) with
    its EXIF orientation applied; errors name the file."""
    from pathlib import Path

    from PIL import ImageOps, UnidentifiedImageError

    path = Path(path)
    if not path.is_file():
        raise EncodeError(f"image {str(path)!r} does not exist")
    try:
        with open_bounded(path) as img:
            img.load()
            img = ImageOps.exif_transpose(img)
            alpha = img.mode in ("RGBA", "LA", "PA") or "transparency" in img.info
            return img.convert("RGBA" if keep_alpha and alpha else "RGB")
    except (UnidentifiedImageError, OSError) as err:
        raise EncodeError(f"{str(path)!r} is not a readable image (png, jpg or webp expected): {err}") from None
