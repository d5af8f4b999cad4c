"""True-CFG flow-matching sampler for Qwen-Image-Edit (Edit and Edit Plus).

The diffusers pipelines' loop in numbers (sizes, noise, schedule, CFG, norm rescale), plus pixel areas as
parameters, components on different devices (tensors cross each boundary once), three CFG modes, a progress
callback per step and cancellation between steps.

CFG modes:
- ``sequential``: cond then uncond, two transformer calls per step (as diffusers).
- ``batched``: cond and uncond in one call of batch 2; prompts of different lengths run variable-length
  attention over each one's valid tokens (adapters.multires, as ragged training batches), not a padded key mask.
- ``split``: cond on the transformer's device and uncond on a replica on a second device, concurrently; or,
  under context parallelism over 2N processes, cond on the first N and uncond on the other N
  (sample.context_parallel.CfgSplit), the two predictions swapped once per step.

`transformer` is anything called like diffusers' QwenImageTransformer2DModel that carries its `config`; the
device of every call is the conditioning's (so a pool of worker processes, sample.workers, stands in for it).
"""

from __future__ import annotations

import logging
import math
import secrets
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch
from diffusers import FlowMatchEulerDiscreteScheduler

from qwen_edit_core import speed
from qwen_edit_core.common.progress import CancelToken, Progress, ProgressFn
from qwen_edit_core.model import encode, geometry
from qwen_edit_core.families import variants
from qwen_edit_core.model.encode import PromptEmbeds
from qwen_edit_core.families.templates import EMPTY_PROMPT
from qwen_edit_core.sample import schedules
from qwen_edit_core.sample.flow import mu_from_scheduler_config

log = logging.getLogger(__name__)

CFG_MODES = ("sequential", "batched", "split")
SHIFT_MODES = ("dynamic", "fixed")
CONTROL_SIZES = ("pipeline", "target")


@dataclass(frozen=True)
class SampleSettings:
    """What a user sets for one edit. `negative_prompt=None` or `true_cfg_scale <= 1` turns CFG off."""

    num_inference_steps: int = 20
    true_cfg_scale: float = 4.0
    negative_prompt: str | None = EMPTY_PROMPT
    seed: int | None = 0
    width: int | None = None
    height: int | None = None
    cfg_mode: str = "sequential"
    #: "dynamic": mu from the target token count (diffusers); "fixed": mu = fixed_mu (ComfyUI's 1.15)
    shift_mode: str = "dynamic"
    fixed_mu: float = 1.15
    vae_area: int = 1024 * 1024
    vl_area: int = 384 * 384
    #: which fused attention kernel goes first (speed.ATTENTION_KERNELS): "cudnn" is fastest on Hopper
    attention: str = "auto"
    #: the named schedule (schedules.SCHEDULES): "diffusers", "comfyui" or "lightning"
    schedule: str = "diffusers"
    #: a fixed shift replacing the schedule's own (None: the schedule's); see schedules
    shift: float | None = None
    #: "pipeline": controls at the VAE area, output at the last control's size (diffusers); "target": controls
    #: at the output size, the first control's own size when a multiple of 16 (else at the VAE area)
    control_size: str = "pipeline"
    #: an explicit sigma list (descending, in (0, 1], without the final 0) replacing the schedule's spacing; its
    #: length is the step count (schedules.check_sigmas, schedules.SIGMA_PRESETS)
    sigmas: tuple[float, ...] | None = None
    #: Qwen-Image-2.1: cache the text and reference tokens' keys/values after the first step (same numbers, faster)
    kv_cache: bool = True
    #: the device memory sampling may take, weights included (GiB); 0: 90% of a CUDA device's free memory plus the
    #: transformer's weights there, no limit elsewhere. Qwen-Image-2.1 plans its prefix cache for it
    memory_budget_gb: float = 0.0

    def validate(self) -> None:
        speed.check_attention_kernel(self.attention)
        schedules.check_schedule(self.schedule, self.shift)
        if self.sigmas is not None:
            schedules.check_sigmas(self.sigmas)
        if self.cfg_mode not in CFG_MODES:
            raise ValueError(f"cfg_mode {self.cfg_mode!r} is not accepted; accepted: {', '.join(CFG_MODES)}")
        if self.control_size not in CONTROL_SIZES:
            raise ValueError(f"control_size {self.control_size!r} is not accepted; accepted: "
                             f"{', '.join(CONTROL_SIZES)}")
        if self.shift_mode not in SHIFT_MODES:
            raise ValueError(f"shift_mode {self.shift_mode!r} is not accepted; accepted: {', '.join(SHIFT_MODES)}")
        if not self.memory_budget_gb >= 0:
            raise ValueError(f"memory_budget_gb must be >= 0 (0: the device's free memory), got {self.memory_budget_gb}")
        if self.num_inference_steps < 1:
            raise ValueError(f"num_inference_steps must be >= 1, got {self.num_inference_steps}")
        if self.num_inference_steps > geometry.MAX_STEPS:
            raise ValueError(f"num_inference_steps must be at most {geometry.MAX_STEPS}, got {self.num_inference_steps}")
        too_large = geometry.size_problem(self.width, self.height)
        if too_large:
            raise ValueError(too_large)
        if not self.true_cfg_scale >= 0:
            raise ValueError(f"true_cfg_scale must be >= 0, got {self.true_cfg_scale}")
        for name in ("width", "height"):
            value = getattr(self, name)
            if value is not None and value < encode.LATENT_MULTIPLE:
                raise ValueError(f"{name}={value} is under one latent patch; it must be at least "
                                 f"{encode.LATENT_MULTIPLE} px (it is rounded down to a multiple of 16)")

    @property
    def do_cfg(self) -> bool:
        return self.true_cfg_scale > 1 and self.negative_prompt is not None


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


def check_controls(images: Sequence, variant: str | None) -> list:
    """The control images as PIL images, or EncodeError (a ValueError) naming each problem: how many the
    variant takes (Edit: one, Edit Plus: 1 to 3) and the image limits (geometry.check_image_size). Needs no
    model: sampling checks them before any weight loads."""
    pils = [encode.to_pil(img) for img in images]
    spec = variants.get(variant) if variant else None  # None: a model whose variant shows only once loaded
    problems = ["at least one control image is required"] if not pils else []
    if spec is not None and spec.max_controls is not None and len(pils) > spec.max_controls:
        problems.append(f"a {spec.title} model takes {spec.controls_text()}, got {len(pils)}; "
                        + spec.more_controls_hint())
    for k, pil in enumerate(pils):
        try:
            geometry.check_image_size(pil.size, f"control image {k + 1}")
        except ValueError as err:
            problems.append(str(err))
    if problems:
        raise encode.EncodeError("; ".join(problems))
    return pils


def prepare_images(images: Sequence, variant: str, settings: SampleSettings):
    """Resize control images as the pipelines do: returns (vl_images, vae_pixels, vae_sizes, (out_w, out_h))."""
    pils = check_controls(images, variant)
    if settings.control_size == "target":
        out = aligned_size(pils[0], settings)
        vl_images, vae_pixels, vae_sizes = encode.prepare_controls(pils, variant, vae_area=settings.vae_area,
                                                                   vl_area=settings.vl_area, sizes=[out] * len(pils))
        return vl_images, vae_pixels, vae_sizes, out
    vl_images, vae_pixels, vae_sizes = encode.prepare_controls(pils, variant, vae_area=settings.vae_area,
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
        (emb,) = encode.encode_prompts(te.model, te.processor, [p], [vl_images], components.variant,
                                       device=te.device)
        return encode.pad_embeddings([emb]).to(device, dtype)

    cond = text(prompt)
    uncond = text(settings.negative_prompt) if settings.do_cfg else None
    control = [encode.pack(encode.encode_latents(components.vae, px)) for px in vae_pixels]
    control_tokens = torch.cat(control, dim=1).to(device, dtype)
    shapes = [encode.packed_shape(width, height)] + [encode.packed_shape(w, h) for w, h in vae_sizes]
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
    h, w = height // encode.VAE_SCALE, width // encode.VAE_SCALE
    generator = torch.Generator("cpu").manual_seed(seed)
    # diffusers draws (B, 1, C, h, w), ComfyUI (B, C, h, w) or (B, C, 1, h, w); all hold the same numbers in
    # the same memory order as (B, C, 1, h, w).
    draw_dtype = torch.float32 if schedule == "comfyui" else dtype
    noise = torch.randn((1, channels, 1, h, w), generator=generator, dtype=draw_dtype).to(dtype)
    return encode.pack(noise).to(device)


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


class _Denoiser:
    """Predicts the guided velocity for one step in the chosen CFG mode, for any family: its conditioning `cond`
    supplies the hooks (`Conditioning` is the 2025 family's):
    - `cond.branch(transformer, which, settings)`: `predict(latents, t)` of the target's tokens for the "cond" or
      "uncond" prompt, or "both" (one batch of 2, cfg_mode batched); a branch may keep state between steps (Qwen-Image-2.1's
      prefix K/V cache fills on its first call);
    - `cond.to(device)`: the conditioning on the uncond replica's device (cfg_mode split);
    - `cond.guide(cond_pred, uncond_pred, settings)`: the guided velocity.
    Each prompt keeps its exact length, compiled or not (one graph serves every length: speed.compile), so a
    branch run alone has no mask."""

    def __init__(self, transformer, cond, settings: SampleSettings, uncond_transformer=None, cfg_split=None):
        self.cond, self.settings = cond, settings
        self.mode = settings.cfg_mode if settings.do_cfg else "off"
        if self.mode == "split" and cfg_split is not None:
            # This process runs one branch; the pair group hands it the other one's prediction.
            self.mode, self.cfg_split = "processes", cfg_split
            self.mine = cond.branch(transformer, "uncond" if cfg_split.uncond else "cond", settings)
        if settings.cfg_mode == "split" and not settings.do_cfg:
            log.info("cfg_mode 'split': CFG is off (scale %.2f, negative prompt %s), so there is nothing to "
                     "split (no negative pass): the transformer runs alone on its own device", settings.true_cfg_scale,
                     "unset" if settings.negative_prompt is None else "set")
        if self.mode in ("off", "sequential", "split"):
            self.predict_cond = cond.branch(transformer, "cond", settings)
        if self.mode == "sequential":
            self.predict_uncond = cond.branch(transformer, "uncond", settings)
        self.restore_attention = None
        if self.mode == "batched":
            # the varlen path installs the multi-resolution processor; the caller's model gets its own back
            self.restore_attention = _attention_restorer(transformer)
            self.predict_both = cond.branch(transformer, "both", settings)
        if self.mode == "split":
            if uncond_transformer is None:
                raise ValueError("cfg_mode 'split' needs a second transformer replica (give uncond_device)")
            self.replica_device = next(uncond_transformer.parameters()).device
            self.predict_replica = cond.to(self.replica_device).branch(uncond_transformer, "uncond", settings)
            self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="qwen-edit-uncond")

    def __call__(self, latents: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        if self.mode == "off":
            return self.predict_cond(latents, t)
        if self.mode == "sequential":
            cond_pred = self.predict_cond(latents, t)
            uncond_pred = self.predict_uncond(latents, t)
        elif self.mode == "batched":
            both = self.predict_both(latents, t)
            cond_pred, uncond_pred = both[:1], both[1:]
        elif self.mode == "processes":
            cond_pred, uncond_pred = self.cfg_split.exchange(self.mine(latents, t))
        else:
            # The uncond branch runs on its own device in a worker thread while this thread runs cond.
            future = self.pool.submit(_no_grad, self.predict_replica, latents.to(self.replica_device),
                                      t.to(self.replica_device))
            cond_pred = self.predict_cond(latents, t)
            uncond_pred = future.result().to(latents.device)
        return self.cond.guide(cond_pred, uncond_pred, self.settings)

    def close(self) -> None:
        if self.mode == "split":
            self.pool.shutdown(wait=True)
        if self.restore_attention is not None:
            self.restore_attention()


def _attention_restorer(transformer):
    """A call that puts back `transformer`'s attention processors and position embedding as they are now (a
    sampling run must not leave the graph's model on another processor: context parallel and a job's checks read
    them); None for anything that is not a diffusers transformer."""
    if not isinstance(transformer, torch.nn.Module) or not hasattr(transformer, "attn_processors"):
        return None
    processors, pos_embed = transformer.attn_processors, getattr(transformer, "pos_embed", None)

    def restore() -> None:
        if transformer.attn_processors != processors:
            transformer.set_attn_processor(processors)
        if pos_embed is not None and transformer.pos_embed is not pos_embed:
            transformer.pos_embed = pos_embed
    return restore


@torch.no_grad()
def _no_grad(predict, *args):
    # Autograd and inference-mode state are per thread: the worker thread sets its own.
    return predict(*args)


@torch.no_grad()
def euler(transformer, cond, settings: SampleSettings, latents: torch.Tensor, scheduler, timesteps, *,
          uncond_transformer=None, cfg_split=None, progress: ProgressFn | None = None,
          cancel: CancelToken | None = None) -> torch.Tensor:
    """The Euler/CFG driver every family samples with: from the initial `latents` (the family's tokens) over
    `timesteps` of `scheduler`, each step's velocity guided in settings.cfg_mode by the family's conditioning hooks
    (`_Denoiser`), latents kept in their dtype; a progress event per step, cancellation between steps.
    `cfg_split`: this process's CFG branch under context parallelism (cfg_mode split)."""
    dtype = latents.dtype
    denoiser = _Denoiser(transformer, cond, settings, uncond_transformer, cfg_split)
    try:
        with speed.attention_kernel(settings.attention, latents.device):
            for i, t in enumerate(timesteps):
                if cancel is not None:
                    cancel.check()
                velocity = denoiser(latents, t)
                latents = scheduler.step(velocity, t, latents, return_dict=False)[0].to(dtype)
                if progress is not None:
                    progress(Progress("sample", i + 1, len(timesteps), preview=latents))
    finally:
        denoiser.close()
    return latents


@torch.no_grad()
def denoise(components, cond: Conditioning, settings: SampleSettings, *, uncond_transformer=None, cfg_split=None,
            progress: ProgressFn | None = None, cancel: CancelToken | None = None) -> torch.Tensor:
    """The 2025 family's noise and schedule through `euler`; returns packed latents (1, N, 64) on the
    conditioning's device (the transformer's)."""
    transformer = components.transformer
    device, dtype = cond.cond.embeds.device, cond.cond.embeds.dtype
    seed = settings.seed if settings.seed is not None else secrets.randbits(63)
    channels = transformer.config.in_channels // 4
    latents = initial_noise(seed, cond.width, cond.height, channels, device, dtype, settings.schedule)
    scheduler, timesteps, mu = make_timesteps(components.scheduler_config, settings, latents.shape[1], device)
    log.info("sampling %dx%d, %d steps, schedule %s, cfg %.2f (%s), mu %.3f, seed %d", cond.width, cond.height,
             len(timesteps), settings.schedule, settings.true_cfg_scale,
             settings.cfg_mode if settings.do_cfg else "off", mu, seed)
    return euler(transformer, cond, settings, latents, scheduler, timesteps, uncond_transformer=uncond_transformer,
                 cfg_split=cfg_split, progress=progress, cancel=cancel)


def decode(components, latents: torch.Tensor, width: int, height: int) -> torch.Tensor:
    """Packed latents -> (B, H, W, 3) float32 image in [0, 1] on the CPU (decoded on the VAE's device)."""
    check_finite(latents, "the denoised latent")
    pixels = encode.decode_latents(components.vae, encode.unpack(latents, height, width))
    return encode.postprocess(pixels).cpu()


def sample(components, prompt: str, images: Sequence, settings: SampleSettings = SampleSettings(), *,
           uncond_transformer=None, cfg_split=None, progress: ProgressFn | None = None,
           cancel: CancelToken | None = None) -> torch.Tensor:
    """Edit `images` (one control image, or 1-3 for Edit Plus; 0-10 references for Qwen-Image-2.1) by `prompt`;
    returns (1, H, W, 3) in [0, 1], (1, H, W, 4) RGBA for a model whose VAE decodes alpha."""
    family = variants.get(components.variant).family
    return family.stage("sampler").sample(components, prompt, images, settings, uncond_transformer=uncond_transformer,
                                          cfg_split=cfg_split, progress=progress, cancel=cancel)


def sample_packed(components, prompt: str, images: Sequence, settings: SampleSettings = SampleSettings(), *,
                  uncond_transformer=None, cfg_split=None, progress: ProgressFn | None = None,
                  cancel: CancelToken | None = None) -> torch.Tensor:
    """`sample` for a family whose controls follow the target's packed tokens (the 2025 family's `sample`)."""
    cond = build_conditioning(components, prompt, images, settings)
    latents = denoise(components, cond, settings, uncond_transformer=uncond_transformer, cfg_split=cfg_split,
                      progress=progress, cancel=cancel)
    return decode(components, latents, cond.width, cond.height)


class NonFiniteError(ValueError):
    """Sampling produced NaN or Inf values: no image is written from them."""


def check_finite(latents: torch.Tensor, what: str) -> None:
    """NonFiniteError when `latents` hold NaN or Inf (one host sync per image, before decoding)."""
    if not bool(torch.isfinite(latents).all()):
        raise NonFiniteError(f"{what} holds NaN or Inf values, so no image is written; a LoRA with extreme "
                             "weights, a too high strength or CFG scale, or float16 overflow (use bfloat16 or "
                             "float32) causes this")
