"""`qwen-edit bench memory --sample --variant image-2.1`: Qwen-Image-2.1 sampling with its prefix K/V cache,
simulated at real size (bench/memory_sample.py calls `simulate`).

A true-CFG edit (scale 4, negative " ") of a 1024^2 target with `references` references of `side`^2, LoRA r16
loaded, on a card of `card_gib`: the sampler's own `plan_prefix_cache` with the budget the sampler takes on such a
card (90% of its free memory plus the weights, speed.free_memory_budget_gb) and the host memory of a 64 GB machine
(`HOST_BYTES`), then two steps through the sampler's own `branches`: the first fills each branch's cache, the
second reads it (the int8 guard's extra forward is a step like the second). A cache kept in host memory lives in
one region made before tracking (it is not the device's), and each block's copy back is counted where it lands.
"""

from __future__ import annotations

import torch

from qwen_edit_core.bench.fake_model import STAND_IN
from qwen_edit_core.families.qwen_image_21 import fake_model as fake21
from qwen_edit_core.families.qwen_image_21 import prefix_cache
from qwen_edit_core.families.qwen_image_21 import sampler as sampler21
from qwen_edit_core.families.qwen_image_21.encode import PromptWithSlots

#: the host the rows assume: a 64 GB machine, of which the cache may take `prefix_cache.HOST_HEADROOM`
HOST_BYTES = 64 * 10**9
#: the edit's negative prompt: one caption token
NEGATIVE_TOKENS = 1


def _prompt(references: int, side: int, caption_tokens: int, target_slots: int, mode) -> PromptWithSlots:
    slots = torch.cat([fake21.prompt_slots(references, side, caption_tokens),
                       torch.ones(target_slots, dtype=torch.bool)])
    width = fake21.transformer_config(1)["context_in_dim"]
    with mode:
        embeds = torch.empty(1, slots.shape[0] - target_slots, width, dtype=torch.bfloat16, device=STAND_IN)
    return PromptWithSlots(embeds, slots[None])


def conditioning(side: int, references: int, mode) -> sampler21.Conditioning21:
    """The 2.1 sampler's conditioning of the simulated edit: fake embeddings and reference tokens, the real slot
    layout (`fake_model.prompt_slots`) with the target's slots appended, as `build_conditioning` returns it."""
    from qwen_edit_core.model.prompt_length import CAPTION_TOKENS
    grid = side // 16
    target_slots = grid * grid // 4
    with mode:
        refs = torch.empty(1, references * grid * grid, 64, dtype=torch.bfloat16, device=STAND_IN) \
            if references else None
    return sampler21.Conditioning21(
        cond=_prompt(references, side, CAPTION_TOKENS, target_slots, mode),
        uncond=_prompt(references, side, NEGATIVE_TOKENS, target_slots, mode), reference_tokens=refs,
        img_shapes=[(1, grid, grid)] * (references + 1), width=side, height=side)


def simulate(model, mode, tracker, flops, *, side: int, references: int, budget_gb: float):
    """Plan the cache for `budget_gb` and run two tracked CFG steps on the fake `model`; returns the plan and the
    host bytes the cache takes pinned (as on a CUDA device: one region in power-of-two chunks)."""
    from qwen_edit_core.sample.sampler import SampleSettings
    cond = conditioning(side, references, mode)
    settings = SampleSettings(num_inference_steps=2, true_cfg_scale=4.0, negative_prompt=" ",
                              memory_budget_gb=budget_gb)
    n = (side // 16) ** 2
    plan = sampler21.plan_prefix_cache(model, cond, settings, n,
                                       host_budget=int(prefix_cache.HOST_HEADROOM * HOST_BYTES))
    with mode:
        branches = sampler21.branches(model, cond, settings, plan)  # a host region is host memory: not tracked
        latents = torch.empty(1, n, 64, dtype=torch.bfloat16, device=STAND_IN)
        t = torch.ones(1, dtype=torch.bfloat16, device=STAND_IN)
    for branch in branches:
        branch.check = False  # the guard reads a number; its extra forward is the second step's
        if branch.place == "host":
            tracker.keep_off_device(branch.cache.region.chunks)
    with mode, tracker, flops, torch.no_grad():
        hidden = torch.cat([cond.reference_tokens, latents], 1) if references else latents
        for step in range(2):
            preds = [branch(hidden, step, t, cond, n) for branch in branches]
            velocity = preds[1] + 4.0 * (preds[0] - preds[1])
            del preds, velocity
    shape = prefix_cache.cache_shape(model.config, torch.bfloat16)
    return plan, prefix_cache.host_region_bytes(shape, plan.tokens, pin=True) if plan.place == "host" else 0
