"""The 2025 Qwen-Image family in the real-size simulator (bench/fake_model.py): its real configuration, prompt
length, a cache entry of its layout and its batch as fake tensors."""

from __future__ import annotations

import dataclasses

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from qwen_edit_core.families import variants
from qwen_edit_core.model import prompt_length

#: `bench memory` simulates this family's sampling levers too
SAMPLING_SIMULATED = True


def fake_mode() -> FakeTensorMode:
    """Every tensor fake; real CPU inputs taken as constants."""
    return FakeTensorMode(allow_non_fake_inputs=True)


def real_config(variant: str, num_layers: int | None = None) -> dict:
    """The real transformer configuration of `variant` (zero_cond_t for Edit-2511)."""
    from qwen_edit_core.families.qwen_image.tiny import transformer_config
    cfg = transformer_config("real", num_layers=num_layers)
    if variants.get(variant).zero_cond_t:
        cfg["zero_cond_t"] = True
    return cfg


def prompt_tokens(variant: str, side: int, controls: int) -> int:
    """As the planner counts them (model/prompt_length.py: Edit 1,369 vision tokens at 1024^2, Edit Plus 196 per
    control, plus a caption)."""
    return prompt_length.prompt_tokens(variant, [(side, side)] * controls)


def fake_entry(variant: str, side: int, controls: int) -> dict:
    """A real cache entry (zeros) of one side x side pair with `controls` controls of the same size."""
    h = w = side // 8
    n_text = prompt_tokens(variant, side, controls)
    item = {"target_latents": torch.zeros(16, 1, h, w),
            "prompt_embeds": torch.zeros(n_text, 3584, dtype=torch.bfloat16),
            "empty_prompt_embeds": torch.zeros(n_text - prompt_length.CAPTION_TOKENS + 1, 3584, dtype=torch.bfloat16),
            "img_shapes": torch.tensor([[1, h // 2, w // 2]] * (1 + controls))}
    for i in range(controls):
        item[f"control_latents_{i}"] = torch.zeros(16, 1, h, w)
    return item


def fake_batch(batch, mode: FakeTensorMode):
    """The batch's latents copied by an operator under the fake mode (so the tracker counts them)."""
    del mode
    return dataclasses.replace(batch, targets=[t.clone() for t in batch.targets],
                               controls=[t.clone() for t in batch.controls])


def default_controls(variant: str) -> int:
    """One control for Edit, two for Edit Plus and 2511."""
    return 1 if variants.get(variant).max_controls == 1 else 2
