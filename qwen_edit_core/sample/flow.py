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
#: uniform draws are clamped to [_MIN_SIGMA, 1] before any shift, so no sigma is 0 (x_sigma == x0 teaches nothing)
_MIN_SIGMA = 1e-3
#: SD3's default shift, used by "fixed_shift" when no shift is given
DEFAULT_FIXED_SHIFT = 3.0


def calculate_mu(image_seq_len: int, base_seq_len: int = 256, max_seq_len: int = 8192, base_shift: float = 0.5,
                 max_shift: float = 0.9) -> float:
    """The sampler's resolution-dependent shift: mu = m * n + b, linear in the target token count n through
    (base_seq_len, base_shift) and (max_seq_len, max_shift).

    The defaults are Qwen-Image's scheduler config, so mu is about 0.69 at 1 MP (4096 target tokens).
    Only the target image's tokens count, not the control images' (as in diffusers' pipelines).
    """
    m = (max_shift - base_shift) / (max_seq_len - base_seq_len)
    return image_seq_len * m + (base_shift - m * base_seq_len)


def mu_from_scheduler_config(config: dict, image_seq_len: int) -> float:
    """`calculate_mu` with a FlowMatchEulerDiscreteScheduler config's parameters.

    Absent keys take the fallbacks diffusers' Qwen pipelines use (256, 4096, 0.5, 1.15), so the result is
    what the pipeline would pass to `set_timesteps(mu=...)` for the same scheduler.
    """
    return calculate_mu(image_seq_len, config.get("base_image_seq_len", 256), config.get("max_image_seq_len", 4096),
                        config.get("base_shift", 0.5), config.get("max_shift", 1.15))


def time_shift_exponential(mu: float, sigma: torch.Tensor) -> torch.Tensor:
    """exp(mu) / (exp(mu) + (1/sigma - 1)): FlowMatchEulerDiscreteScheduler's dynamic shift with
    time_shift_type "exponential" (its exponent is 1.0). Maps 1 to 1 and keeps (0, 1] in (0, 1]."""
    return math.exp(mu) / (math.exp(mu) + (1 / sigma - 1))


def sample_sigmas(batch_size: int, scheme: str = "shift", *, generator: torch.Generator | None,
                  device="cpu", mu: float | None = None, logit_mean: float = 0.0, logit_std: float = 1.0,
                  shift: float | None = None) -> torch.Tensor:
    """Training noise levels (B,) in (0, 1], float32, drawn from `generator` only (on its device).

    - "shift" (the trainer's default): uniform u, then `time_shift_exponential(mu, u)` with mu from the target
      token count (`mu_from_scheduler_config`), so training sees the noise levels sampling visits;
    - "uniform": u;
    - "logit_normal": sigmoid(N(logit_mean, logit_std));
    - "fixed_shift": s*u / (1 + (s-1)*u) with s = `shift` (SD3-style; 3.0 when None).
    u is clamped to [1e-3, 1] before any shift. Pass the generator explicitly: None draws from torch's global
    RNG, which makes runs depend on everything else that drew before.
    """
    if scheme not in TIMESTEP_SCHEMES:
        raise ValueError(f"timestep sampling {scheme!r} is not accepted; accepted: {', '.join(TIMESTEP_SCHEMES)}")
    draw_device = generator.device if generator is not None else "cpu"
    if scheme == "logit_normal":
        normal = torch.randn(batch_size, generator=generator, device=draw_device, dtype=torch.float32)
        u = torch.sigmoid(normal * logit_std + logit_mean)
    else:
        u = torch.rand(batch_size, generator=generator, device=draw_device, dtype=torch.float32)
    u = u.clamp(_MIN_SIGMA, 1.0)
    if scheme == "shift":
        if mu is None:
            raise ValueError("timestep sampling 'shift' needs mu (flow.mu_from_scheduler_config of the target "
                             "token count)")
        u = time_shift_exponential(mu, u)
    elif scheme == "fixed_shift":
        s = DEFAULT_FIXED_SHIFT if shift is None else float(shift)
        if s <= 0:
            raise ValueError(f"fixed_shift must be > 0, got {s}")
        u = s * u / (1 + (s - 1) * u)
    return u.to(device=device, dtype=torch.float32)


def noisy_latents(latents: torch.Tensor, noise: torch.Tensor, sigmas: torch.Tensor) -> torch.Tensor:
    """(1 - sigma) * x0 + sigma * noise, sigma (B,) broadcast over all but the batch dimension."""
    s = sigmas.reshape(-1, *([1] * (latents.dim() - 1))).to(latents.dtype)
    return (1 - s) * latents + s * noise


def flow_target(latents: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """The velocity the model learns: noise - x0 (d x_sigma / d sigma)."""
    return noise - latents


def loss_weights(scheme: str, sigmas: torch.Tensor) -> torch.Tensor:
    """Per-sample loss weights, float32: diffusers' `compute_loss_weighting_for_sd3` on float32 sigmas,
    "none" (ones), "sigma_sqrt" (sigma^-2), "cosmap" (2 / (pi (1 - 2s + 2s^2))); an unknown scheme is refused
    (diffusers would silently give ones)."""
    from diffusers.training_utils import compute_loss_weighting_for_sd3
    if scheme not in LOSS_WEIGHTINGS:
        raise ValueError(f"loss weighting {scheme!r} is not accepted; accepted: {', '.join(LOSS_WEIGHTINGS)}")
    return compute_loss_weighting_for_sd3(scheme, sigmas.float()).float()


def masked_mse(pred: torch.Tensor, target: torch.Tensor, weights: torch.Tensor,
               token_mask: torch.Tensor | None = None,
               token_weights: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(loss, per-sample loss) of (B, S, C) predictions: the squared error averaged over channels, times each
    token's weight (`token_weights` (B, S), None = 1; region masks), averaged over the valid tokens of each
    sample (`token_mask` (B, S) bool, None = all valid), times the sample's weight (B,), then averaged over
    samples. Computed in float32.

    Why per sample first: every sample then counts equally whatever its resolution, so a padded
    mixed-resolution batch gives exactly the mean of the one-by-one losses (padded tokens contribute nothing),
    and changing the batch composition does not reweight large images over small ones.
    """
    if pred.shape != target.shape or pred.dim() != 3:
        raise ValueError(f"masked_mse: pred {tuple(pred.shape)} and target {tuple(target.shape)} must both be "
                         "(batch, tokens, channels)")
    if token_mask is not None and tuple(token_mask.shape) != tuple(pred.shape[:2]):
        raise ValueError(f"masked_mse: token_mask {tuple(token_mask.shape)} must be (batch, tokens) = "
                         f"{tuple(pred.shape[:2])}")
    err = (pred.float() - target.float()).square().mean(dim=-1)  # (B, S)
    if token_weights is not None:
        if tuple(token_weights.shape) != tuple(err.shape):
            raise ValueError(f"masked_mse: token_weights {tuple(token_weights.shape)} must be (batch, tokens) = "
                             f"{tuple(err.shape)}")
        err = err * token_weights.to(err.device, err.dtype)
    if token_mask is None:
        per_sample = err.mean(dim=1)
    else:
        mask = token_mask.to(device=err.device, dtype=err.dtype)
        per_sample = (err * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1)
    per_sample = per_sample * weights.to(per_sample.device, per_sample.dtype).reshape(-1)
    return per_sample.mean(), per_sample
