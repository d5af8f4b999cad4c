"""The real-size Qwen-Image-2.1 transformer without memory, and one 2.1 training sample's real token layout.

2.1's transformer reads its token layout from the prompt's vision-slot mask on the host (`img_mask`: it expands
each slot to 2x2 latent tokens with `repeat_interleave`, lists the mask with `tolist()` for the rotary positions
and splits the joint sequence into attention segments from it; diffusers 0.42.1 transformer_qwenimage21.py).
Fake tensors cannot answer such data-dependent questions, so the 2.1 simulation runs in `LayoutMode`: a
`FakeTensorMode` in which an operator whose tensor inputs are all real (the slot mask and what is derived from
it: a few hundred kB of indices) runs for real, and every operator that touches a fake tensor (weights,
activations, gradients, optimizer state) stays fake. What the GPU would hold is still counted by `MemTracker`:
the real tensors are on the stand-in device too.

The token counts are the ones `model.encode21` produces for a 2.1 prompt with `n` references at 1024^2: the
2.1 template with the system turn dropped, one "<imageK>" label and one vision slot per 32x32 pixels of each
reference (Qwen3-VL: 16 px patches merged 2x2), the caption, and the target's slots (one per 2x2 latent tokens).
"""

from __future__ import annotations

import json

import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode, unset_fake_temporarily
from torch.utils._pytree import tree_flatten

from qwen_edit_core.families import QWEN_IMAGE_21

#: the 2.1 transformer's architecture entry in the configs the single-file loader matches against
ARCHITECTURE = "qwen-image-2.1"
#: the prompt's text tokens around the vision slots (an assumption for Qwen's BPE, which encodes each special
#: token as one token): "<|im_start|>user\n" (3) before the labels, each reference's "<imageK>" label (4, with
#: the " " separator) and its <|vision_start|>/<|vision_end|> (2), and "<|im_end|>\n<|im_start|>assistant\n" (5)
USER_TOKENS, LABEL_TOKENS, VISION_MARKS, END_TOKENS = 3, 4, 2, 5
#: Qwen3-VL's vision slot: 16 px patches merged 2x2
VL_SLOT_PIXELS = 32


class LayoutMode(FakeTensorMode):
    """`FakeTensorMode` in which operators on real tensors only (the token layout) run for real."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.ops.aten.scalar_tensor.default:  # Python numbers in an operator on the real layout
            with unset_fake_temporarily():
                return func(*args, **kwargs)
        tensors = [a for a in tree_flatten((args, kwargs))[0] if isinstance(a, torch.Tensor)]
        if tensors and not any(isinstance(t, FakeTensor) for t in tensors):
            with unset_fake_temporarily():
                return func(*args, **kwargs)
        return super().__torch_dispatch__(func, types, args, kwargs)


def transformer_config(num_layers: int | None = None) -> dict:
    """The real 2.1 transformer's configuration, as shipped for the loaders
    (`model/architectures/transformer_architectures.json`, entry "qwen-image-2.1": 32 blocks, 4096 wide)."""
    from qwen_edit_core.model import single_file
    config = json.loads(single_file.ARCHITECTURES.read_text())[ARCHITECTURE]
    config = {k: v for k, v in config.items() if not k.startswith("_")}
    if num_layers is not None:
        config["num_layers"] = num_layers
    return config


def build(num_layers: int | None = None):
    """The real-size 2.1 transformer on the `meta` device (no memory), in its diffusers class."""
    from diffusers import QwenImage21Transformer2DModel
    with torch.device("meta"):
        return QwenImage21Transformer2DModel(**transformer_config(num_layers))


def prompt_slots(references: int, side: int, caption_tokens: int) -> torch.Tensor:
    """The vision-slot mask (S,) bool of a prompt with `references` side x side references, as
    `encode21.encode_prompt` returns it (system turn dropped)."""
    slots_per_reference = (side // VL_SLOT_PIXELS) ** 2
    parts = [torch.zeros(USER_TOKENS, dtype=torch.bool)]
    for _ in range(references):
        parts += [torch.zeros(LABEL_TOKENS + 1, dtype=torch.bool), torch.ones(slots_per_reference, dtype=torch.bool),
                  torch.zeros(VISION_MARKS - 1, dtype=torch.bool)]
    parts.append(torch.zeros(caption_tokens + END_TOKENS, dtype=torch.bool))
    return torch.cat(parts)


def text_tokens(side: int, references: int, caption_tokens: int) -> int:
    """The prompt's text tokens in the joint sequence: its length less its vision slots (each slot becomes 2x2 of
    a reference's latent tokens, counted with the image tokens)."""
    slots = prompt_slots(references, side, caption_tokens)
    return int((~slots).sum())


def cache_item(side: int, references: int, caption_tokens: int) -> dict:
    """A real 2.1 cache entry (latents and embeddings, tens of MB) of one side x side pair with `references`
    references of the same size, in the layout `families/qwen_image_21/batch.collate` reads."""
    h = w = side // QWEN_IMAGE_21.vae_scale
    channels, width = QWEN_IMAGE_21.latent_channels, transformer_config(1)["context_in_dim"]
    slots = prompt_slots(references, side, caption_tokens)
    empty = prompt_slots(references, side, 1)
    item = {"target_latents": torch.zeros(channels, 1, h, w),
            "prompt_embeds": torch.zeros(slots.shape[0], width, dtype=torch.bfloat16), "prompt_slots": slots,
            "empty_prompt_embeds": torch.zeros(empty.shape[0], width, dtype=torch.bfloat16),
            "empty_prompt_slots": empty, "img_shapes": torch.tensor([[1, h, w]] * (1 + references))}
    for i in range(references):
        item[f"control_latents_{i}"] = torch.zeros(channels, 1, h, w)
    return item


def fake_batch(batch, mode: FakeTensorMode):
    """A collated 2.1 batch with its latents and embeddings as fake device tensors made by an operator (so the
    tracker counts them); the slot masks stay real (the transformer reads its layout from them)."""
    import dataclasses

    def fake(tensors):
        return [mode.from_tensor(t).clone() for t in tensors]
    return dataclasses.replace(batch, targets=fake(batch.targets), references=fake(batch.references),
                               embeds=fake(batch.embeds))


# -- this family's bench stage (bench/fake_model.py calls these) ----------------------------------------------
#: `bench memory` simulates training only (the measured reference and sampling levers are the 2025 family's)
SAMPLING_SIMULATED = False


def fake_mode() -> LayoutMode:
    """Fake tensors, with operators on the real token layout run for real."""
    return LayoutMode(allow_non_fake_inputs=True)


def real_config(variant: str, num_layers: int | None = None) -> dict:
    """The shipped 2.1 configuration (every variant of this family has it)."""
    del variant
    return transformer_config(num_layers)


def prompt_tokens(variant: str, side: int, controls: int) -> int:
    """The prompt's text tokens with one vision slot per 32x32 pixels of each reference (`text_tokens`)."""
    from qwen_edit_core.model.prompt_length import CAPTION_TOKENS
    del variant
    return text_tokens(side, controls, CAPTION_TOKENS)


def fake_entry(variant: str, side: int, controls: int) -> dict:
    """`cache_item` with a long caption."""
    from qwen_edit_core.model.prompt_length import CAPTION_TOKENS
    del variant
    return cache_item(side, controls, CAPTION_TOKENS)


def default_controls(variant: str) -> int:
    """One reference."""
    del variant
    return 1
