"""One Qwen-Image-2.1 training sample's tensors, encoded exactly as the 2.1 sampler
(families/qwen_image_21/sampler.py) and diffusers' `QwenImage21Pipeline` encode them.

- Each control image of the pair is a 2.1 reference, in the pair's order (1 to 10): resized once to its own
  aspect at the VAE area (`encode21.prepare_references`), or to exactly the target's size for pixel-aligned pairs
  (`data.control_size: target`); that one resized image feeds both the Qwen3-VL encoder (over white) and the VAE.
- The caption and the empty caption of caption dropout (`EMPTY_PROMPT`) are encoded with the same references
  (`encode21.encode_prompt`: the last decoder layer before the final norm, the system turn dropped); each keeps
  its vision-slot mask (`prompt_slots`, `empty_prompt_slots`), which tells the transformer where the references'
  latent tokens go.
- The target is resized to its bucket (the VAE area's `calculate_dimensions`, sides multiples of 32) and encoded
  by the 2.1 VAE (64 channels, 16x, RGBA input: dataset images are RGB, so alpha is opaque).
- `img_shapes` is in latent tokens ([target, control 1, ...], the cache's order; the batch puts the target last
  as the transformer reads it).
"""

from __future__ import annotations

import torch

from qwen_edit_core.data.images import load_rgb
from qwen_edit_core.data.masks import mask_tokens
from qwen_edit_core.model import encode
from qwen_edit_core.families.qwen_image_21 import encode as encode21
from qwen_edit_core.families.templates import EMPTY_PROMPT


def target_pixels(image, width: int, height: int) -> torch.Tensor:
    """(1, 4, 1, H, W) VAE input of the target resized to width x height (RGBA, opaque for RGB images)."""
    return encode21.prepare_references([image], width * height, sizes=[(width, height)]).pixels[0]


@torch.no_grad()
def encode_example(components, example, settings) -> dict[str, torch.Tensor]:
    """The cache tensors of one 2.1 example, on the CPU in `settings.dtype` (slots bool, img_shapes int64)."""
    components.require("vae", "text_encoder")
    target = load_rgb(example.target, convert_modes=settings.convert_modes)
    controls = [load_rgb(p, convert_modes=settings.convert_modes) for p in example.controls]
    try:
        width, height = encode21.reference_size(target, settings.vae_area)
        sizes = [(width, height)] * len(controls) if settings.control_size == "target" else None
        refs = encode21.prepare_references(controls, settings.vae_area, sizes)
        te = components.text_encoder
        drop = encode21.system_tokens(te.processor)
        prompt, empty = (encode21.encode_prompt(te.model, te.processor, text, refs.images, device=te.device, drop=drop)
                         for text in (example.caption, EMPTY_PROMPT))
    except encode.EncodeError as err:
        raise encode.EncodeError(f"pair {example.name!r} (target {str(example.target)!r}): {err}") from None
    tensors = {"target_latents": encode.encode_latents(components.vae, target_pixels(target, width, height))[0],
               "prompt_embeds": prompt.embeds[0], "empty_prompt_embeds": empty.embeds[0]}
    shapes = [encode21.token_grid(width, height)]
    for i, (pixels, (w, h)) in enumerate(zip(refs.pixels, refs.sizes)):
        tensors[f"control_latents_{i}"] = encode.encode_latents(components.vae, pixels)[0]
        shapes.append(encode21.token_grid(w, h))
    tensors = {k: v.to("cpu", settings.dtype).contiguous() for k, v in tensors.items()}
    tensors["prompt_slots"] = prompt.slots[0].cpu()
    tensors["empty_prompt_slots"] = empty.slots[0].cpu()
    tensors["img_shapes"] = torch.tensor(shapes, dtype=torch.int64)
    if example.mask is not None:
        tensors["loss_mask"] = mask_tokens(example.mask, width, height)  # 16 px tokens, as 2025
    return tensors
