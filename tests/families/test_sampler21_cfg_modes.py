"""Qwen-Image-2.1 samples through the shared Euler/CFG driver, so its CFG modes are the 2025 family's: the uncond
branch on a replica (cfg_mode split with `uncond_transformer`) and each branch in its own process of a pair group
(`cfg_split`) give the sequential picture; cfg_mode batched is refused, naming what to use."""

from __future__ import annotations

import copy
import dataclasses
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch
from PIL import Image

from qwen_edit_core.families.qwen_image_21 import sampler as sampler21
from qwen_edit_core.model.components import load_components
from qwen_edit_core.model.devices import DevicePlan
from qwen_edit_core.sample import sampler

from tolerances import assert_close_fp32, tiny_sampler_roundings

STEPS = 2
SIDE = 64


@pytest.fixture(scope="module")
def comps(tiny_21_dir):
    return load_components(tiny_21_dir, DevicePlan.from_mapping({}))


def _settings(**kw) -> sampler.SampleSettings:
    return sampler.SampleSettings(num_inference_steps=STEPS, true_cfg_scale=3.0, negative_prompt="blurry", seed=5,
                                  vae_area=SIDE * SIDE, **kw)


def _references() -> list[Image.Image]:
    rng = np.random.default_rng(4)
    return [Image.fromarray(rng.integers(0, 255, (48, 96, 3), dtype=np.uint8))]


class _PairGroup:
    """Two threads standing in for a CFG pair of processes: `exchange` waits for both predictions of a step (as
    CfgSplit's all-gather does) and hands each side (cond, uncond)."""

    def __init__(self):
        self.barrier, self.predictions = threading.Barrier(2), {}

    def member(self, uncond: bool):
        group = self

        @dataclasses.dataclass(frozen=True)
        class Member:
            uncond: bool

            def exchange(self, prediction):
                group.predictions[self.uncond] = prediction.clone()
                group.barrier.wait()
                both = group.predictions[False], group.predictions[True]
                group.barrier.wait()  # both sides have read this step's pair before the next step writes
                return both
        return Member(uncond)


def test_split_cfg_on_a_replica_equals_sequential(comps):
    cond = sampler21.build_conditioning(comps, "make the sky purple", _references(), _settings())
    sequential = sampler21.denoise(comps, cond, _settings())
    replica = copy.deepcopy(comps.transformer)
    split = sampler.sample(comps, "make the sky purple", _references(), _settings(cfg_mode="split"),
                           uncond_transformer=replica)
    expected = sampler21.decode(comps, sequential, cond.width, cond.height)
    assert_close_fp32(split, expected, ops=tiny_sampler_roundings(STEPS), what="2.1 RGBA with split CFG vs sequential")


def test_split_cfg_needs_a_replica(comps):
    with pytest.raises(ValueError, match="cfg_mode 'split' needs a second transformer replica"):
        sampler.sample(comps, "p", _references(), _settings(cfg_mode="split"))


def test_each_branch_in_its_own_process_of_a_pair_equals_sequential(comps):
    """`cfg_split` (context parallelism's pair group): one side runs cond, the other uncond, each with its own
    prefix K/V cache, and both end with the sequential latents."""
    cond = sampler21.build_conditioning(comps, "make the sky purple", _references(), _settings())
    sequential = sampler21.denoise(comps, cond, _settings())
    pair = _PairGroup()
    twin = dataclasses.replace(comps, transformer=copy.deepcopy(comps.transformer))
    with ThreadPoolExecutor(max_workers=2) as pool:
        sides = [pool.submit(sampler21.denoise, c, cond, _settings(cfg_mode="split"), cfg_split=pair.member(uncond))
                 for c, uncond in ((comps, False), (twin, True))]
        cond_side, uncond_side = (side.result() for side in sides)
    assert torch.equal(cond_side, uncond_side)
    assert_close_fp32(cond_side, sequential, ops=tiny_sampler_roundings(STEPS), what="2.1 latents of a CFG pair")


def test_batched_cfg_is_refused_naming_the_option(comps):
    with pytest.raises(ValueError, match="cfg_mode 'batched' is not available for Qwen-Image-2.1.*'sequential' or "
                                         "'split'"):
        sampler.sample(comps, "p", _references(), _settings(cfg_mode="batched"))


def test_a_batch_of_two_sizes_samples_each_edit_as_alone(comps):
    """`sample_batch` takes Qwen-Image-2.1 too: its transformer reads one token layout per call, so the edits run
    one after the other through the family's own loop, each equal to sampling it alone, progress counted over the
    batch."""
    from qwen_edit_core.sample.batch import sample_batch
    rng = np.random.default_rng(7)
    images = [[Image.fromarray(rng.integers(0, 255, (48, 96, 3), dtype=np.uint8))],
              [Image.fromarray(rng.integers(0, 255, (64, 32, 3), dtype=np.uint8))]]
    prompts = ["make the sky purple", "add a hat"]
    singles = [sampler.sample(comps, p, refs, dataclasses.replace(_settings(), seed=s))
               for p, refs, s in zip(prompts, images, (5, 6))]
    events = []
    batched = sample_batch(comps, prompts, images, _settings(), seeds=[5, 6], progress=events.append)
    assert singles[0].shape != singles[1].shape
    for one, many in zip(singles, batched):
        assert torch.equal(one, many)
    assert [(e.step, e.total) for e in events] == [(k, 2 * STEPS) for k in range(1, 2 * STEPS + 1)]


def test_a_batch_with_split_cfg_is_refused_naming_only_the_modes_the_family_accepts(comps):
    from qwen_edit_core.sample.batch import sample_batch
    with pytest.raises(ValueError, match="runs CFG on one device; use cfg_mode 'sequential'$"):
        sample_batch(comps, ["p"], [_references()], _settings(cfg_mode="split"))
