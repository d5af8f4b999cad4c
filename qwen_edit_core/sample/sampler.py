"""The true-CFG flow-matching sampler every model family shares: the settings, the Euler/CFG driver (`euler`) and
the entry points (`sample`, `build_conditioning`, `denoise`, `decode`) that hand a run to the components'
family's sampler (`Family.stage("sampler")`, families/<family>/sampler.py: its conditioning, noise, schedule and
guidance).

The driver runs the diffusers pipelines' loop with components on different devices (tensors cross each boundary
once), three CFG modes, a progress callback per step and cancellation between steps.

CFG modes:
- ``sequential``: cond then uncond, two transformer calls per step (as diffusers).
- ``batched``: cond and uncond in one call of batch 2; prompts of different lengths run variable-length
  attention over each one's valid tokens (adapters.multires, as ragged training batches), not a padded key mask.
- ``split``: cond on the transformer's device and uncond on a replica on a second device, concurrently; or,
  under context parallelism over 2N processes, cond on the first N and uncond on the other N
  (sample.context_parallel.CfgSplit), the two predictions swapped once per step.

`transformer` is anything called like the family's diffusers transformer that carries its `config`; the
device of every call is the conditioning's (so a pool of worker processes, sample.workers, stands in for it).
"""

from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Sequence

import torch

from qwen_edit_core import speed
from qwen_edit_core.common.progress import CancelToken, Progress, ProgressFn
from qwen_edit_core.model import encode, geometry
from qwen_edit_core.families import variants
from qwen_edit_core.families.templates import EMPTY_PROMPT
from qwen_edit_core.sample import schedules

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
            raise ValueError(f"memory_budget_gb must be >= 0 (0: the device's free memory), "
                             f"got {self.memory_budget_gb}")
        if self.num_inference_steps < 1:
            raise ValueError(f"num_inference_steps must be >= 1, got {self.num_inference_steps}")
        if self.num_inference_steps > geometry.MAX_STEPS:
            raise ValueError(f"num_inference_steps must be at most {geometry.MAX_STEPS}, "
                             f"got {self.num_inference_steps}")
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


class _Denoiser:
    """Predicts the guided velocity for one step in the chosen CFG mode, for any family: its conditioning `cond`
    supplies the hooks (its family's `Conditioning`, families/<family>/sampler.py):
    - `cond.branch(transformer, which, settings)`: `predict(latents, t)` of the target's tokens for the "cond" or
      "uncond" prompt, or "both" (one batch of 2, cfg_mode batched); a branch may keep state between steps
      (Qwen-Image-2.1's prefix K/V cache fills on its first call);
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


def family_sampler(components):
    """The sampler module of `components`' family (families/<family>/sampler.py)."""
    return variants.get(components.variant).family.stage("sampler")


def build_conditioning(components, prompt: str, images: Sequence, settings: SampleSettings):
    """The family's conditioning of one edit: prompt(s) encoded on the text encoder's device and image(s) on the
    VAE's, then moved to the transformer's device once."""
    return family_sampler(components).build_conditioning(components, prompt, images, settings)


@torch.no_grad()
def denoise(components, cond, settings: SampleSettings, *, uncond_transformer=None, cfg_split=None,
            progress: ProgressFn | None = None, cancel: CancelToken | None = None) -> torch.Tensor:
    """The family's noise and schedule through `euler` from `cond` (`build_conditioning`); returns the target's
    latent tokens on the conditioning's device (the transformer's)."""
    return family_sampler(components).denoise(components, cond, settings, uncond_transformer=uncond_transformer,
                                              cfg_split=cfg_split, progress=progress, cancel=cancel)


def decode(components, latents: torch.Tensor, width: int, height: int) -> torch.Tensor:
    """The target's latent tokens -> (1, H, W, C) float32 image in [0, 1] on the CPU (decoded on the VAE's device;
    C = 4, RGBA, for a family whose VAE decodes alpha)."""
    return family_sampler(components).decode(components, latents, width, height)


def sample(components, prompt: str, images: Sequence, settings: SampleSettings = SampleSettings(), *,
           uncond_transformer=None, cfg_split=None, progress: ProgressFn | None = None,
           cancel: CancelToken | None = None) -> torch.Tensor:
    """Edit `images` (the control or reference images the variant takes: `variants.Variant.controls_text`) by
    `prompt`; returns (1, H, W, 3) in [0, 1], (1, H, W, 4) RGBA for a model whose VAE decodes alpha."""
    return family_sampler(components).sample(components, prompt, images, settings,
                                             uncond_transformer=uncond_transformer, cfg_split=cfg_split,
                                             progress=progress, cancel=cancel)


class NonFiniteError(ValueError):
    """Sampling produced NaN or Inf values: no image is written from them."""


def check_finite(latents: torch.Tensor, what: str) -> None:
    """NonFiniteError when `latents` hold NaN or Inf (one host sync per image, before decoding)."""
    if not bool(torch.isfinite(latents).all()):
        raise NonFiniteError(f"{what} holds NaN or Inf values, so no image is written; a LoRA with extreme "
                             "weights, a too high strength or CFG scale, or float16 overflow (use bfloat16 or "
                             "float32) causes this")
