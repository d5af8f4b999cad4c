"""The 2025 Qwen-Image family's sampling (Edit, Edit Plus): the diffusers pipelines' conditioning, noise,
schedule and true CFG with its per-token norm rescale, run by the shared Euler/CFG driver (sample/sampler.py
`euler`), and a cache entry as its conditioning (validation previews).

The control tokens follow the target's packed 2x2-patch tokens ([target | control 1 | ...]); `img_shapes` lists
them in that order. `Conditioning.branch`, `to` and `guide` are this family's hooks of the driver.
"""

from __future__ import annotations

import logging
import math
import secrets
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch
from diffusers import FlowMatchEulerDiscreteScheduler

from qwen_edit_core.common.progress import CancelToken, ProgressFn
from qwen_edit_core.families.qwen_image import encode as family_encode
from qwen_edit_core.model import encode, geometry
from qwen_edit_core.model.encode import PromptEmbeds
from qwen_edit_core.sample import schedules
from qwen_edit_core.sample.flow import mu_from_scheduler_config
from qwen_edit_core.sample.sampler import SampleSettings, check_controls, check_finite, euler

log = logging.getLogger(__name__)

@dataclass(frozen=True)
class Conditioning:
    """Everything the denoising loop needs, already on the transformer's device; its `branch`, `to` and `guide`
    are the 2025 family's hooks of the Euler/CFG driver (`euler`)."""

    cond: PromptEmbeds
    uncond: PromptEmbeds | None
    control_tokens: torch.Tensor  # (1, N_control, 64) packed control latents, all images concatenated
    img_shapes: list[tuple[int, int, int]]  # [target, control 1, ...] in packed units
    width: int
    height: int

    def branch(self, transformer, which: str, settings: "SampleSettings"):
        """`predict(latents, t)` of the target tokens for the "cond" or "uncond" prompt, or "both" as one batch of 2
        (cond first; text of different lengths run as variable-length attention, `_packed_cfg`); `settings` change
        nothing here."""
        del settings
        if which != "both":
            embeds = getattr(self, which)
            return lambda latents, t: _forward(transformer, latents, self, embeds, t)
        both = _stack_embeds(self.cond, self.uncond)
        packed = _packed_cfg(transformer, self, both)  # varlen attention where the two lengths differ
        return lambda latents, t: _forward(transformer, latents, self, both, t, packed)

    def to(self, device) -> "Conditioning":
        """This conditioning on `device` (the uncond replica's, cfg_mode split)."""
        return Conditioning(self.cond.to(device), None if self.uncond is None else self.uncond.to(device),
                            self.control_tokens.to(device), self.img_shapes, self.width, self.height)

    def guide(self, cond_pred: torch.Tensor, uncond_pred: torch.Tensor, settings: "SampleSettings") -> torch.Tensor:
        """The pipelines' true CFG with its per-token norm rescale (`guide`)."""
        return guide(cond_pred, uncond_pred, settings.true_cfg_scale, settings.schedule)


def prepare_images(images: Sequence, variant: str, settings: SampleSettings):
    """Resize control images as the pipelines do: returns (vl_images, vae_pixels, vae_sizes, (out_w, out_h))."""
    pils = check_controls(images, variant)
    if settings.control_size == "target":
        out = aligned_size(pils[0], settings)
        vl_images, vae_pixels, vae_sizes = family_encode.prepare_controls(pils, variant, vae_area=settings.vae_area,
                                                                   vl_area=settings.vl_area, sizes=[out] * len(pils))
        return vl_images, vae_pixels, vae_sizes, out
    vl_images, vae_pixels, vae_sizes = family_encode.prepare_controls(pils, variant, vae_area=settings.vae_area,
                                                               vl_area=settings.vl_area)
    # Output size: the given one, else the last control image's VAE size (Edit has only one), then
    # rounded down to a multiple of 16 like the pipelines (logged when it changes a given size).
    out_w = settings.width or vae_sizes[-1][0]
    out_h = settings.height or vae_sizes[-1][1]
    return vl_images, vae_pixels, vae_sizes, geometry.round_output_size(out_w, out_h)


def aligned_size(control, settings: SampleSettings) -> tuple[int, int]:
    """The output size of pixel-aligned sampling: width/height when given (rounded down to 16), else the
    control's own size when both sides are multiples of 16, else its size at the VAE area."""
    m = encode.LATENT_MULTIPLE
    if settings.width or settings.height:
        w, h = settings.width or control.width, settings.height or control.height
        return w // m * m, h // m * m
    if control.width % m == 0 and control.height % m == 0:
        return control.width, control.height
    return encode.image_size_at_area(control, settings.vae_area)


def build_conditioning(components, prompt: str, images: Sequence, settings: SampleSettings) -> Conditioning:
    """Encode prompt(s) on the text encoder's device and control image(s) on the VAE's, then move the results
    to the transformer's device once."""
    components.require("transformer", "vae", "text_encoder")
    settings.validate()
    te = components.text_encoder
    vl_images, vae_pixels, vae_sizes, (width, height) = prepare_images(images, components.variant, settings)
    param = next(components.transformer.parameters())
    device, dtype = param.device, _compute_dtype(components.transformer)

    def text(p: str) -> PromptEmbeds:
        (emb,) = family_encode.encode_prompts(te.model, te.processor, [p], [vl_images], components.variant,
                                       device=te.device)
        return encode.pad_embeddings([emb]).to(device, dtype)

    cond = text(prompt)
    uncond = text(settings.negative_prompt) if settings.do_cfg else None
    control = [family_encode.pack(encode.encode_latents(components.vae, px)) for px in vae_pixels]
    control_tokens = torch.cat(control, dim=1).to(device, dtype)
    shapes = [family_encode.packed_shape(width, height)] + [family_encode.packed_shape(w, h) for w, h in vae_sizes]
    return Conditioning(cond, uncond, control_tokens, shapes, width, height)


def _compute_dtype(transformer) -> torch.dtype:
    # A quantized transformer stores int8/uint8 weights; its activations run in the dtype of its embeddings.
    dtype = transformer.img_in.weight.dtype
    return dtype if dtype.is_floating_point else torch.bfloat16


def initial_noise(seed: int, width: int, height: int, channels: int, device, dtype,
                  schedule: str = "diffusers") -> torch.Tensor:
    """Packed Gaussian noise drawn on the CPU from `seed` (device-independent, as diffusers does with a CPU
    generator), then moved to `device`: in `dtype` (diffusers), or in float32 then cast ("comfyui", as
    ComfyUI's prepare_noise draws for a float32 latent)."""
    h, w = height // family_encode.VAE_SCALE, width // family_encode.VAE_SCALE
    generator = torch.Generator("cpu").manual_seed(seed)
    # diffusers draws (B, 1, C, h, w), ComfyUI (B, C, h, w) or (B, C, 1, h, w); all hold the same numbers in
    # the same memory order as (B, C, 1, h, w).
    draw_dtype = torch.float32 if schedule == "comfyui" else dtype
    noise = torch.randn((1, channels, 1, h, w), generator=generator, dtype=draw_dtype).to(dtype)
    return family_encode.pack(noise).to(device)


def make_timesteps(scheduler_config: dict, settings: SampleSettings, image_seq_len: int, device):
    """A fresh scheduler set to the run's schedule (schedules.PRESETS), sigmas and shift; returns (scheduler,
    timesteps, mu) (mu: the exponential shift's log, for the log line)."""
    n = len(settings.sigmas) if settings.sigmas else settings.num_inference_steps
    if settings.schedule == "comfyui":
        grid = torch.tensor([*settings.sigmas, 0.0]) if settings.sigmas else schedules.comfyui_sigmas(n, settings.shift)
        scheduler = schedules.ComfyEuler(grid, device)
        mu = math.log(settings.shift) if settings.shift else schedules.COMFYUI_QWEN_MU
        return scheduler, scheduler.timesteps, mu
    if settings.schedule == "lightning":
        scheduler_config = schedules.lightning_scheduler_config(scheduler_config,
                                                                settings.shift or schedules.LIGHTNING_SHIFT)
    if n == 1:
        # shift_terminal stretches the schedule so its last sigma hits the terminal value; with one sigma that
        # divides by zero (diffusers returns NaN). One step goes straight from sigma 1 to 0 instead.
        scheduler_config = {**scheduler_config, "shift_terminal": None}
    scheduler = FlowMatchEulerDiscreteScheduler.from_config(scheduler_config)
    if settings.shift is not None:
        mu = math.log(settings.shift)
    elif settings.shift_mode == "dynamic":
        mu = mu_from_scheduler_config(scheduler_config, image_seq_len)
    else:
        mu = settings.fixed_mu
    grid = list(settings.sigmas) if settings.sigmas else np.linspace(1.0, 1 / n, n)
    scheduler.set_timesteps(sigmas=grid, mu=mu, device=device)
    scheduler.set_begin_index(0)
    return scheduler, scheduler.timesteps, mu


def _forward(transformer, latents, cond: Conditioning, embeds: PromptEmbeds, t: torch.Tensor,
             attention_kwargs: dict | None = None) -> torch.Tensor:
    """One transformer call; returns the prediction for the target tokens only. `attention_kwargs`: the packed
    layout of a batch whose prompts differ in length (`_packed_cfg`)."""
    batch = embeds.embeds.shape[0]
    device = embeds.embeds.device
    hidden = torch.cat([latents, cond.control_tokens.to(device)], dim=1)
    if hidden.shape[0] != batch:
        hidden = hidden.expand(batch, -1, -1)
    timestep = t.expand(batch).to(device=device, dtype=latents.dtype)
    mask = embeds.mask_or_none()
    out = transformer(hidden_states=hidden, timestep=timestep / 1000, encoder_hidden_states=embeds.embeds,
                      encoder_hidden_states_mask=mask, img_shapes=[cond.img_shapes] * batch,
                      attention_kwargs=attention_kwargs, return_dict=False)[0]
    return out[:, : latents.shape[1]]


def _stack_embeds(a: PromptEmbeds, b: PromptEmbeds) -> PromptEmbeds:
    """Cond and uncond as one right-padded batch of 2 (no mask when their lengths are equal)."""
    return encode.pad_embeddings([a.valid(0), b.valid(0)])


def _packed_cfg(transformer, cond: Conditioning, both: PromptEmbeds) -> dict | None:
    """The attention kwargs that run cond and uncond of different lengths (`both`, stacked) as variable-length
    attention over each one's valid tokens (`multires.packed_layout`; the multi-resolution processor installed on
    `transformer`, as the trainer and `sample_batch` do), equal to the key-mask path; None when nothing is padded
    or `transformer` is no module of a family that packs batches, or runs context-parallel (a worker pool, or
    diffusers' parallel attention processors: the key mask then)."""
    from qwen_edit_core.adapters import multires
    if both.mask_or_none() is None or not isinstance(transformer, torch.nn.Module) \
            or getattr(transformer, "_parallel_config", None) is not None or multires.install(transformer) is None:
        return None
    n_image = multires.image_lengths([cond.img_shapes])[0]
    return multires.packed_layout(both.lengths, both.embeds.shape[1], [n_image] * len(both.lengths), n_image,
                                  both.embeds.device)


def guide(cond_pred: torch.Tensor, uncond_pred: torch.Tensor, scale: float,
          schedule: str = "diffusers") -> torch.Tensor:
    """True CFG with the pipelines' per-token norm rescale: comb * ||cond|| / ||comb|| (norm over channels);
    plain CFG uncond + scale * (cond - uncond) with schedule "comfyui" (ComfyUI's cfg_function)."""
    if schedule == "comfyui":
        return uncond_pred + (cond_pred - uncond_pred) * scale
    comb = uncond_pred + scale * (cond_pred - uncond_pred)
    return comb * (torch.norm(cond_pred, dim=-1, keepdim=True) / torch.norm(comb, dim=-1, keepdim=True))


def start(components, cond: Conditioning, settings: SampleSettings, seed: int):
    """The run's start for `cond`: (initial noise as packed tokens on the conditioning's device, scheduler,
    timesteps, mu)."""
    device, dtype = cond.cond.embeds.device, cond.cond.embeds.dtype
    channels = components.transformer.config.in_channels // 4
    latents = initial_noise(seed, cond.width, cond.height, channels, device, dtype, settings.schedule)
    return (latents, *make_timesteps(components.scheduler_config, settings, latents.shape[1], device))


def forward_many(transformer, latents: list[torch.Tensor], conds: list[Conditioning], embeds: list[PromptEmbeds],
                 timesteps: list[torch.Tensor]) -> list[torch.Tensor]:
    """One transformer call over several samples of any sizes, each [target | controls] with its own prompt
    (the multi-resolution adapter, installed on `transformer`, packs them); per-sample target predictions."""
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
def denoise(components, cond: Conditioning, settings: SampleSettings, *, uncond_transformer=None, cfg_split=None,
            progress: ProgressFn | None = None, cancel: CancelToken | None = None) -> torch.Tensor:
    """The 2025 family's noise and schedule through `euler`; returns packed latents (1, N, 64) on the
    conditioning's device (the transformer's)."""
    transformer = components.transformer
    seed = settings.seed if settings.seed is not None else secrets.randbits(63)
    latents, scheduler, timesteps, mu = start(components, cond, settings, seed)
    log.info("sampling %dx%d, %d steps, schedule %s, cfg %.2f (%s), mu %.3f, seed %d", cond.width, cond.height,
             len(timesteps), settings.schedule, settings.true_cfg_scale,
             settings.cfg_mode if settings.do_cfg else "off", mu, seed)
    return euler(transformer, cond, settings, latents, scheduler, timesteps, uncond_transformer=uncond_transformer,
                 cfg_split=cfg_split, progress=progress, cancel=cancel)


def decode(components, latents: torch.Tensor, width: int, height: int) -> torch.Tensor:
    """Packed latents -> (B, H, W, 3) float32 image in [0, 1] on the CPU (decoded on the VAE's device)."""
    check_finite(latents, "the denoised latent")
    pixels = encode.decode_latents(components.vae, family_encode.unpack(latents, height, width))
    return encode.postprocess(pixels).cpu()


def sample(components, prompt: str, images: Sequence, settings: SampleSettings = SampleSettings(), *,
           uncond_transformer=None, cfg_split=None, progress: ProgressFn | None = None,
           cancel: CancelToken | None = None) -> torch.Tensor:
    """Edit `images` (one control image, or 1-3 for Edit Plus) by `prompt`; returns (1, H, W, 3) in [0, 1]."""
    cond = build_conditioning(components, prompt, images, settings)
    latents = denoise(components, cond, settings, uncond_transformer=uncond_transformer, cfg_split=cfg_split,
                      progress=progress, cancel=cancel)
    return decode(components, latents, cond.width, cond.height)


def check_settings(settings) -> None:
    """Every sampler setting applies to this family: nothing to refuse."""
    del settings


def pack(latents: torch.Tensor) -> torch.Tensor:
    """Latents (B, C, 1, h, w) -> the transformer's tokens (B, h/2 * w/2, 4C)."""
    return family_encode.pack(latents)


def unpack(tokens: torch.Tensor, width: int, height: int) -> torch.Tensor:
    """Tokens of a `width` x `height` image -> latents (B, C, 1, h, w)."""
    return family_encode.unpack(tokens, height, width)


def conditioning_from_entry(tensors: dict, device, dtype) -> Conditioning:
    """Sampler conditioning from a cache entry: the caption's embeddings, the empty caption as negative."""
    shapes = [tuple(s) for s in tensors["img_shapes"].tolist()]
    n = len(shapes) - 1
    control = torch.cat([family_encode.pack(tensors[f"control_latents_{i}"][None]) for i in range(n)], dim=1)
    _, rows, cols = shapes[0]
    return Conditioning(cond=encode.pad_embeddings([tensors["prompt_embeds"]]).to(device, dtype),
                        uncond=encode.pad_embeddings([tensors["empty_prompt_embeds"]]).to(device, dtype),
                        control_tokens=control.to(device, dtype), img_shapes=shapes,
                        width=cols * encode.LATENT_MULTIPLE, height=rows * encode.LATENT_MULTIPLE)
