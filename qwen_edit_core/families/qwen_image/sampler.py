"""The 2025 Qwen-Image family's sampling: sample/sampler.py's Euler/CFG driver as it is (controls after the
target's packed tokens, CFG rescaled per token), and a cache entry as its conditioning (validation previews)."""

from __future__ import annotations

import torch

from qwen_edit_core.model import encode
from qwen_edit_core.sample.sampler import Conditioning, build_conditioning, decode, denoise  # noqa: F401 - stage functions
from qwen_edit_core.sample.sampler import sample_packed as sample  # noqa: F401


def check_settings(settings) -> None:
    """Every sampler setting applies to this family: nothing to refuse."""
    del settings


def pack(latents: torch.Tensor) -> torch.Tensor:
    """Latents (B, C, 1, h, w) -> the transformer's tokens (B, h/2 * w/2, 4C)."""
    return encode.pack(latents)


def unpack(tokens: torch.Tensor, width: int, height: int) -> torch.Tensor:
    """Tokens of a `width` x `height` image -> latents (B, C, 1, h, w)."""
    return encode.unpack(tokens, height, width)


def conditioning_from_entry(tensors: dict, device, dtype) -> Conditioning:
    """Sampler conditioning from a cache entry: the caption's embeddings, the empty caption as negative."""
    shapes = [tuple(s) for s in tensors["img_shapes"].tolist()]
    n = len(shapes) - 1
    control = torch.cat([encode.pack(tensors[f"control_latents_{i}"][None]) for i in range(n)], dim=1)
    _, rows, cols = shapes[0]
    return Conditioning(cond=encode.pad_embeddings([tensors["prompt_embeds"]]).to(device, dtype),
                        uncond=encode.pad_embeddings([tensors["empty_prompt_embeds"]]).to(device, dtype),
                        control_tokens=control.to(device, dtype), img_shapes=shapes,
                        width=cols * encode.LATENT_MULTIPLE, height=rows * encode.LATENT_MULTIPLE)
