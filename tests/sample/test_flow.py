"""Flow-matching helpers: mu and the time shift equal diffusers', sampling is reproducible, the loss ignores padding."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from diffusers import FlowMatchEulerDiscreteScheduler
from diffusers.pipelines.qwenimage.pipeline_qwenimage_edit import calculate_shift

from qwen_edit_core.sample import flow

from tolerances import assert_close_fp32

# Qwen-Image's scheduler config (docs/MODEL.md), written here so this test depends on nothing else in the project.
QWEN_SCHEDULER = {
    "base_image_seq_len": 256, "base_shift": 0.5, "invert_sigmas": False, "max_image_seq_len": 8192,
    "max_shift": 0.9, "num_train_timesteps": 1000, "shift": 1.0, "shift_terminal": 0.02,
    "stochastic_sampling": False, "time_shift_type": "exponential", "use_beta_sigmas": False,
    "use_dynamic_shifting": True, "use_exponential_sigmas": False, "use_karras_sigmas": False,
}


def test_mu_matches_facts_and_the_pipelines_calculate_shift():
    assert flow.calculate_mu(256) == pytest.approx(0.5)
    assert flow.calculate_mu(8192) == pytest.approx(0.9)
    assert flow.mu_from_scheduler_config(QWEN_SCHEDULER, 4096) == pytest.approx(0.6935, abs=1e-3)
    for n in (4, 256, 1024, 4096, 8192, 9000):
        expected = calculate_shift(n, 256, 8192, 0.5, 0.9)
        assert flow.mu_from_scheduler_config(QWEN_SCHEDULER, n) == pytest.approx(expected, rel=1e-12)
        assert flow.calculate_mu(n) == pytest.approx(expected, rel=1e-12)
    # Absent keys fall back to what the pipelines use (4096 / 1.15).
    assert flow.mu_from_scheduler_config({}, 1000) == pytest.approx(calculate_shift(1000), rel=1e-12)


@pytest.mark.parametrize("mu", [0.5, 0.69, 0.9, 1.15])
def test_time_shift_equals_the_schedulers(mu):
    config = {**QWEN_SCHEDULER, "shift_terminal": None}  # the terminal stretch is a sampling-only detail
    scheduler = FlowMatchEulerDiscreteScheduler.from_config(config)
    sigmas = np.linspace(1.0, 1 / 20, 20)
    scheduler.set_timesteps(sigmas=sigmas, mu=mu)
    ours = flow.time_shift_exponential(mu, torch.tensor(sigmas, dtype=torch.float32))
    # diffusers shifts in float64; ours is the same formula in float32 (two exps' worth, a sum, two divisions)
    assert_close_fp32(ours, scheduler.sigmas[:-1].float(), ops=4, what="shifted sigmas vs the scheduler's")
    assert ours[0].item() == pytest.approx(1.0)


@pytest.mark.parametrize("scheme", flow.TIMESTEP_SCHEMES)
def test_sample_sigmas_reproducible_shaped_and_in_range(scheme):
    def draw(seed=1):
        return flow.sample_sigmas(4096, scheme, generator=torch.Generator().manual_seed(seed), mu=0.7, shift=3.0)
    a, b = draw(), draw()
    assert a.shape == (4096,) and a.dtype == torch.float32
    assert torch.equal(a, b)
    assert not torch.equal(a, draw(2))
    assert (a > 0).all() and (a <= 1).all() and a.min() >= 1e-4


def test_sample_sigmas_uses_only_the_generator():
    """The global RNG neither changes the draw nor is consumed by it."""
    torch.manual_seed(0)
    before = torch.random.get_rng_state()
    a = flow.sample_sigmas(8, "shift", generator=torch.Generator().manual_seed(5), mu=0.7)
    assert torch.equal(torch.random.get_rng_state(), before)
    torch.manual_seed(123)
    assert torch.equal(a, flow.sample_sigmas(8, "shift", generator=torch.Generator().manual_seed(5), mu=0.7))


def test_sample_sigmas_formulas():
    u = torch.rand(16, generator=torch.Generator().manual_seed(3)).clamp(1e-3, 1.0)
    gen = lambda: torch.Generator().manual_seed(3)  # noqa: E731
    assert torch.equal(flow.sample_sigmas(16, "uniform", generator=gen()), u)
    assert torch.allclose(flow.sample_sigmas(16, "shift", generator=gen(), mu=0.8),
                          math.exp(0.8) / (math.exp(0.8) + (1 / u - 1)))
    assert torch.allclose(flow.sample_sigmas(16, "fixed_shift", generator=gen(), shift=2.0), 2 * u / (1 + u))
    n = torch.randn(16, generator=gen())
    assert torch.allclose(flow.sample_sigmas(16, "logit_normal", generator=gen(), logit_mean=0.3, logit_std=0.5),
                          torch.sigmoid(n * 0.5 + 0.3).clamp(1e-3, 1.0))
    # The shift moves the draws towards noise, more at higher resolution.
    low = flow.sample_sigmas(4096, "shift", generator=gen(), mu=flow.calculate_mu(256))
    high = flow.sample_sigmas(4096, "shift", generator=gen(), mu=flow.calculate_mu(8192))
    assert (high >= low).all() and high.mean() > low.mean() > 0.5


def test_sample_sigmas_refuses_bad_arguments():
    with pytest.raises(ValueError, match="accepted: shift, uniform"):
        flow.sample_sigmas(1, "bogus", generator=torch.Generator())
    with pytest.raises(ValueError, match="needs mu"):
        flow.sample_sigmas(1, "shift", generator=torch.Generator())
    with pytest.raises(ValueError, match="fixed_shift"):
        flow.sample_sigmas(1, "fixed_shift", generator=torch.Generator(), shift=0.0)


def test_noising_target_and_weights():
    x, n = torch.ones(2, 3, 4), torch.zeros(2, 3, 4)
    s = torch.tensor([0.25, 1.0])
    assert flow.noisy_latents(x, n, s).shape == (2, 3, 4)
    assert torch.allclose(flow.noisy_latents(x, n, s)[:, 0, 0], torch.tensor([0.75, 0.0]))
    assert torch.allclose(flow.noisy_latents(torch.ones(2, 16, 1, 4, 4), torch.zeros(2, 16, 1, 4, 4), s)[:, 3, 0, 1, 2],
                          torch.tensor([0.75, 0.0]))
    assert torch.equal(flow.flow_target(x, n), -x)
    assert torch.equal(flow.loss_weights("none", s), torch.ones(2))
    assert torch.allclose(flow.loss_weights("sigma_sqrt", s), s ** -2)
    assert flow.loss_weights("cosmap", torch.tensor([0.5]))[0].item() == pytest.approx(2 / (math.pi * 0.5))
    with pytest.raises(ValueError, match="accepted: none, sigma_sqrt, cosmap"):
        flow.loss_weights("snr", s)


def test_loss_weights_equal_diffusers():
    from diffusers.training_utils import compute_loss_weighting_for_sd3
    s = torch.linspace(0.05, 1.0, 9)
    for scheme in ("sigma_sqrt", "cosmap"):
        assert torch.allclose(flow.loss_weights(scheme, s), compute_loss_weighting_for_sd3(scheme, s))


def _previous_loss_weights(scheme, sigmas):
    """The hand-written weights loss_weights computed before it called diffusers (kept as the reference)."""
    s = sigmas.float()
    if scheme == "none":
        return torch.ones_like(s)
    if scheme == "sigma_sqrt":
        return s ** -2.0
    return 2 / (math.pi * (1 - 2 * s + 2 * s**2))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_loss_weights_keep_the_previous_numbers(dtype):
    s = torch.cat([torch.linspace(0.001, 1.0, 257), torch.tensor([0.5, 0.25, 1e-3])]).to(dtype)
    for scheme in ("none", "sigma_sqrt", "cosmap"):
        got = flow.loss_weights(scheme, s)
        assert got.dtype == torch.float32 and got.shape == s.shape
        assert torch.equal(got, _previous_loss_weights(scheme, s)), scheme


def test_masked_mse_equals_a_manual_computation_and_ignores_padding():
    g = torch.Generator().manual_seed(0)
    pred, target = torch.randn(3, 5, 4, generator=g), torch.randn(3, 5, 4, generator=g)
    lengths = [5, 2, 3]
    mask = torch.arange(5)[None] < torch.tensor(lengths)[:, None]
    weights = torch.tensor([1.0, 2.0, 0.5])
    loss, per = flow.masked_mse(pred, target, weights, mask)
    manual = [weights[b] * ((pred[b, :n] - target[b, :n]) ** 2).mean() for b, n in enumerate(lengths)]
    # the same sums in another order: a mean over up to 5 x 4 values, then a weight
    assert_close_fp32(per, torch.stack(manual), ops=5 * 4 + 1, what="per-sample masked MSE vs manual")
    # and the mean over the batch: three more roundings
    assert_close_fp32(loss, torch.stack(manual).mean(), ops=5 * 4 + 1 + 3, what="masked MSE loss vs manual")
    # Padded tokens do not count, whatever they hold.
    garbage = target.clone()
    garbage[~mask] = 1e6
    assert torch.allclose(flow.masked_mse(pred, garbage, weights, mask)[1], per)
    # No mask: every token counts; each sample counts equally.
    loss, _ = flow.masked_mse(torch.zeros(2, 4, 3), torch.ones(2, 4, 3), torch.tensor([1.0, 3.0]))
    assert loss.item() == pytest.approx(2.0)
    with pytest.raises(ValueError, match="token_mask"):
        flow.masked_mse(pred, target, weights, mask[:, :4])
