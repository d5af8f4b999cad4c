"""Sampler behaviour beyond parity: split CFG, shift modes, progress, cancellation, bad sizes."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from qwen_edit_core.families.qwen_image import sampler as family_sampler
from qwen_edit_core.sample import sampler
from qwen_edit_core.model.components import load_components, replicate
from qwen_edit_core.model.devices import DevicePlan
from qwen_edit_core.common.progress import CancelToken, Cancelled

from tolerances import TINY_SAMPLER_ROUNDINGS, assert_close_fp32


@pytest.fixture(scope="module")
def comps(tiny_edit_dir):
    return load_components(tiny_edit_dir, DevicePlan.from_mapping({}))


def _image(seed=0, w=64, h=64):
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 255, (h, w, 3), dtype=np.uint8))


SMALL = dict(num_inference_steps=3, seed=3, width=128, height=128, vae_area=128 * 128)


def test_split_cfg_equals_sequential(comps):
    """Two replicas (here both on the CPU, each branch in its own thread) give the sequential result."""
    seq = sampler.sample(comps, "x", [_image()], sampler.SampleSettings(**SMALL))
    replica = replicate(comps.transformer, torch.device("cpu"))
    split = sampler.sample(comps, "x", [_image()], sampler.SampleSettings(cfg_mode="split", **SMALL),
                           uncond_transformer=replica)
    # the uncond branch runs at batch 1 on its replica instead of beside the cond one: other kernels, so equal
    # up to float32 rounding along the sampler's chain, on pictures in [0, 1]
    assert_close_fp32(split, seq, ops=TINY_SAMPLER_ROUNDINGS, what="picture with split CFG vs sequential")


def test_split_needs_a_replica(comps):
    with pytest.raises(ValueError, match="split"):
        sampler.sample(comps, "x", [_image()], sampler.SampleSettings(cfg_mode="split", **SMALL))


def test_fixed_shift_uses_the_given_mu(comps):
    settings = sampler.SampleSettings(shift_mode="fixed", fixed_mu=1.15, **SMALL)
    _, timesteps, mu = family_sampler.make_timesteps(comps.scheduler_config, settings, 64, "cpu")
    assert mu == 1.15
    dynamic = family_sampler.make_timesteps(comps.scheduler_config, sampler.SampleSettings(**SMALL), 64, "cpu")
    assert not torch.allclose(timesteps, dynamic[1])


def test_progress_every_step_and_cancel(comps):
    seen = []
    sampler.sample(comps, "x", [_image()], sampler.SampleSettings(**SMALL), progress=seen.append)
    assert [e.step for e in seen] == [1, 2, 3] and all(e.total == 3 for e in seen)
    assert seen[-1].preview is not None

    token = CancelToken()

    def stop_after_first(event):
        token.cancel()

    with pytest.raises(Cancelled):
        sampler.sample(comps, "x", [_image()], sampler.SampleSettings(**SMALL), progress=stop_after_first,
                       cancel=token)


def test_batched_cfg_of_different_lengths_runs_varlen_and_equals_the_key_mask(tiny_edit_dir, monkeypatch):
    """Cond and uncond of different lengths in one batched call: variable-length attention over each prompt's
    valid tokens (no padded key mask), the latents of the key-mask path up to float32 rounding."""
    settings = sampler.SampleSettings(cfg_mode="batched", negative_prompt="a much longer negative prompt than x",
                                      **SMALL)

    def run(packed: bool):
        fresh = load_components(tiny_edit_dir, DevicePlan.from_mapping({}))
        if not packed:
            monkeypatch.setattr(family_sampler, "_packed_cfg", lambda *a: None)
        cond = sampler.build_conditioning(fresh, "x", [_image()], settings)
        assert cond.cond.lengths[0] != cond.uncond.lengths[0]
        before = dict(fresh.transformer.attn_processors)
        during = []
        latents = sampler.denoise(fresh, cond, settings, progress=lambda event: during.append(
            next(iter(fresh.transformer.attn_processors.values()))))
        assert fresh.transformer.attn_processors == before  # the model's own processors back after sampling
        return latents, getattr(during[-1], "calls", None)

    varlen, calls = run(packed=True)
    assert calls is not None and calls["packed"] > 0 and calls["masked"] == 0 and calls["fused"] == 0, calls
    masked, _ = run(packed=False)
    assert_close_fp32(varlen, masked, ops=TINY_SAMPLER_ROUNDINGS, what="batched CFG latents, varlen vs key mask")


def test_cfg_off_when_scale_at_most_one(comps):
    calls = []
    handle = comps.transformer.register_forward_hook(lambda *a: calls.append(1))
    try:
        sampler.sample(comps, "x", [_image()], sampler.SampleSettings(true_cfg_scale=1.0, **SMALL))
    finally:
        handle.remove()
    assert len(calls) == SMALL["num_inference_steps"]


@pytest.mark.parametrize("kw", [dict(width=8), dict(height=15)])
def test_size_under_one_patch_is_refused(comps, kw):
    with pytest.raises(ValueError, match="latent patch"):
        sampler.sample(comps, "x", [_image()], sampler.SampleSettings(**{**SMALL, **kw}))


def test_edit_model_refuses_two_controls(comps):
    with pytest.raises(ValueError, match="one control image"):
        sampler.sample(comps, "x", [_image(), _image(1)], sampler.SampleSettings(**SMALL))


def test_sampling_refuses_the_controls_training_refuses_and_logs_rounding(tiny_edit_dir, caplog):
    import logging

    from qwen_edit_core.model import geometry
    from qwen_edit_core.families.qwen_image.sampler import prepare_images
    from qwen_edit_core.sample.sampler import SampleSettings
    settings = SampleSettings(num_inference_steps=1, width=100, height=128, vae_area=128 * 128)
    with pytest.raises(ValueError, match=r"control image 1 is 1x1, too small; accepted: at least 64 px"):
        prepare_images([Image.new("RGB", (1, 1))], "edit", settings)
    with pytest.raises(ValueError, match="control image 1 is 63x200"):
        prepare_images([Image.new("RGB", (63, 200))], "edit", settings)
    with caplog.at_level(logging.INFO, logger="qwen_edit_core.model.geometry"):
        *_, size = prepare_images([Image.new("RGB", (64, 64))], "edit", settings)
    assert size == (96, 128) and "output size 100x128 rounded down to 96x128" in caplog.text
    assert geometry.MIN_SIDE == 64  # the dataset's default minimum is the same constant
    from qwen_edit_core.data.dataset import load_dataset
    import inspect
    assert inspect.signature(load_dataset).parameters["min_side"].default == geometry.MIN_SIDE
    assert geometry.MAX_PIXELS == 64_000_000  # 64 MP, for training pairs and sampling controls alike
    assert inspect.signature(load_dataset).parameters["max_pixels"].default == geometry.MAX_PIXELS


def test_a_non_finite_latent_raises_instead_of_writing_an_image(comps):
    """A NaN LoRA/overflow makes the latent NaN: the sampler refuses to decode it (no garbage image)."""
    weight = comps.transformer.proj_out.weight
    saved = weight.detach().clone()
    try:
        with torch.no_grad():
            weight[0, 0] = float("nan")
        with pytest.raises(sampler.NonFiniteError, match="NaN or Inf.*no image is written"):
            sampler.sample(comps, "x", [_image()], sampler.SampleSettings(**{**SMALL, "num_inference_steps": 1}))
    finally:
        with torch.no_grad():
            weight.copy_(saved)
