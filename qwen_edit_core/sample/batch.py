"""Several edits in one transformer call per step: samples of any sizes (each with its own control images, seed
and schedule) packed by the multi-resolution adapter (adapters.multires), cond and uncond batched together."""

from __future__ import annotations

from typing import Sequence

import torch

from qwen_edit_core import speed
from qwen_edit_core.common.progress import CancelToken, Progress, ProgressFn
from qwen_edit_core.model import encode
from qwen_edit_core.model.encode import PromptEmbeds
from qwen_edit_core.families import variants
from qwen_edit_core.sample import sampler


def _forward_many(transformer, latents: list[torch.Tensor], conds: list, embeds: list[PromptEmbeds],
                  timesteps: list[torch.Tensor]) -> list[torch.Tensor]:
    """One transformer call over several samples of any sizes (batching adapter); per-sample predictions."""
    from qwen_edit_core.adapters import multires
    device = next(transformer.parameters()).device
    text = encode.pad_embeddings([e.valid(0) for e in embeds]).to(device)
    packed = multires.pack_samples([x[0] for x in latents], [c.control_tokens[0].to(device) for c in conds],
                                   [c.img_shapes for c in conds])
    dtype = latents[0].dtype
    t = torch.stack([ts.to(device=device, dtype=dtype) for ts in timesteps])
    out = transformer(hidden_states=packed.hidden, timestep=t / 1000, encoder_hidden_states=text.embeds,
                      encoder_hidden_states_mask=text.mask_or_none(), img_shapes=packed.img_shapes,
                      attention_kwargs=packed.packed_kwargs(text.lengths, text.embeds.shape[1]), return_dict=False)[0]
    return [out[b: b + 1, : x.shape[1]] for b, x in enumerate(latents)]


@torch.no_grad()
def sample_batch(components, prompts: Sequence[str], images: Sequence[Sequence], settings: sampler.SampleSettings,
                 seeds: Sequence[int] | None = None, *, progress: ProgressFn | None = None,
                 cancel: CancelToken | None = None) -> list[torch.Tensor]:
    """Several edits in one transformer call per step (cond and uncond batched together), each with its own
    size, control images, seed and schedule; equals running `sample` on each. Returns (1, H, W, 3) images."""
    from qwen_edit_core.adapters import multires
    family = variants.get(components.variant).family
    if not family.padded_batches:
        raise ValueError(f"sample_batch packs samples of any size into one call, which a {family.title} model does "
                         "not take (its transformer reads one token layout per call): sample each edit on its own")
    family_sampler = family.stage("sampler")
    if settings.cfg_mode == "split":
        raise ValueError("sample_batch batches CFG on one device; use cfg_mode 'sequential' or 'batched'")
    transformer = components.transformer
    multires.install(transformer)
    seeds = list(seeds) if seeds is not None else [settings.seed if settings.seed is not None else 0] * len(prompts)
    conds = [family_sampler.build_conditioning(components, p, imgs, settings) for p, imgs in zip(prompts, images)]
    device = next(transformer.parameters()).device
    channels = transformer.config.in_channels // 4
    latents = [family_sampler.initial_noise(s, c.width, c.height, channels, device, c.cond.embeds.dtype,
                                     settings.schedule) for s, c in zip(seeds, conds)]
    schedules = [family_sampler.make_timesteps(components.scheduler_config, settings, x.shape[1], device)[:2]
                 for x in latents]
    with speed.attention_kernel(settings.attention, device):
        latents = _denoise_many(transformer, conds, latents, schedules, settings, family_sampler.guide, progress,
                                 cancel)
    return [family_sampler.decode(components, x, c.width, c.height) for x, c in zip(latents, conds)]


def _denoise_many(transformer, conds, latents, schedules, settings, guide, progress, cancel) -> list[torch.Tensor]:
    """The Euler loop of `sample_batch`: one transformer call per step for every sample and CFG branch, each
    sample's velocity guided by the family's `guide`."""
    total = settings.num_inference_steps
    for i in range(total):
        if cancel is not None:
            cancel.check()
        ts = [timesteps[i] for _, timesteps in schedules]
        if settings.do_cfg:
            both = _forward_many(transformer, latents * 2, conds * 2, [c.cond for c in conds] +
                                 [c.uncond for c in conds], ts * 2)
            preds = [guide(c, u, settings.true_cfg_scale, settings.schedule)
                     for c, u in zip(both[: len(conds)], both[len(conds):])]
        else:
            preds = _forward_many(transformer, latents, conds, [c.cond for c in conds], ts)
        latents = [sched.step(v, t, x, return_dict=False)[0].to(x.dtype)
                   for (sched, _), v, t, x in zip(schedules, preds, ts, latents)]
        if progress is not None:
            progress(Progress("sample", i + 1, total))
    return latents
