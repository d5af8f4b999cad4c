"""Named sampling schedules: which sigmas the Euler loop visits, which CFG formula it uses, which noise it draws.

- ``diffusers`` (the default): diffusers' Qwen-Image-Edit pipelines. FlowMatchEulerDiscreteScheduler from the
  model's scheduler config, sigmas ``linspace(1, 1/n, n)`` shifted with a dynamic mu from the target token count
  (`flow.mu_from_scheduler_config`) and stretched to ``shift_terminal``; true CFG with the per-token norm
  rescale (the family sampler's `guide`, families/<family>/sampler.py).
- ``lightning``: the few-step "Lightning" LoRAs' recipe (4 or 8 steps at CFG 1): the same scheduler with
  ``base_shift = max_shift = ln 3`` (a fixed shift of 3 through the exponential time shift) and
  ``shift_terminal = None`` (no terminal stretch).
- ``comfyui``: what stock ComfyUI does for Qwen-Image(-Edit) with its default model sampling (ComfyUI commit
  a125cd84b054a57729b5eecab930ca9408719832, 0.3.64): comfy/supported_models.py ``QwenImage.sampling_settings
  = {"multiplier": 1.0, "shift": 1.15}`` on ``ModelType.FLUX`` (comfy/model_base.py), so
  ``ModelSamplingFlux``: a float32 table of 10000 sigmas ``exp(1.15) / (exp(1.15) + 1/t - 1)`` for
  ``t = 1/10000 .. 1``; the ``simple`` scheduler picks ``table[-(1 + int(i * 10000 / n))]`` for i < n, then 0
  (comfy/samplers.py ``simple_scheduler``); Euler in k-diffusion's form (``denoised = x - sigma * v``,
  ``d = (x - denoised) / sigma``, ``x += d * (sigma_next - sigma)``); plain CFG ``uncond + cfg * (cond -
  uncond)`` on the denoised predictions, no rescale, and no uncond pass at CFG 1 (comfy/samplers.py
  ``cfg_function``, ``sampling_function``); noise ``torch.randn`` of the latent's shape in float32 on the CPU
  from ``torch.manual_seed(seed)`` (comfy/sample.py ``prepare_noise``).

A ``shift`` override replaces the preset's shift: with ``diffusers`` and ``lightning`` a fixed shift s (mu =
ln s: sigma' = s * sigma / (1 + (s - 1) * sigma), no dynamic mu); with ``comfyui`` ComfyUI's
ModelSamplingAuraFlow node at that shift (comfy_extras/nodes_model_advanced.py: ``ModelSamplingDiscreteFlow``
with multiplier 1.0, a table of 1000 sigmas ``s * t / (1 + (s - 1) * t)``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

SCHEDULES = ("diffusers", "comfyui", "lightning")
#: ComfyUI's default model-sampling shift for Qwen-Image (ModelSamplingFlux: used as mu, exponential shift)
COMFYUI_QWEN_MU = 1.15
COMFYUI_FLUX_TABLE = 10000
COMFYUI_AURAFLOW_TABLE = 1000
#: the Lightning LoRAs' fixed shift (their scheduler config's base_shift = max_shift = ln 3)
LIGHTNING_SHIFT = 3.0


@dataclass(frozen=True)
class Preset:
    """A schedule's defaults: the step count and CFG scale its users run it with (None: the caller's)."""

    name: str
    steps: int | None
    cfg: float | None
    description: str


PRESETS: dict[str, Preset] = {
    "diffusers": Preset("diffusers", None, None, "diffusers' pipelines: dynamic shift from the image size, "
                        "true CFG with norm rescale"),
    "comfyui": Preset("comfyui", None, None, "stock ComfyUI: default Qwen-Image model sampling, simple scheduler, "
                      "Euler, plain CFG, ComfyUI's noise"),
    "lightning": Preset("lightning", 4, 1.0, "few-step Lightning LoRAs: fixed shift 3, no terminal stretch, "
                        "4 or 8 steps at CFG 1"),
}


def check_schedule(name: str, shift: float | None = None) -> Preset:
    """The preset called `name`; a ValueError naming the accepted ones otherwise (and for a shift <= 0)."""
    if name not in PRESETS:
        raise ValueError(f"schedule {name!r} is not accepted; accepted: {', '.join(SCHEDULES)}")
    if shift is not None and not shift > 0:
        raise ValueError(f"shift must be > 0 (or unset for the schedule's own), got {shift}")
    return PRESETS[name]


def lightning_scheduler_config(scheduler_config: dict, shift: float = LIGHTNING_SHIFT) -> dict:
    """The model's FlowMatchEulerDiscreteScheduler config with the Lightning recipe: dynamic shifting with
    ``base_shift = max_shift = ln shift`` (so mu = ln shift at every size), exponential time shift,
    ``shift_terminal = None``."""
    return {**scheduler_config, "base_shift": math.log(shift), "max_shift": math.log(shift),
            "use_dynamic_shifting": True, "time_shift_type": "exponential", "shift_terminal": None, "shift": 1.0}


def comfyui_sigma_table(shift: float | None = None, mu: float = COMFYUI_QWEN_MU) -> torch.Tensor:
    """ComfyUI's model-sampling table (float32, ascending): the default ModelSamplingFlux of the model (`mu`:
    1.15 for Qwen-Image, the other family's own `mu`; 10000 entries) when `shift` is None, else
    ModelSamplingAuraFlow(shift) (1000 entries)."""
    if shift is None:
        t = torch.arange(1, COMFYUI_FLUX_TABLE + 1, 1) / COMFYUI_FLUX_TABLE
        return math.exp(mu) / (math.exp(mu) + (1 / t - 1) ** 1.0)
    t = torch.arange(1, COMFYUI_AURAFLOW_TABLE + 1, 1) / COMFYUI_AURAFLOW_TABLE * 1.0
    return t if shift == 1.0 else shift * t / (1 + (shift - 1) * t)


def comfyui_sigmas(steps: int, shift: float | None = None, mu: float = COMFYUI_QWEN_MU) -> torch.Tensor:
    """ComfyUI's ``simple`` scheduler over `comfyui_sigma_table`: steps + 1 float32 sigmas ending in 0."""
    table = comfyui_sigma_table(shift, mu)
    stride = len(table) / steps
    sigmas = [float(table[-(1 + int(i * stride))]) for i in range(steps)] + [0.0]
    return torch.FloatTensor(sigmas)


class ComfyEuler:
    """ComfyUI's Euler sampler over a sigma list, with the scheduler interface the loop uses (`timesteps`,
    `step`): `timesteps` are sigma * 1000 (the transformer is called with timestep / 1000 = sigma)."""

    def __init__(self, sigmas: torch.Tensor, device):
        self.sigmas = sigmas.to(device)
        self.timesteps = self.sigmas[:-1] * 1000
        self._index = 0

    def step(self, velocity: torch.Tensor, timestep, sample: torch.Tensor, return_dict: bool = False):
        sigma, sigma_next = self.sigmas[self._index], self.sigmas[self._index + 1]
        self._index += 1
        denoised = sample - velocity * sigma
        d = (sample - denoised) / sigma
        return (sample + d * (sigma_next - sigma),)



def steps_and_cfg(name: str, steps: int | None, cfg: float | None, fallback_steps: int = 20,
                  fallback_cfg: float = 4.0) -> tuple[int, float]:
    """The step count and CFG scale to run: the given ones, else the preset's (lightning: 4 and 1.0), else the
    fallbacks (the caller's configured values)."""
    preset = check_schedule(name)
    steps = steps if steps is not None else (preset.steps if preset.steps is not None else fallback_steps)
    cfg = cfg if cfg is not None else (preset.cfg if preset.cfg is not None else fallback_cfg)
    return int(steps), float(cfg)


#: Published sigma lists of few-step adapters, by name: (sigmas without the final 0, CFG scale, source). Each
#: adapter was distilled on its own list; they are not interchangeable. docs/MODEL.md gives the sources.
SIGMA_PRESETS: dict[str, tuple[tuple[float, ...], float, str]] = {
    "qwen21-dmd-6step": ((1.0, 0.9375, 0.875, 0.75, 0.5, 0.25), 1.0,
                         "Qwen-Image-2.1 DMD 6-step LoRA: sigmas [1.0, 0.9375, 0.875, 0.75, 0.5, 0.25] at CFG 1"),
    "qwen21-turbo-8step": ((1.0, 0.978453, 0.95418, 0.926626, 0.89508, 0.845148, 0.704534, 0.414568), 1.0,
                           "Qwen-Image-2.1-Turbo: the `sample_sigmas` its checkpoint ships (8 steps, CFG off; its "
                           "scheduler has shift 1.0 and dynamic shifting off, so they run unshifted)"),
}


def check_sigmas(sigmas) -> tuple[float, ...]:
    """An explicit sigma list as a tuple: at least one value, each in (0, 1], strictly decreasing (the final 0 is
    the scheduler's own); a ValueError naming the first bad value otherwise."""
    values = tuple(float(s) for s in sigmas)
    if not values:
        raise ValueError("sigmas: empty list; give at least one sigma in (0, 1], e.g. 1.0, 0.75, 0.5, 0.25")
    for i, s in enumerate(values):
        if not 0 < s <= 1:
            raise ValueError(f"sigmas[{i}] = {s} is outside (0, 1]; the final 0 is added by the scheduler")
        if i and s >= values[i - 1]:
            raise ValueError(f"sigmas must decrease: sigmas[{i}] = {s} follows {values[i - 1]}")
    return values


def resolve_sigmas(value) -> tuple[tuple[float, ...] | None, float | None]:
    """(sigma list or None, the preset's CFG scale or None) of a config/call value: empty -> (None, None), a preset
    name or a text list (`parse_sigmas`), or a sequence of numbers (`check_sigmas`)."""
    if value is None or (not isinstance(value, str) and len(value) == 0) or (isinstance(value, str) and
                                                                              not value.strip()):
        return None, None
    if isinstance(value, str):
        preset = SIGMA_PRESETS.get(value.strip())
        return parse_sigmas(value), (preset[1] if preset else None)
    return check_sigmas(value), None


def parse_sigmas(text: str) -> tuple[float, ...]:
    """`--sigmas` / a node's text: a preset name (SIGMA_PRESETS) or comma/space-separated numbers."""
    text = text.strip()
    if text in SIGMA_PRESETS:
        return SIGMA_PRESETS[text][0]
    try:
        values = [float(v) for v in text.replace(",", " ").split()]
    except ValueError:
        raise ValueError(f"sigmas {text!r}: neither a preset ({', '.join(SIGMA_PRESETS)}) nor a list of numbers such "
                         "as '1.0, 0.75, 0.5, 0.25'") from None
    return check_sigmas(values)
