"""The 2025 Qwen-Image family's training batch: each sample's controls after its target's 2x2-patch tokens, samples
of different sizes padded into one call (adapters/multires.py) whose attention runs over each sample's valid
tokens alone. train/batch.py draws the noise and sigmas and computes the loss for every family."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch

from qwen_edit_core.adapters import multires
from qwen_edit_core.config import Config
from qwen_edit_core.families import QWEN_IMAGE, Family
from qwen_edit_core.families.qwen_image import encode as family_encode
from qwen_edit_core.model import encode
from qwen_edit_core.model.encode import PromptEmbeds
from qwen_edit_core.train.batch import _padded, noised_targets


@dataclass(frozen=True)
class TrainBatch:
    """A batch on the transformer's device: per-sample packed target tokens in float32 (the flow target and
    the noisy input are formed in fp32; only the model input is cast), control tokens in the model's dtype
    (samples may differ in size; `flow_loss` pads them), right-padded prompt embeddings, and each sample's
    generator."""

    targets: list[torch.Tensor]          # (N_target_b, 64)
    controls: list[torch.Tensor]         # (N_control_b, 64), all control images concatenated
    embeds: PromptEmbeds
    img_shapes: list[list[tuple[int, int, int]]]
    generators: list[torch.Generator]
    #: per sample: its mask's fractions per target token (float32), or None (no mask)
    loss_masks: list[torch.Tensor | None] = field(default_factory=list)
    #: the model family whose `predict` runs it (families/<family>/batch.py)
    family: Family = QWEN_IMAGE


def collate(items: Sequence[dict], generators: Sequence[torch.Generator], *, caption_dropout: float,
                   control_dropout: float, device: torch.device, dtype: torch.dtype) -> TrainBatch:
    """Per-sample cache tensors -> a batch (`train.batch.collate` for this family).

    Caption dropout swaps in the cached empty-caption embeddings; control dropout zeroes the control latents
    (the mean image in normalized latent space). Each draw uses the sample's own generator. Prompts are padded
    (with the mask) to the batch's longest only: one prompt, or prompts of one length, have no mask.
    """
    embeds, controls, targets, shapes, masks = [], [], [], [], []
    for item, gen in zip(items, generators):
        drop_caption = torch.rand((), generator=gen).item() < caption_dropout
        drop_control = torch.rand((), generator=gen).item() < control_dropout
        embeds.append(item["empty_prompt_embeds"] if drop_caption else item["prompt_embeds"])
        n_controls = len(item["img_shapes"]) - 1
        control = torch.cat([family_encode.pack(item[f"control_latents_{i}"][None])[0] for i in range(n_controls)])
        controls.append((torch.zeros_like(control) if drop_control else control).to(device, dtype))
        targets.append(family_encode.pack(item["target_latents"][None])[0].to(device, torch.float32))
        shapes.append([tuple(s) for s in item["img_shapes"].tolist()])
        masks.append(item["loss_mask"].to(device, torch.float32) if "loss_mask" in item else None)
    text = encode.pad_embeddings(embeds).to(device, dtype)
    return TrainBatch(targets=targets, controls=controls, embeds=text, img_shapes=shapes, generators=list(generators),
                      loss_masks=masks)


def predict(transformer, batch: TrainBatch, config: Config, scheduler_config: dict):
    """One forward pass at each sample's sampled sigma (`train.batch.predict` for this family).

    Samples of different sizes are padded into one call (multires.pack_samples); attention runs over each
    sample's valid tokens alone (`PackedBatch.packed_kwargs`: variable-length attention, no padded mask), so each
    sample's prediction equals its one-by-one prediction.
    """
    noisy, velocities, sigmas = noised_targets(batch.targets, batch.generators, batch.controls[0].dtype, config,
                                               scheduler_config)
    packed = multires.pack_samples(noisy, batch.controls, batch.img_shapes)
    sig = torch.cat(sigmas).to(packed.hidden.device)
    pred = transformer(hidden_states=packed.hidden, timestep=sig.to(packed.hidden.dtype),
                       encoder_hidden_states=batch.embeds.embeds,
                       encoder_hidden_states_mask=batch.embeds.mask_or_none(), img_shapes=packed.img_shapes,
                       attention_kwargs=packed.packed_kwargs(batch.embeds.lengths, batch.embeds.embeds.shape[1]),
                       return_dict=False)[0]
    n_max = max(packed.n_target)
    token_mask = None
    if any(n != n_max for n in packed.n_target):
        token_mask = torch.arange(n_max, device=pred.device)[None] < torch.tensor(packed.n_target,
                                                                                   device=pred.device)[:, None]
    return pred[:, :n_max], _padded(velocities, n_max), token_mask, sig
