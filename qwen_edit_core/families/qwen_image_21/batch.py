"""One Qwen-Image-2.1 micro-step's maths: cache tensors -> a batch (with dropout) -> one prediction per sample.

How 2.1's transformer (diffusers `QwenImage21Transformer2DModel`) is called for training, read from diffusers
0.42.1 transformer_qwenimage21.py and pipeline_qwenimage21.py:
- `hidden_states` is [reference 1 | ... | reference n | target] unpatched latent tokens; `img_shapes` lists them
  in the same order (target last) in latent tokens; `img_mask` is the prompt's vision-slot mask followed by one
  slot per 2x2 target tokens; each slot is expanded to 4 tokens and filled with the latents in order, so the
  references sit inside the text sequence and the target comes last;
- attention is block-causal (causal over the joint sequence, bidirectional inside each image block) and, with
  `causal_condition`, text and reference tokens are modulated at t = 0 and only the target's at the sampled
  timestep (`timestep` is the sigma, the pipeline's t / 1000); no K/V cache in training (one full pass);
- the output covers the joint sequence: the target's predictions are its last tokens.
The transformer reads one token layout per call (`img_mask[0]`, `img_shapes[0]`), so samples are grouped by
layout (identical slot masks and image shapes) and each group is one call: a batch with different captions or
reference counts is exactly its samples one by one. The noise, sigma and dropout draws are the 2025 path's
(train.batch), from the sample's own generator, so determinism, resume and data parallel carry over unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch

from qwen_edit_core.families import QWEN_IMAGE_21, Family
from qwen_edit_core.families.qwen_image_21 import encode as encode21
from qwen_edit_core.families.qwen_image_21.encode import TOKENS_PER_SLOT


@dataclass(frozen=True)
class TrainBatch21:
    """A 2.1 batch on the transformer's device, per sample: target tokens (N_t, 64) float32, reference tokens
    (N_r, 64) in the model's dtype, prompt embeddings (S, D), the joint slot mask (S + N_t / 4,) bool, the
    [references..., target] shapes, its generator and its mask's per-token fractions (or None)."""

    targets: list[torch.Tensor]
    references: list[torch.Tensor]
    embeds: list[torch.Tensor]
    slots: list[torch.Tensor]
    img_shapes: list[list[tuple[int, int, int]]]
    generators: list[torch.Generator]
    loss_masks: list[torch.Tensor | None] = field(default_factory=list)
    #: per sample: its token layout (image shapes and slot mask), read on the CPU before the batch moved
    layouts: list[tuple] = field(default_factory=list)
    #: the model family whose `predict` runs it
    family: Family = QWEN_IMAGE_21


def collate(items: Sequence[dict], generators: Sequence[torch.Generator], *, caption_dropout: float,
            control_dropout: float, device: torch.device, dtype: torch.dtype) -> TrainBatch21:
    """Per-sample 2.1 cache tensors -> a batch. Caption dropout swaps in the empty caption's embeddings and slot
    mask (encoded with the same references); control dropout zeroes the reference latents. The two draws come
    from the sample's generator in the 2025 path's order."""
    targets, refs, embeds, slots, shapes, masks, layouts = [], [], [], [], [], [], []
    for item, gen in zip(items, generators):
        drop_caption = torch.rand((), generator=gen).item() < caption_dropout
        drop_control = torch.rand((), generator=gen).item() < control_dropout
        prefix = "empty_prompt" if drop_caption else "prompt"
        stored = [tuple(int(v) for v in s) for s in item["img_shapes"].tolist()]  # [target, controls...]
        tokens = [encode21.pack(item[f"control_latents_{i}"][None])[0] for i in range(len(stored) - 1)]
        ref = torch.cat(tokens) if tokens else item["target_latents"].new_zeros(0, item["target_latents"].shape[0])
        target = encode21.pack(item["target_latents"][None])[0]
        refs.append((torch.zeros_like(ref) if drop_control else ref).to(device, dtype))
        targets.append(target.to(device, torch.float32))
        embeds.append(item[f"{prefix}_embeds"].to(device, dtype))
        n_slots = target.shape[0] // TOKENS_PER_SLOT
        mask = torch.cat([item[f"{prefix}_slots"].cpu().bool(), torch.ones(n_slots, dtype=torch.bool)])
        shapes.append(stored[1:] + stored[:1])
        layouts.append((tuple(shapes[-1]), mask.shape[0], bytes(mask.to(torch.uint8).numpy())))
        slots.append(mask.to(device))
        masks.append(item["loss_mask"].to(device, torch.float32) if "loss_mask" in item else None)
    return TrainBatch21(targets, refs, embeds, slots, shapes, list(generators), masks, layouts)


def layout_groups(batch: TrainBatch21) -> list[list[int]]:
    """Sample indices grouped by token layout (slot mask and image shapes), in order of first appearance."""
    groups: dict[tuple, list[int]] = {}
    for j, layout in enumerate(batch.layouts):
        groups.setdefault(layout, []).append(j)
    return list(groups.values())


def predict(transformer, batch: TrainBatch21, config, scheduler_config: dict):
    """One forward per token layout at each sample's sampled sigma: (prediction (B, n_max, 64), velocity target
    (same), token mask (B, n_max) or None when every target has n_max tokens, sigmas (B,)), as train.batch.predict
    returns them (so `flow_loss` and `region_losses` take either)."""
    from qwen_edit_core.train.batch import _padded, noised_targets
    noisy, velocities, sigmas = noised_targets(batch.targets, batch.generators, batch.embeds[0].dtype, config,
                                               scheduler_config)
    preds: list[torch.Tensor | None] = [None] * len(noisy)
    for group in layout_groups(batch):
        hidden = torch.stack([torch.cat([batch.references[j], noisy[j]]) for j in group])
        sig = torch.cat([sigmas[j] for j in group]).to(hidden.device, hidden.dtype)
        out = transformer(hidden_states=hidden, timestep=sig, encoder_hidden_states=torch.stack(
                              [batch.embeds[j] for j in group]), encoder_hidden_states_mask=None,
                          img_shapes=[batch.img_shapes[j] for j in group],
                          img_mask=torch.stack([batch.slots[j] for j in group]), return_dict=False)[0]
        n_target = noisy[group[0]].shape[0]
        for row, j in enumerate(group):
            preds[j] = out[row, -n_target:]
    n = [p.shape[0] for p in preds]
    n_max = max(n)
    token_mask = None
    if any(k != n_max for k in n):
        device = preds[0].device
        token_mask = torch.arange(n_max, device=device)[None] < torch.tensor(n, device=device)[:, None]
    return _padded(preds, n_max), _padded(velocities, n_max), token_mask, torch.cat(sigmas).to(preds[0].device)
