"""Flow-matching maths: the resolution-dependent shift, timestep sampling, noising, targets, loss weights.

Small pure functions in the spirit of diffusers' training_utils; the trainer and the sampler call them.
Conventions: sigma in (0, 1] is the noise level, x_sigma = (1 - sigma) * x0 + sigma * noise, the model
predicts the velocity noise - x0, and the transformer takes `timestep = sigma` (= t / 1000).
"""

from __future__ import annotations

import math

import torch

TIMESTEP_SCHEMES = ("shift", "uniform", "logit_normal", "fixed_shift")
LOSS_WEIGHTINGS = ("none", "sigma_sqrt", "cosmap")
_MIN_SIGMA = 1e-3


def calculate_mu(image_seq_len: int, base_seq_len: int = 256, max_seq_len: int = 8192, base_shift: float = 0.5,
                 max_shift: float = 0.9) -> float:
    """mu = m * n + b, linear in the target token count n between (base_seq_len, base_shift) and
    (max_seq_len, max_shift): about 0.69 at 1 MP (4096 tokens) for Qwen-Image."""
    m = (max_shift - base_shift) / (max_seq_len - base_seq_len)
    return image_seq_len * m + (base_shift - m * base_seq_len)


def mu_from_scheduler_config(config: dict, image_seq_len: int) -> float:
    """`calculate_mu` with the scheduler config's parameters (the pipelines' defaults where absent)."""
    return calculate_mu(image_seq_len, config.get("base_image_seq_len", 256), config.get("max_image_seq_len", 4096),
                        config.get("base_shift", 0.5), config.get("max_shift", 1.15))


def time_shift_exponential(mu: float, sigma: torch.Tensor) -> torch.Tensor:
    """exp(mu) / (exp(mu) + (1/sigma - 1)): the scheduler's "exponential" dynamic shift."""
    return math.exp(mu) / (math.exp(mu) + (1 / sigma - 1))


def sample_sigmas(batch_size: int, scheme: str = "shift", *, generator: torch.Generator | None = None,
                  device="cpu", mu: float | None = None, logit_mean: float = 0.0, logit_std: float = 1.0,
                  shift: float | None = None) -> torch.Tensor:
    """Training noise levels (B,) in (0, 1], float32, drawn on the CPU from `generator` only.

    - "shift" (default): uniform u shifted with the sampler's resolution-dependent mu, so training sees the
      noise levels sampling visits;
    - "uniform": u;
    - "logit_normal": sigmoid(N(logit_mean, logit_std));
    - "fixed_shift": s*u / (1 + (s-1)*u) with s = `shift` (SD3-style).
    """
    if scheme not in TIMESTEP_SCHEMES:
        raise ValueError(f"timestep sampling {scheme!r} is not accepted; accepted: {', '.join(TIMESTEP_SCHEMES)}")
    if scheme == "logit_normal":
        u = torch.sigmoid(torch.randn(batch_size, generator=generator) * logit_std + logit_mean)
    else:
        u = torch.rand(batch_size, generator=generator)
    u = u.clamp(_MIN_SIGMA, 1.0)
    if scheme == "shift":
        if mu is None:
            raise ValueError("timestep sampling 'shift' needs mu (from the target token count)")
        u = time_shift_exponential(mu, u)
    elif scheme == "fixed_shift":
        s = 3.0 if shift is None else shift
        u = s * u / (1 + (s - 1) * u)
    return u.to(device=device, dtype=torch.float32)


def noisy_latents(latents: torch.Tensor, noise: torch.Tensor, sigmas: torch.Tensor) -> torch.Tensor:
    """(1 - sigma) * x0 + sigma * noise, sigma broadcast over all but the batch dimension."""
    s = sigmas.view(-1, *([1] * (latents.dim() - 1)))
    return (1 - s) * latents + s * noise


def flow_target(latents: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """The velocity the model learns: noise - x0."""
    return noise - latents


def loss_weights(scheme: str, sigmas: torch.Tensor) -> torch.Tensor:
    """Per-sample loss weights: "none" (ones), "sigma_sqrt" (sigma^-2), "cosmap" (2 / (pi (1 - 2s + 2s^2)))."""
    if scheme == "none":
        return torch.ones_like(sigmas, dtype=torch.float32)
    if scheme == "sigma_sqrt":
        return (sigmas.float() ** -2.0)
    if scheme == "cosmap":
        s = sigmas.float()
        return 2 / (math.pi * (1 - 2 * s + 2 * s**2))
    raise ValueError(f"loss weighting {scheme!r} is not accepted; accepted: {', '.join(LOSS_WEIGHTINGS)}")


def masked_mse(pred: torch.Tensor, target: torch.Tensor, weights: torch.Tensor,
               token_mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(loss, per-sample loss): squared error averaged over channels and valid tokens of each sample, times
    the sample's weight, then averaged over samples.

    Averaging per sample first makes every sample count equally whatever its token count, so a padded
    mixed-resolution batch gives the mean of the one-by-one losses; padded tokens contribute nothing.
    """
    err = (pred.float() - target.float()).square().mean(dim=-1)  # (B, S)
    if token_mask is None:
        per_sample = err.mean(dim=1)
    else:
        mask = token_mask.to(err.dtype)
        per_sample = (err * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1)
    per_sample = per_sample * weights.to(per_sample.device, per_sample.dtype)
    return per_sample.mean(), per_sample
