"""One micro-step's maths: cache tensors -> a batch (with dropout) -> the flow-matching loss.

Determinism: every random draw of a sample (noise, timestep, dropout) comes from a generator seeded by
(seed, step, micro-step, the sample's index in the global batch), drawn on the CPU. Nothing depends on the
process rank or on what ran before, so a resumed run, a run on another device and a run split over several
processes (`accelerate launch`) draw the same numbers for the same sample.

Loss: mean over channels and target tokens of each sample, then mean over samples (each sample counts
equally whatever its resolution, so a batch equals the average of one-by-one steps).
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np
import torch
import torch.nn.functional as F

from qwen_edit_core.data import masks
from qwen_edit_core.config import Config
from qwen_edit_core.families import DEFAULT, Family, family_of
from qwen_edit_core.sample import flow


def sample_generator(seed: int, step: int, micro: int, index: int) -> torch.Generator:
    """The generator of one sample of one micro-step (independent of rank, device and history).

    The four numbers are mixed by numpy's `SeedSequence` (a hash of the whole tuple), so no two tuples share
    a seed the way a weighted sum would (step 1, micro 0, index 0 against step 0, micro 99, index 8)."""
    state = np.random.SeedSequence([seed, step, micro, index]).generate_state(2, dtype=np.uint32)
    return torch.Generator("cpu").manual_seed(int(state[0]) << 31 | int(state[1]) >> 1)


def collate(items: Sequence[dict], generators: Sequence[torch.Generator], *, caption_dropout: float,
            control_dropout: float, device: torch.device, dtype: torch.dtype, family: Family | None = None):
    """Per-sample cache tensors -> a batch of their `family` (default: `family_of` the first entry, which tells a
    family by its own cache tensors), by the family's `collate` (families/<family>/batch.py); applies caption and
    control dropout, each draw from the sample's own generator. The batch carries its family, whose `predict`
    runs it."""
    family = family or (family_of(items[0]) if items else DEFAULT)
    batch = family.stage("batch").collate(items, generators, caption_dropout=caption_dropout,
                                          control_dropout=control_dropout, device=device, dtype=dtype)
    return batch if batch.family is family else dataclasses.replace(batch, family=family)


def _padded(rows: Sequence[torch.Tensor], n_max: int) -> torch.Tensor:
    """Stack (N_b, ...) rows into (B, n_max, ...), zero-padded at the end of each."""
    return torch.stack([F.pad(r, (0, 0) * (r.dim() - 1) + (0, n_max - r.shape[0])) for r in rows])


def predict(transformer, batch, config: Config, scheduler_config: dict):
    """One forward pass at each sample's sampled sigma, by the batch's family (`predict` of
    families/<family>/batch.py): (prediction (B, n_max, 64), velocity target (same), token mask (B, n_max) or
    None when nothing is padded, sigmas (B,))."""
    return batch.family.stage("batch").predict(transformer, batch, config, scheduler_config)


def region_weights(batch, n_max: int, mask_weight: float, unmasked_weight: float,
                   device) -> torch.Tensor | None:
    """(B, n_max) per-token loss weights from the samples' masks (1 for samples without one), or None when no
    sample has a mask (the plain loss, bit for bit)."""
    if all(m is None for m in batch.loss_masks):
        return None
    rows = [masks.token_weights(m, mask_weight, unmasked_weight) if m is not None
            else torch.ones(t.shape[0], device=t.device) for m, t in zip(batch.loss_masks, batch.targets)]
    return _padded(rows, n_max).to(device)


def noised_targets(targets, generators, dtype, config, scheduler_config: dict):
    """Each sample's noise and sigma drawn from its own generator: (noisy model inputs in `dtype`, fp32 flow
    targets, sigmas). Shared by both families' steps."""
    t = config.train
    noisy, velocities, sigmas = [], [], []
    for x0, gen in zip(targets, generators):
        x0 = x0.float()
        noise = torch.randn(x0.shape, generator=gen, dtype=torch.float32).to(x0.device)
        mu = flow.mu_from_scheduler_config(scheduler_config, x0.shape[0])
        sigma = flow.sample_sigmas(1, t.timestep_sampling, generator=gen, device="cpu", mu=mu,
                                   logit_mean=t.logit_mean, logit_std=t.logit_std, shift=t.fixed_shift)
        # fp32 maths; only the model input is cast to the model's dtype.
        noisy.append(flow.noisy_latents(x0[None], noise[None], sigma.to(x0.device, torch.float32))[0].to(dtype))
        velocities.append(flow.flow_target(x0, noise))
        sigmas.append(sigma)
    return noisy, velocities, sigmas


def flow_loss(transformer, batch, config: Config, scheduler_config: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """Flow-matching loss on each sample's target tokens: predict noise - latents at a sampled sigma.

    Padding is masked out of the loss, so each sample's loss equals its one-by-one loss. A Qwen-Image-2.1 batch
    (families/qwen_image_21/batch.py) predicts with one call per token layout and is weighed the same way. Samples with
    a mask weight each token by `train.unmasked_weight` outside the edited region and `train.mask_weight` inside.
    """
    t = config.train
    pred, target, token_mask, sig = predict(transformer, batch, config, scheduler_config)
    weights = flow.loss_weights(t.loss_weighting, sig).to(pred.device)
    per_token = region_weights(batch, pred.shape[1], t.mask_weight, t.unmasked_weight, pred.device)
    return flow.masked_mse(pred.float(), target.float(), weights, token_mask, per_token)


@torch.no_grad()
def region_losses(transformer, batch, config: Config, scheduler_config: dict) -> tuple[float, float]:
    """(masked, unmasked): the plain squared error averaged inside each sample's edited region (weighted by
    its mask) and outside it, then over the samples; every sample of `batch` needs a mask."""
    if any(m is None for m in batch.loss_masks):
        raise ValueError("region_losses needs samples with masks")
    pred, target, _, _ = predict(transformer, batch, config, scheduler_config)
    err = (pred.float() - target.float()).square().mean(dim=-1)
    inside = _padded([m.to(err.device) for m in batch.loss_masks], err.shape[1])
    outside = _padded([1 - m.to(err.device) for m in batch.loss_masks], err.shape[1])
    masked = (err * inside).sum(1) / inside.sum(1).clamp(min=1e-12)
    unmasked = (err * outside).sum(1) / outside.sum(1).clamp(min=1e-12)
    return masked.mean().item(), unmasked.mean().item()
