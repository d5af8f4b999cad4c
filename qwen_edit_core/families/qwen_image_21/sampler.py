"""The Qwen-Image-2.1 sampler: diffusers' `QwenImage21Pipeline` loop in numbers, with the prefix K/V cache.

What differs from the 2025 family's loop (families/qwen_image/sampler.py), read from diffusers 0.42.1
pipeline_qwenimage21.py and transformer_qwenimage21.py:
- reference latents go first, the target's last ([ref 1 | ... | ref n | target]); `img_shapes` lists them in the
  same order, and each reference's tokens replace its vision slots inside the text sequence (the transformer does
  the splicing from `img_mask`: the prompt's vision slots plus one slot per 2x2 target tokens);
- the timestep shift's mu comes from the scheduler config with the 2.1 pipeline's defaults (256/4096 tokens,
  0.5/1.15), the sigmas are the call's explicit list, else the model's `sample_sigmas`, else linspace(1, 1/n, n);
- true CFG is plain `neg + s * (cond - neg)` (no norm rescale), only with a negative prompt and s > 1;
- with `kv_cache` (the default) the first step stores every block's keys/values of the text and reference tokens
  (`QwenImage21KVCache`, "extract") and later steps compute only the target's tokens ("cached"): the transformer
  runs those tokens at t = 0 (`causal_condition`), so they do not change between steps. Cond and uncond keep a
  cache each, sized and placed before the first step (prefix_cache.py: device, host, int8 or off).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import secrets
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np
import torch
from diffusers import FlowMatchEulerDiscreteScheduler

from qwen_edit_core import speed
from qwen_edit_core.common.progress import CancelToken, ProgressFn
from qwen_edit_core.model import encode
from qwen_edit_core.families import QWEN_IMAGE_21
from qwen_edit_core.sample import schedules
from qwen_edit_core.families.qwen_image_21 import encode as encode21
from qwen_edit_core.families.qwen_image_21 import prefix_cache
from qwen_edit_core.families.qwen_image_21.encode import PromptWithSlots

log = logging.getLogger(__name__)

#: ComfyUI's model-sampling mu for Qwen-Image-2.1, the same at every resolution (comfy/supported_models.py
#: ``QwenImage21.sampling_settings = {"multiplier": 1.0, "shift": 0.69}`` on ``ModelType.FLUX``, Comfy-Org/ComfyUI
#: commit 01f03bbdc7df9462d3fc4c0918f80049333450f3: diffusers' 2.1 pipeline's mu at 1024x1024); the official
#: scheduler computes mu from the target's token count instead
COMFYUI_QWEN21_MU = 0.69


#: the schedules of sample/schedules.py this family samples with: the official pipeline's, and stock ComfyUI's
#: (its fixed mu, COMFYUI_QWEN21_MU, through ComfyUI's simple scheduler and Euler)
SCHEDULES = ("diffusers", "comfyui")
#: calculate_shift's defaults in the 2.1 pipeline, used where the scheduler config lacks a key
SHIFT_DEFAULTS = {"base_image_seq_len": 256, "max_image_seq_len": 4096, "base_shift": 0.5, "max_shift": 1.15}


@dataclass(frozen=True)
class Conditioning21:
    """Everything the 2.1 loop needs, on the transformer's device; its `branch`, `to` and `guide` are this family's
    hooks of the shared Euler/CFG driver (sample/sampler.py `euler`)."""

    cond: PromptWithSlots
    uncond: PromptWithSlots | None
    #: (1, N_refs, 64) reference latent tokens in the user's order, or None without references
    reference_tokens: torch.Tensor | None
    #: [ref 1, ..., ref n, target] (frames, rows, cols) in latent tokens
    img_shapes: list[tuple[int, int, int]]
    width: int
    height: int
    #: where each branch's prefix K/V cache lives (`plan_prefix_cache`, which `denoise` sets; None: no cache)
    cache_plan: prefix_cache.PrefixPlan | None = None
    #: the uncond branch's own plan when it runs on a device of its own (cfg_mode split); None: `cache_plan`'s
    uncond_cache_plan: prefix_cache.PrefixPlan | None = None

    def branch(self, transformer, which: str, settings):
        """The "cond" or "uncond" prompt's `predict(latents, t)`: a `Branch` with its own prefix K/V cache, placed
        as `cache_plan` says (`settings` change nothing more here)."""
        del settings
        if which not in ("cond", "uncond"):
            raise ValueError(f"Qwen-Image-2.1 runs its CFG branches one by one, not {which!r} (cfg_mode batched)")
        prompt = getattr(self, which)
        plan = self.uncond_cache_plan if which == "uncond" and self.uncond_cache_plan is not None else self.cache_plan
        # a plan of one branch (no CFG, or a branch on a device of its own) holds that branch's tokens alone
        index = 0 if plan is None or len(plan.tokens) == 1 else ("cond", "uncond").index(which)
        branch = Branch(transformer, prompt, "off") if plan is None else \
            Branch(transformer, prompt, plan.place, plan.tokens[index])

        def predict(latents: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
            hidden = latents if self.reference_tokens is None else torch.cat([self.reference_tokens, latents], 1)
            return branch(hidden, 0, t.expand(1).to(prompt.embeds.dtype) / 1000, self, latents.shape[1])
        return predict

    def to(self, device) -> "Conditioning21":
        """This conditioning on `device` (the uncond replica's, cfg_mode split)."""
        def move(prompt: PromptWithSlots | None) -> PromptWithSlots | None:
            return None if prompt is None else PromptWithSlots(prompt.embeds.to(device), prompt.slots.to(device))
        refs = None if self.reference_tokens is None else self.reference_tokens.to(device)
        return dataclasses.replace(self, cond=move(self.cond), uncond=move(self.uncond), reference_tokens=refs)

    def guide(self, cond_pred: torch.Tensor, uncond_pred: torch.Tensor, settings) -> torch.Tensor:
        """The 2.1 pipeline's plain true CFG, `neg + s * (cond - neg)` (no norm rescale)."""
        return uncond_pred + settings.true_cfg_scale * (cond_pred - uncond_pred)


def check_settings(settings) -> None:
    """Refuse what the 2.1 loop does not do, naming what to use instead."""
    if settings.schedule not in SCHEDULES:
        raise ValueError(f"schedule {settings.schedule!r} is not available for Qwen-Image-2.1; accepted: "
                         f"{', '.join(SCHEDULES)} (few-step adapters: schedule 'diffusers' with their sigma list, "
                         "e.g. sigmas 'qwen21-turbo-8step')")
    if settings.do_cfg and settings.cfg_mode == "batched":
        raise ValueError("cfg_mode 'batched' is not available for Qwen-Image-2.1: its transformer reads one token "
                         "layout per batch, and cond and uncond prompts differ in length; use cfg_mode 'sequential' "
                         "or 'split' (the uncond branch on a second device)")
    if settings.control_size != "pipeline":
        raise ValueError("control_size 'target' is not available for Qwen-Image-2.1 yet; use 'pipeline'")


def build_conditioning(components, prompt: str, images: Sequence, settings) -> Conditioning21:
    """References resized and encoded on the VAE's device, prompt(s) on the text encoder's, then moved to the
    transformer's device once."""
    components.require("transformer", "vae", "text_encoder")
    settings.validate()
    check_settings(settings)
    refs = encode21.prepare_references(images, settings.vae_area)
    width, height = encode21.output_size(refs.images, settings.vae_area, settings.width, settings.height)
    te = components.text_encoder
    param = next(components.transformer.parameters())
    device, dtype = param.device, param.dtype
    drop = encode21.system_tokens(te.processor)
    target_slots = width * height // (encode21.SIZE_MULTIPLE ** 2)

    def text(p: str) -> PromptWithSlots:
        enc = encode21.encode_prompt(te.model, te.processor, p, refs.images, device=te.device, drop=drop)
        slots = torch.cat([enc.slots.cpu(), torch.ones(1, target_slots, dtype=torch.bool)], dim=1)
        return PromptWithSlots(enc.embeds.to(device, dtype), slots.to(device))

    cond = text(prompt)
    uncond = text(settings.negative_prompt) if settings.do_cfg else None
    tokens = [encode21.pack(encode.encode_latents(components.vae, px)) for px in refs.pixels]
    reference_tokens = torch.cat(tokens, dim=1).to(device, dtype) if tokens else None
    shapes = [encode21.token_grid(w, h) for w, h in refs.sizes] + [encode21.token_grid(width, height)]
    return Conditioning21(cond, uncond, reference_tokens, shapes, width, height)


def initial_noise(seed: int, width: int, height: int, channels: int, device, dtype,
                  draw_dtype: torch.dtype | None = None) -> torch.Tensor:
    """Unpatched Gaussian noise (1, h*w, C) drawn on the CPU from `seed` in `draw_dtype` (default `dtype`), as the
    pipeline's CPU generator draws (1, 1, C, h, w) (the same numbers in the same order; ComfyUI draws
    (1, C, h, w) in float32, also the same order), then cast to `dtype` and moved to `device`."""
    scale = encode21.QWEN_IMAGE_21.vae_scale
    generator = torch.Generator("cpu").manual_seed(seed)
    noise = torch.randn((1, channels, 1, height // scale, width // scale), generator=generator,
                        dtype=draw_dtype or dtype).to(dtype)
    return encode21.pack(noise).to(device)


def model_sigmas(model_dir: Path | None) -> list[float] | None:
    """The model's own default sigma list (`sample_sigmas` in model_index.json: a few-step checkpoint such as
    Qwen-Image-2.1-Turbo), or None."""
    from qwen_edit_core.model.components import shipped_sigmas
    return shipped_sigmas(model_dir) if model_dir else None


def make_timesteps(scheduler_config: dict, sigmas: Sequence[float] | None, steps: int, image_seq_len: int, device,
                   *, schedule: str = "diffusers", shift: float | None = None):
    """A fresh scheduler set to `sigmas` (else the schedule's own grid of `steps`); returns (scheduler, timesteps,
    mu). "diffusers": FlowMatchEulerDiscreteScheduler with the 2.1 pipeline's mu from the token count (a `shift`
    replaces it with the fixed mu ln(shift); shift 1 runs the sigmas as given), else linspace(1, 1/steps, steps);
    "comfyui": ComfyUI's simple scheduler over its 2.1 table (mu 0.69 at every size) or the given sigmas, with
    ComfyUI's Euler step."""
    if schedule == "comfyui":
        grid = torch.tensor([*sigmas, 0.0]) if sigmas else schedules.comfyui_sigmas(
            steps, shift, mu=COMFYUI_QWEN21_MU)
        scheduler = schedules.ComfyEuler(grid, device)
        return scheduler, scheduler.timesteps, math.log(shift) if shift else COMFYUI_QWEN21_MU
    c = {**SHIFT_DEFAULTS, **{k: v for k, v in scheduler_config.items() if k in SHIFT_DEFAULTS}}
    slope = (c["max_shift"] - c["base_shift"]) / (c["max_image_seq_len"] - c["base_image_seq_len"])
    mu = image_seq_len * slope + c["base_shift"] - slope * c["base_image_seq_len"]
    if shift is not None:  # a fixed exponential shift, whatever the checkpoint's scheduler does
        scheduler_config = {**scheduler_config, "use_dynamic_shifting": True, "time_shift_type": "exponential"}
        mu = math.log(shift)
    scheduler = FlowMatchEulerDiscreteScheduler.from_config(scheduler_config)
    grid = list(sigmas) if sigmas else np.linspace(1.0, 1 / steps, steps)
    scheduler.set_timesteps(sigmas=grid, mu=mu, device=device)
    scheduler.set_begin_index(0)
    return scheduler, scheduler.timesteps, mu


class Branch:
    """One CFG branch (cond or uncond): its prompt, its vision-slot mask and its prefix K/V cache in the place
    the plan chose (prefix_cache.PLACES). The first call fills the cache ("extract"), later calls read it."""

    def __init__(self, transformer, prompt: PromptWithSlots, place: str, tokens: int = 0):
        self.transformer, self.prompt, self.place = transformer, prompt, place
        shape = prefix_cache.cache_shape(transformer.config, prompt.embeds.dtype)
        self.cache = None if place == "off" else prefix_cache.PlacedCache(place, shape, tokens,
                                                                          prompt.embeds.device)
        self.filled = False
        #: run the int8 cache's guard on the first step (the memory simulator, whose tensors hold no numbers,
        #: turns it off)
        self.check = True

    def _run(self, hidden, t, cond: Conditioning21, mode: str | None) -> torch.Tensor:
        return self.transformer(hidden_states=hidden, timestep=t, encoder_hidden_states=self.prompt.embeds,
                                encoder_hidden_states_mask=None, img_shapes=[cond.img_shapes],
                                img_mask=self.prompt.slots, kv_cache=None if mode is None else self.cache,
                                kv_cache_mode=mode, return_dict=False)[0]

    def __call__(self, hidden, step: int, t, cond: Conditioning21, n_target: int) -> torch.Tensor:
        if self.cache is None:
            return self._run(hidden, t, cond, None)[:, -n_target:]
        if self.filled:
            return self._run(hidden, t, cond, "cached")[:, -n_target:]
        out = self._run(hidden, t, cond, "extract")[:, -n_target:]
        self.filled = True
        if self.place == "int8" and self.check:
            self._check_int8(hidden, t, cond, n_target, out)
        return out

    def _check_int8(self, hidden, t, cond: Conditioning21, n_target: int, exact: torch.Tensor) -> None:
        """The int8 cache's prediction for this step against the exact one just computed; over
        `prefix_cache.INT8_MAX_ERROR` the cache is dropped (every later step recomputes the prefix)."""
        error = prefix_cache.prediction_error(self._run(hidden, t, cond, "cached")[:, -n_target:], exact)
        if error > prefix_cache.INT8_MAX_ERROR:
            log.warning("prefix K/V cache in int8: prediction error %.3g against the exact cache exceeds %.3g; the "
                        "cache is turned off (%.2f GiB freed, every step recomputes the prefix)", error,
                        prefix_cache.INT8_MAX_ERROR, self.cache.nbytes() / prefix_cache.GIB)
            self.cache, self.place = None, "off"
        else:
            log.info("prefix K/V cache in int8: prediction error %.3g against the exact cache (limit %.3g)", error,
                     prefix_cache.INT8_MAX_ERROR)


def device_budget(settings, transformer, device: torch.device) -> int | None:
    """The device bytes sampling may take, weights included: `settings.memory_budget_gb`, else on CUDA 90% of the
    free memory plus the transformer's weights there (speed.free_memory_budget_gb), else None (no limit)."""
    if settings.memory_budget_gb:
        return int(settings.memory_budget_gb * prefix_cache.GIB)
    device = torch.device(device)
    if device.type != "cuda":
        return None
    free, _ = torch.cuda.mem_get_info(device)
    return int(speed.free_memory_budget_gb(free, speed.resident_bytes(transformer, device)) * prefix_cache.GIB)


def default_host_budget() -> int | None:
    """Host bytes the cache may take: `prefix_cache.HOST_HEADROOM` of the host's available memory (None: unknown)."""
    available = prefix_cache.host_available()
    return None if available is None else int(prefix_cache.HOST_HEADROOM * available)


def plan_prefix_cache(transformer, cond: Conditioning21, settings, n_target: int, *,
                      host_budget: int | None = None, which: tuple[str, ...] | None = None
                      ) -> prefix_cache.PrefixPlan | None:
    """Where the prefix cache of this edit lives on `transformer`'s device (prefix_cache.plan), logged with its
    sizes; None when the cache is off (`settings.kv_cache` false, or a transformer without `causal_condition`).
    `which`: the branches ("cond", "uncond") that run on this device (default: every branch the settings run);
    `host_budget`: host bytes the cache may take (default: `default_host_budget`)."""
    if not (settings.kv_cache and getattr(transformer.config, "causal_condition", False)):
        return None
    which = which if which is not None else ("cond", "uncond") if settings.do_cfg else ("cond",)
    prompts = [getattr(cond, name) for name in which]
    device, dtype = prompts[0].embeds.device, prompts[0].embeds.dtype
    shape = prefix_cache.cache_shape(transformer.config, dtype)
    if host_budget is None:
        host_budget = default_host_budget()
    plan = prefix_cache.plan(budget=device_budget(settings, transformer, device), host_budget=host_budget,
                             weights=speed.resident_bytes(transformer, device), shape=shape,
                             tokens=tuple(prefix_cache.prefix_tokens(p.slots, n_target) for p in prompts),
                             target_tokens=n_target, dim=shape.heads * shape.head_dim,
                             pin=torch.device(device).type == "cuda")
    (log.info if plan.place == "device" else log.warning)("%s", plan.describe())
    return plan


def branches(transformer, cond: Conditioning21, settings, plan: prefix_cache.PrefixPlan | None) -> list[Branch]:
    """The CFG branches of an edit (cond, and uncond with true CFG), each with its cache placed as `plan` says."""
    prompts = [cond.cond] + ([cond.uncond] if settings.do_cfg else [])
    if plan is None:
        return [Branch(transformer, p, "off") for p in prompts]
    return [Branch(transformer, p, plan.place, n) for p, n in zip(prompts, plan.tokens)]


def plan_branches(transformer, cond: Conditioning21, settings, n_target: int, *, uncond_transformer=None,
                  cfg_split=None, host_budget: int | None = None) -> Conditioning21:
    """`cond` with its cache plans: every branch on `transformer`'s device, except where a branch runs on a device
    of its own (cfg_mode split: the uncond branch on `uncond_transformer`'s; `cfg_split`: this process runs one
    branch), where each device's plan counts only its own branch and the host budget is shared between them."""
    split = settings.do_cfg and settings.cfg_mode == "split"
    if split and cfg_split is not None:
        mine = ("uncond",) if cfg_split.uncond else ("cond",)
        return dataclasses.replace(cond, cache_plan=plan_prefix_cache(transformer, cond, settings, n_target,
                                                                      host_budget=host_budget, which=mine))
    if not (split and uncond_transformer is not None):
        return dataclasses.replace(cond, cache_plan=plan_prefix_cache(transformer, cond, settings, n_target,
                                                                      host_budget=host_budget))
    host = host_budget if host_budget is not None else default_host_budget()
    plan = plan_prefix_cache(transformer, cond, settings, n_target, host_budget=host, which=("cond",))
    left = None if host is None else host - (plan.host_bytes if plan is not None else 0)
    replica = cond.to(next(uncond_transformer.parameters()).device)
    uncond_plan = plan_prefix_cache(uncond_transformer, replica, settings, n_target, host_budget=left,
                                    which=("uncond",))
    return dataclasses.replace(cond, cache_plan=plan, uncond_cache_plan=uncond_plan)


def start(components, cond: Conditioning21, settings, seed: int):
    """The run's start for `cond`: (initial noise as latent tokens on the conditioning's device, scheduler,
    timesteps, mu): the model's own `sample_sigmas` unless the settings name sigmas or ComfyUI's schedule."""
    device, dtype = cond.cond.embeds.device, cond.cond.embeds.dtype
    comfyui = settings.schedule == "comfyui"  # ComfyUI's noise is drawn in float32; it ignores sample_sigmas
    latents = initial_noise(seed, cond.width, cond.height, components.transformer.config.in_channels, device, dtype,
                            draw_dtype=torch.float32 if comfyui else None)
    sigmas = settings.sigmas or (None if comfyui else model_sigmas(components.model_dir))
    return (latents, *make_timesteps(components.scheduler_config, sigmas, settings.num_inference_steps,
                                     latents.shape[1], device, schedule=settings.schedule, shift=settings.shift))


@torch.no_grad()
def denoise(components, cond: Conditioning21, settings, *, uncond_transformer=None, cfg_split=None,
            progress: ProgressFn | None = None, cancel: CancelToken | None = None) -> torch.Tensor:
    """This family's noise and schedule through the shared Euler/CFG driver (sample/sampler.py `euler`); returns
    the target's unpatched latent tokens (1, h*w, 64) on the transformer's device. `uncond_transformer` (cfg_mode
    split: the uncond branch on a second device) and `cfg_split` (context parallelism) as for the 2025 family."""
    from qwen_edit_core.sample.sampler import euler

    transformer = components.transformer
    seed = settings.seed if settings.seed is not None else secrets.randbits(63)
    latents, scheduler, timesteps, mu = start(components, cond, settings, seed)
    n = latents.shape[1]
    cond = plan_branches(transformer, cond, settings, n, uncond_transformer=uncond_transformer, cfg_split=cfg_split)
    plan, uncond_plan = cond.cache_plan, cond.uncond_cache_plan
    log.info("sampling %dx%d (Qwen-Image-2.1), %s schedule, %d steps, cfg %.2f, mu %.3f, prefix cache %s, seed %d",
             cond.width, cond.height, settings.schedule, len(timesteps),
             settings.true_cfg_scale if settings.do_cfg else 1.0, mu, plan.place if plan else "off", seed)
    try:
        return euler(transformer, cond, settings, latents, scheduler, timesteps,
                     uncond_transformer=uncond_transformer, cfg_split=cfg_split, progress=progress, cancel=cancel)
    finally:
        if any(p is not None and p.place == "host" for p in (plan, uncond_plan)):
            # the branches' caches (their pinned regions) went with the driver's frame; torch's host allocator
            # then hands its cached pinned blocks back (a long-lived process such as ComfyUI would keep them)
            from qwen_edit_core.speed import host_memory
            host_memory.release_cache()


def decode(components, latents: torch.Tensor, width: int, height: int) -> torch.Tensor:
    """Latent tokens -> (1, H, W, C) float32 in [0, 1] on the CPU; C = 4 (RGBA) for 2.1's VAE."""
    from qwen_edit_core.sample.sampler import check_finite
    check_finite(latents, "the denoised latent")
    pixels = encode.decode_latents(components.vae, encode21.unpack(latents, width, height))
    return encode.postprocess(pixels).cpu()


def sample(components, prompt: str, images: Sequence, settings, *, uncond_transformer=None, cfg_split=None,
           progress: ProgressFn | None = None, cancel: CancelToken | None = None) -> torch.Tensor:
    """Generate from `prompt` with 0 to 10 ordered reference `images`; returns (1, H, W, 4) RGBA in [0, 1].
    `uncond_transformer` and `cfg_split` as `denoise` takes them."""
    cond = build_conditioning(components, prompt, images, settings)
    latents = denoise(components, cond, settings, uncond_transformer=uncond_transformer, cfg_split=cfg_split,
                      progress=progress, cancel=cancel)
    return decode(components, latents, cond.width, cond.height)


def pack(latents: torch.Tensor) -> torch.Tensor:
    """Latents (B, 64, 1, h, w) -> the transformer's tokens (B, h * w, 64): one token per latent pixel."""
    return encode21.pack(latents)


def unpack(tokens: torch.Tensor, width: int, height: int) -> torch.Tensor:
    """Tokens of a `width` x `height` image -> latents (B, 64, 1, h, w)."""
    return encode21.unpack(tokens, width, height)


def conditioning_from_entry(tensors: dict, device, dtype) -> Conditioning21:
    """2.1 sampler conditioning from a 2.1 cache entry: the caption and the empty caption (the negative) with
    their slot masks plus the target's slots, the references' tokens, [references..., target] shapes."""
    shapes = [tuple(s) for s in tensors["img_shapes"].tolist()]
    _, rows, cols = shapes[0]

    def prompt(name: str) -> PromptWithSlots:
        target_slots = torch.ones(rows * cols // encode21.TOKENS_PER_SLOT, dtype=torch.bool)
        slots = torch.cat([tensors[f"{name}_slots"], target_slots])
        return PromptWithSlots(tensors[f"{name}_embeds"][None].to(device, dtype), slots[None].to(device))
    refs = [encode21.pack(tensors[f"control_latents_{i}"][None]) for i in range(len(shapes) - 1)]
    return Conditioning21(prompt("prompt"), prompt("empty_prompt"),
                          torch.cat(refs, dim=1).to(device, dtype) if refs else None, shapes[1:] + shapes[:1],
                          width=cols * QWEN_IMAGE_21.token_pixels, height=rows * QWEN_IMAGE_21.token_pixels)
