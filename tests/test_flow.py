"""Flow-matching helpers: the shift equals the scheduler's, sampling is reproducible, the loss ignores padding."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from diffusers import FlowMatchEulerDiscreteScheduler

from qwen_edit_core import flow
from qwen_edit_core.tiny import SCHEDULER_CONFIG


def test_mu_matches_facts():
    assert flow.calculate_mu(256) == pytest.approx(0.5)
    assert flow.calculate_mu(8192) == pytest.approx(0.9)
    assert flow.mu_from_scheduler_config(SCHEDULER_CONFIG, 4096) == pytest.approx(0.6935, abs=1e-3)


def test_time_shift_equals_the_schedulers():
    config = {**SCHEDULER_CONFIG, "shift_terminal": None}
    scheduler = FlowMatchEulerDiscreteScheduler.from_config(config)
    sigmas = np.linspace(1.0, 1 / 10, 10)
    scheduler.set_timesteps(sigmas=sigmas, mu=0.8)
    ours = flow.time_shift_exponential(0.8, torch.tensor(sigmas, dtype=torch.float32))
    assert torch.allclose(scheduler.sigmas[:-1].float(), ours, atol=1e-6)


@pytest.mark.parametrize("scheme", flow.TIMESTEP_SCHEMES)
def test_sample_sigmas_reproducible_and_in_range(scheme):
    draw = lambda: flow.sample_sigmas(64, scheme, generator=torch.Generator().manual_seed(1), mu=0.7)  # noqa: E731
    a, b = draw(), draw()
    assert torch.equal(a, b) and a.dtype == torch.float32
    assert (a > 0).all() and (a <= 1).all()
    with pytest.raises(ValueError):
        flow.sample_sigmas(1, "bogus")


def test_noising_target_and_weights():
    x, n = torch.ones(2, 3, 4), torch.zeros(2, 3, 4)
    s = torch.tensor([0.25, 1.0])
    assert torch.allclose(flow.noisy_latents(x, n, s)[:, 0, 0], torch.tensor([0.75, 0.0]))
    assert torch.equal(flow.flow_target(x, n), -x)
    assert torch.equal(flow.loss_weights("none", s), torch.ones(2))
    assert torch.allclose(flow.loss_weights("sigma_sqrt", s), s ** -2)
    assert flow.loss_weights("cosmap", torch.tensor([0.5]))[0].item() == pytest.approx(2 / (math.pi * 0.5))


def test_masked_mse_ignores_padding_and_weights_samples_equally():
    pred = torch.zeros(2, 4, 3)
    target = torch.ones(2, 4, 3)
    target[0, 2:] = 100.0  # padding of sample 0
    mask = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1]], dtype=torch.bool)
    loss, per = flow.masked_mse(pred, target, torch.ones(2), mask)
    assert torch.allclose(per, torch.ones(2)) and loss.item() == pytest.approx(1.0)
    loss, _ = flow.masked_mse(pred, torch.ones(2, 4, 3), torch.tensor([1.0, 3.0]))
    assert loss.item() == pytest.approx(2.0)
