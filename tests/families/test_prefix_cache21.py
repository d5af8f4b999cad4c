"""Qwen-Image-2.1's prefix K/V cache is planned before sampling (families/qwen_image_21/prefix_cache.py): its size
is known from the prompts and references before a step runs, it goes to the host, to int8 or off when the device
budget is short, each at the right budget and logged with the sizes, and sampling is refused with the size when
nothing fits. On the tiny 2.1 model, fp32, CPU."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch
from PIL import Image

from qwen_edit_core.families.qwen_image_21 import prefix_cache
from qwen_edit_core.families.qwen_image_21 import sampler as sampler21
from qwen_edit_core.model.components import load_components
from qwen_edit_core.model.devices import DevicePlan
from qwen_edit_core.sample import sampler

SIDE = 64
STEPS = 2


@pytest.fixture(scope="module")
def edit(tiny_21_dir):
    comps = load_components(tiny_21_dir, DevicePlan.from_mapping({}))
    rng = np.random.default_rng(0)
    refs = [Image.fromarray(rng.integers(0, 255, (h, w, 3), dtype=np.uint8)) for w, h in ((64, 64), (96, 48))]
    settings = sampler.SampleSettings(num_inference_steps=STEPS, true_cfg_scale=3.0, negative_prompt="dark",
                                      seed=5, vae_area=SIDE * SIDE)
    cond = sampler21.build_conditioning(comps, "make the sky purple", refs, settings)
    return comps, cond, settings, cond.width * cond.height // 16 ** 2


def test_estimate_equals_the_cache_the_transformer_fills(edit):
    comps, cond, settings, n = edit
    plan = sampler21.plan_prefix_cache(comps.transformer, cond, settings, n)
    assert plan.place == "device" and len(plan.tokens) == 2 and plan.tokens[0] != plan.tokens[1]
    shape = prefix_cache.cache_shape(comps.transformer.config, torch.float32)
    latents = torch.zeros(1, n, comps.transformer.config.in_channels)
    hidden = torch.cat([cond.reference_tokens, latents], 1)
    with torch.no_grad():
        for branch, tokens in zip(sampler21.branches(comps.transformer, cond, settings, plan), plan.tokens):
            branch(hidden, 0, torch.ones(1), cond, n)
            assert branch.cache.nbytes() == shape.bytes(tokens)
            assert branch.cache.get_layer(0).k.shape[1] == tokens
    assert plan.bytes == shape.bytes(sum(plan.tokens)) == plan.device_bytes


def _plan(budget, host_budget=None, tokens=(41_000, 40_990)):
    shape = prefix_cache.CacheShape(layers=32, heads=32, head_dim=128, dtype=torch.bfloat16)
    return prefix_cache.plan(budget=budget, host_budget=host_budget, weights=14 * 2**30, shape=shape,
                             tokens=tokens, target_tokens=4096, dim=4096)


def test_each_place_is_chosen_at_its_budget():
    shape = prefix_cache.CacheShape(layers=32, heads=32, head_dim=128, dtype=torch.bfloat16)
    tokens = (41_000, 40_990)
    assert shape.bytes(sum(tokens)) == 32 * 2 * sum(tokens) * 4096 * 2  # ~0.5 MiB a token and branch
    peaks = {p: prefix_cache.peak_bytes(p, weights=14 * 2**30, shape=shape, tokens=tokens, target_tokens=4096,
                                        dim=4096) for p in prefix_cache.PLACES}
    assert peaks["device"] > peaks["int8"] > peaks["off"] and peaks["int8"] > peaks["host"] > peaks["off"]
    host_bytes = prefix_cache.host_region_bytes(shape, tokens, pin=False)
    assert host_bytes == shape.bytes(sum(tokens))
    assert _plan(None).place == "device"
    assert _plan(peaks["device"]).place == "device"
    assert _plan(peaks["device"] - 1).place == "host"
    assert _plan(peaks["host"], host_budget=host_bytes).place == "host"
    assert _plan(peaks["device"] - 1, host_budget=host_bytes - 1).place == "int8"
    assert _plan(peaks["int8"] - 1, host_budget=host_bytes - 1).place == "off"
    assert _plan(peaks["host"] - 1).place == "off"
    assert _plan(peaks["off"]).place == "off"
    with pytest.raises(ValueError, match=r"even without the prefix K/V cache a step needs about [\d.]+ GiB.*the "
                                         r"cache itself would be [\d.]+ GiB"):
        _plan(peaks["off"] - 1)
    pinned = prefix_cache.host_region_bytes(shape, tokens, pin=True)
    assert host_bytes <= pinned < host_bytes * 1.5  # one region in power-of-two chunks, not 2x per tensor


def _recording(init, regions: list):
    """HostRegion.__init__ that also keeps a weak reference to each region built."""
    import weakref

    def record(self, *args, **kwargs):
        init(self, *args, **kwargs)
        regions.append(weakref.ref(self))
    return record


def _peak(comps, cond, settings, n, place):
    shape = prefix_cache.cache_shape(comps.transformer.config, torch.float32)
    tokens = tuple(prefix_cache.prefix_tokens(p.slots, n) for p in (cond.cond, cond.uncond))
    from qwen_edit_core import speed
    return prefix_cache.peak_bytes(place, weights=speed.resident_bytes(comps.transformer, "cpu"), shape=shape,
                                   tokens=tokens, target_tokens=n, dim=shape.heads * shape.head_dim)


def test_sampler_follows_the_budget_with_the_same_image_on_the_host(edit, caplog, monkeypatch):
    """Between the host and the device plan's peaks the cache goes to the host, with the same picture; once
    sampling ends its region is freed and the host allocator's cache emptied (pinned memory handed back)."""
    from qwen_edit_core.speed import host_memory
    comps, cond, settings, n = edit
    exact = sampler21.denoise(comps, cond, settings)
    between = (_peak(comps, cond, settings, n, "host") + _peak(comps, cond, settings, n, "device")) / 2
    budgeted = sampler.SampleSettings(**{**settings.__dict__, "memory_budget_gb": between / 2**30})
    regions, alive_at_release = [], []
    monkeypatch.setattr(host_memory.HostRegion, "__init__", _recording(host_memory.HostRegion.__init__, regions))
    monkeypatch.setattr(host_memory, "release_cache", lambda: alive_at_release.extend(r() for r in regions))
    with caplog.at_level(logging.WARNING, logger=sampler21.__name__):
        on_host = sampler21.denoise(comps, cond, budgeted)
    assert "prefix K/V cache host" in caplog.text and "GiB in host memory" in caplog.text
    assert torch.equal(on_host, exact)  # the same keys and values, read from the host
    assert len(regions) == 2 and alive_at_release == [None, None]  # both branches' regions gone when released
    tight = sampler.SampleSettings(**{**settings.__dict__, "memory_budget_gb": 1e-6})
    with pytest.raises(ValueError, match="does not fit"):
        sampler21.denoise(comps, cond, tight)


def test_int8_cache_is_close_and_its_guard_turns_it_off(edit, caplog, monkeypatch):
    comps, cond, settings, n = edit
    plan = sampler21.plan_prefix_cache(comps.transformer, cond, settings, n)
    int8 = prefix_cache.PrefixPlan("int8", plan.tokens, plan.bytes, 0, 0, 0)
    latents = torch.randn(1, n, comps.transformer.config.in_channels, generator=torch.Generator().manual_seed(0))
    hidden = torch.cat([cond.reference_tokens, latents], 1)
    t = torch.full((1,), 0.7)
    with torch.no_grad():
        exact = [b(hidden, 0, t, cond, n) for b in sampler21.branches(comps.transformer, cond, settings, None)]
        quantized = sampler21.branches(comps.transformer, cond, settings, int8)
        with caplog.at_level(logging.INFO, logger=sampler21.__name__):
            for b in quantized:
                b(hidden, 0, t, cond, n)
        assert "prediction error" in caplog.text and all(b.place == "int8" for b in quantized)
        later = [b(hidden, 1, t, cond, n) for b in quantized]  # read from the int8 cache
        for got, want in zip(later, exact):
            assert 0 < prefix_cache.prediction_error(got, want) < prefix_cache.INT8_MAX_ERROR
        assert quantized[0].cache.nbytes() == prefix_cache.cache_shape(
            comps.transformer.config, torch.float32).int8_bytes(plan.tokens[0])
        monkeypatch.setattr(prefix_cache, "INT8_MAX_ERROR", 0.0)
        guarded = sampler21.branches(comps.transformer, cond, settings, int8)
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger=sampler21.__name__):
            first = guarded[0](hidden, 0, t, cond, n)
        assert "exceeds" in caplog.text and guarded[0].place == "off" and guarded[0].cache is None
        assert torch.equal(first, exact[0]) and torch.equal(guarded[0](hidden, 1, t, cond, n), exact[0])


def test_cfg_split_plans_each_branch_on_the_device_it_runs_on(edit):
    """cfg_mode split runs the uncond branch on a replica's device: each device's plan counts its own branch's
    cache and forward, so a budget that holds one branch's cache but not both keeps each on its device (one device
    running both would send them to the host), and a pair group's process plans only its own branch."""
    import copy
    import dataclasses
    comps, cond, settings, n = edit
    shape = prefix_cache.cache_shape(comps.transformer.config, torch.float32)
    tokens = tuple(prefix_cache.prefix_tokens(p.slots, n) for p in (cond.cond, cond.uncond))
    from qwen_edit_core import speed
    weights = speed.resident_bytes(comps.transformer, "cpu")
    one = max(prefix_cache.peak_bytes("device", weights=weights, shape=shape, tokens=(k,), target_tokens=n,
                                      dim=shape.heads * shape.head_dim) for k in tokens)
    both = _peak(comps, cond, settings, n, "device")
    assert one < both
    split = dataclasses.replace(settings, cfg_mode="split", memory_budget_gb=one / 2**30)
    replica = copy.deepcopy(comps.transformer)
    planned = sampler21.plan_branches(comps.transformer, cond, split, n, uncond_transformer=replica, host_budget=2**40)
    assert (planned.cache_plan.place, planned.uncond_cache_plan.place) == ("device", "device")
    assert (planned.cache_plan.tokens, planned.uncond_cache_plan.tokens) == ((tokens[0],), (tokens[1],))
    assert planned.uncond_cache_plan.bytes == shape.bytes(tokens[1])
    sequential = dataclasses.replace(split, cfg_mode="sequential")
    assert sampler21.plan_branches(comps.transformer, cond, sequential, n, host_budget=2**40).cache_plan.place != "device"
    pair = sampler21.plan_branches(comps.transformer, cond, split, n, cfg_split=type("Member", (), {"uncond": True}),
                                   host_budget=2**40)
    assert pair.cache_plan.tokens == (tokens[1],) and pair.uncond_cache_plan is None
