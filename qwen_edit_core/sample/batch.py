"""Several edits at once, each with its own size, prompt, images, seed and schedule, equal to sampling each alone.

A family whose transformer takes samples of any sizes in one call (`Family.padded_batches`) runs one call per step
for every sample and CFG branch: its sampler's `forward_many` lays the samples out (the multi-resolution adapter,
adapters.multires, packs them) and each conditioning's `guide` guides its own velocity. A family whose transformer
reads one token layout per call samples the edits one after the other through its own loop.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import torch

from qwen_edit_core import speed
from qwen_edit_core.common.progress import CancelToken, Progress, ProgressFn
from qwen_edit_core.families import variants
from qwen_edit_core.sample import sampler


@torch.no_grad()
def sample_batch(components, prompts: Sequence[str], images: Sequence[Sequence], settings: sampler.SampleSettings,
                 seeds: Sequence[int] | None = None, *, progress: ProgressFn | None = None,
                 cancel: CancelToken | None = None) -> list[torch.Tensor]:
    """Several edits (cond and uncond batched together where the family pads mixed sizes into one call), each with
    its own size, images, seed and schedule; equals running `sample` on each. Returns (1, H, W, C) images."""
    family = variants.get(components.variant).family
    family_sampler = family.stage("sampler")
    if settings.cfg_mode == "split":
        modes = _one_device_modes(family_sampler, settings)
        if not modes:  # the family refuses these settings for another reason: that error says what to change
            family_sampler.check_settings(settings)
        raise ValueError(f"sample_batch runs CFG on one device; use cfg_mode {' or '.join(map(repr, modes))}")
    seeds = list(seeds) if seeds is not None else [settings.seed if settings.seed is not None else 0] * len(prompts)
    conds = [family_sampler.build_conditioning(components, p, imgs, settings) for p, imgs in zip(prompts, images)]
    if not family.padded_batches:
        return _one_by_one(components, family_sampler, conds, settings, seeds, progress, cancel)
    from qwen_edit_core.adapters import multires
    transformer = components.transformer
    multires.install(transformer)
    starts = [family_sampler.start(components, c, settings, s) for s, c in zip(seeds, conds)]
    latents = [x for x, _, _, _ in starts]
    schedules = [(scheduler, timesteps) for _, scheduler, timesteps, _ in starts]
    with speed.attention_kernel(settings.attention, latents[0].device):
        latents = _denoise_many(transformer, family_sampler.forward_many, conds, latents, schedules, settings,
                                progress, cancel)
    return [family_sampler.decode(components, x, c.width, c.height) for x, c in zip(latents, conds)]


def _one_device_modes(family_sampler, settings: sampler.SampleSettings) -> list[str]:
    """The cfg modes running both CFG branches on one device that the family's `check_settings` accepts with
    `settings` (a family may refuse some: Qwen-Image-2.1's transformer cannot batch cond and uncond)."""
    modes = []
    for mode in sampler.CFG_MODES:
        if mode == "split":
            continue
        try:
            family_sampler.check_settings(dataclasses.replace(settings, cfg_mode=mode))
        except ValueError:
            continue
        modes.append(mode)
    return modes


def _one_by_one(components, family_sampler, conds, settings, seeds, progress, cancel) -> list[torch.Tensor]:
    """Each edit through its family's own loop in turn, progress counted over the whole batch."""
    images = []
    for k, (cond, seed) in enumerate(zip(conds, seeds)):
        def step(event: Progress, k=k) -> None:
            if progress is not None:
                progress(Progress("sample", k * event.total + event.step, len(conds) * event.total))
        latents = family_sampler.denoise(components, cond, dataclasses.replace(settings, seed=seed), progress=step,
                                         cancel=cancel)
        images.append(family_sampler.decode(components, latents, cond.width, cond.height))
    return images


def _denoise_many(transformer, forward_many, conds, latents, schedules, settings, progress, cancel
                  ) -> list[torch.Tensor]:
    """The Euler loop of `sample_batch`: one transformer call (`forward_many`) per step for every sample and CFG
    branch, each sample's velocity guided by its conditioning's `guide`."""
    total = settings.num_inference_steps
    for i in range(total):
        if cancel is not None:
            cancel.check()
        ts = [timesteps[i] for _, timesteps in schedules]
        if settings.do_cfg:
            both = forward_many(transformer, latents * 2, conds * 2, [c.cond for c in conds] +
                                [c.uncond for c in conds], ts * 2)
            preds = [c.guide(cp, up, settings) for c, cp, up in zip(conds, both[: len(conds)], both[len(conds):])]
        else:
            preds = forward_many(transformer, latents, conds, [c.cond for c in conds], ts)
        latents = [sched.step(v, t, x, return_dict=False)[0].to(x.dtype)
                   for (sched, _), v, t, x in zip(schedules, preds, ts, latents)]
        if progress is not None:
            progress(Progress("sample", i + 1, total))
    return latents
