"""One 2025 Qwen-Image training sample's tensors (`data.example_tensors.encode_example` for this family), encoded
exactly as this family's sampler (its sampler.py) encodes a request: control images preprocessed by
its `encode.prepare_controls`, the caption and the empty caption of caption dropout encoded with them, latents
packed in 2x2 patches (`img_shapes` in patches: [target, control 1, ...])."""

from __future__ import annotations

import torch

from qwen_edit_core.data.images import load_rgb
from qwen_edit_core.data.masks import mask_tokens
from qwen_edit_core.families.qwen_image import encode as family_encode
from qwen_edit_core.model import encode
from qwen_edit_core.families.templates import EMPTY_PROMPT


@torch.no_grad()
def encode_example(components, example, settings) -> dict[str, torch.Tensor]:
    """The cache tensors of one example, on the CPU in `settings.dtype`.

    Control images are preprocessed by this family's `encode.prepare_controls`, as in sampling; the target is resized to
    its own bucket. `empty_prompt_embeds` (`EMPTY_PROMPT`, same control images) serve caption dropout. A pair
    with a mask adds `loss_mask`: the mask area-averaged onto the target's token grid (float32).
    """
    components.require("vae", "text_encoder")
    target = load_rgb(example.target, convert_modes=settings.convert_modes)
    controls = [load_rgb(p, convert_modes=settings.convert_modes) for p in example.controls]
    target_size = encode.image_size_at_area(target, settings.vae_area)
    sizes = [target_size] * len(controls) if settings.control_size == "target" else None
    vl_images, control_pixels, _ = family_encode.prepare_controls(controls, settings.variant,
                                                                  vae_area=settings.vae_area,
                                                                  vl_area=settings.vl_area, sizes=sizes)
    te = components.text_encoder
    try:
        prompt, empty = family_encode.encode_prompts(te.model, te.processor, [example.caption, EMPTY_PROMPT],
                                              [vl_images, vl_images], settings.variant, device=te.device)
    except encode.EncodeError as err:
        raise encode.EncodeError(f"pair {example.name!r} (target {str(example.target)!r}): "
                                 f"{str(err).replace('prompt 0', 'its caption')}") from None
    tensors = {"target_latents": encode.encode_latents(components.vae, encode.pixels_for_vae(target,
                                                                                            *target_size))[0],
               "prompt_embeds": prompt, "empty_prompt_embeds": empty}
    shapes = [family_encode.packed_shape(*target_size)]
    for i, pixels in enumerate(control_pixels):
        tensors[f"control_latents_{i}"] = encode.encode_latents(components.vae, pixels)[0]
        shapes.append(family_encode.packed_shape(pixels.shape[-1], pixels.shape[-2]))
    tensors = {k: v.to("cpu", settings.dtype).contiguous() for k, v in tensors.items()}
    tensors["img_shapes"] = torch.tensor(shapes, dtype=torch.int64)
    if example.mask is not None:
        tensors["loss_mask"] = mask_tokens(example.mask, *target_size)
    return tensors
