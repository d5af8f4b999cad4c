"""Qwen-Image-2.1: our sampler equals diffusers' QwenImage21Pipeline on the tiny 2.1 model.

Same directory, seed, area and steps; equal up to float32 rounding along the sampler run on the float RGBA image
in [0, 1] (fp32, CPU): 1, 2 and 10 references of different sizes (one with alpha), CFG off and true CFG with a
negative prompt, with and without the prefix K/V cache. References keep their order; a reference of the output's
size sits on the target's grid (no shift).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from qwen_edit_core.families.qwen_image_21 import encode as encode21
from qwen_edit_core.model.components import load_components
from qwen_edit_core.model.devices import DevicePlan
from qwen_edit_core.sample import sampler
from qwen_edit_core.families.qwen_image_21 import sampler as sampler21

from tolerances import assert_close_fp32, tiny_sampler_roundings

STEPS = 2
SIDE = 64
#: (w, h) of the references: aspect ratios that give different grids at 64*64 (incl. odd token counts)
SIZES = [(64, 64), (96, 48), (40, 80), (80, 64), (48, 96), (64, 32), (128, 64), (70, 70), (50, 100), (100, 40)]


def _image(w: int, h: int, seed: int, alpha: bool = False) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 255, (h, w, 4 if alpha else 3), dtype=np.uint8))


@pytest.fixture(scope="module")
def model(tiny_21_dir):
    from diffusers import FlowMatchEulerDiscreteScheduler, QwenImage21Pipeline
    comps = load_components(tiny_21_dir, DevicePlan.from_mapping({}))
    te = comps.text_encoder
    pipe = QwenImage21Pipeline(scheduler=FlowMatchEulerDiscreteScheduler.from_config(comps.scheduler_config),
                               vae=comps.vae, text_encoder=te.model, processor=te.processor,
                               transformer=comps.transformer)
    return comps, pipe


def _references(n: int) -> list[Image.Image]:
    return [_image(w, h, seed=k, alpha=k == 1) for k, (w, h) in enumerate(SIZES[:n])]


@pytest.mark.parametrize("n", [1, 2, 10])
@pytest.mark.parametrize("cfg,negative", [(1.0, None), (3.0, "blurry, dark")])
@pytest.mark.parametrize("kv_cache", [True, False])
def test_matches_qwenimage21_pipeline(model, n, cfg, negative, kv_cache):
    comps, pipe = model
    refs = _references(n)
    expected = pipe(prompt="make the sky purple", image=refs, negative_prompt=negative, true_cfg_scale=cfg,
                    num_inference_steps=STEPS, output_resolution=SIDE, use_kv_cache=kv_cache, output_type="np",
                    generator=torch.Generator("cpu").manual_seed(11)).images[0]
    settings = sampler.SampleSettings(num_inference_steps=STEPS, true_cfg_scale=cfg, negative_prompt=negative,
                                      seed=11, vae_area=SIDE * SIDE, kv_cache=kv_cache)
    ours = sampler.sample(comps, "make the sky purple", refs, settings)[0].numpy()
    assert ours.shape == expected.shape and ours.shape[-1] == 4
    assert_close_fp32(torch.from_numpy(ours), torch.from_numpy(expected), ops=tiny_sampler_roundings(STEPS),
                      what="our RGBA vs the pipeline's")


def test_cache_is_the_default_and_changes_nothing_in_fp32(model):
    comps, _ = model
    refs = _references(2)
    assert sampler.SampleSettings().kv_cache is True
    on = sampler.sample(comps, "p", refs, sampler.SampleSettings(num_inference_steps=STEPS, true_cfg_scale=1,
                                                                  vae_area=SIDE * SIDE))
    off = sampler.sample(comps, "p", refs, sampler.SampleSettings(num_inference_steps=STEPS, true_cfg_scale=1,
                                                                   vae_area=SIDE * SIDE, kv_cache=False))
    # the cached keys/values are the ones computed again without it, on other sequence shapes
    assert_close_fp32(on, off, ops=tiny_sampler_roundings(STEPS), what="RGBA with the K/V cache vs without")


def test_references_keep_their_order(model):
    comps, _ = model
    a, b = _image(96, 48, 1), _image(48, 96, 2)
    settings = sampler.SampleSettings(num_inference_steps=1, true_cfg_scale=1, vae_area=SIDE * SIDE)
    ab = sampler21.build_conditioning(comps, "p", [a, b], settings)
    ba = sampler21.build_conditioning(comps, "p", [b, a], settings)
    grid_a, grid_b = encode21.token_grid(96, 32), encode21.token_grid(32, 96)
    assert ab.img_shapes == [grid_a, grid_b, encode21.token_grid(32, 96)]
    assert ba.img_shapes == [grid_b, grid_a, encode21.token_grid(96, 32)]
    n_a = grid_a[1] * grid_a[2]
    assert torch.equal(ab.reference_tokens[:, :n_a], ba.reference_tokens[:, -n_a:])


def _rope_rows(comps, cond) -> torch.Tensor:
    slots = cond.cond.slots
    mask = torch.repeat_interleave(slots[0], torch.where(slots, encode21.TOKENS_PER_SLOT, 1)[0])
    return comps.transformer.pos_embed(cond.img_shapes, mask, device=torch.device("cpu")), mask


def test_pixel_aligned_reference_is_not_shifted(model):
    """A reference of the output's size has exactly the target's height/width positions (only the frame axis, its
    place in the sequence, differs): no half-token offset."""
    comps, _ = model
    settings = sampler.SampleSettings(num_inference_steps=1, true_cfg_scale=1, vae_area=SIDE * SIDE)
    cond = sampler21.build_conditioning(comps, "p", [_image(96, 32, 3)], settings)
    assert cond.img_shapes[0] == cond.img_shapes[1] == (1, 2, 6)
    rope, mask = _rope_rows(comps, cond)
    image_rows = rope[mask]
    ref, target = image_rows[:12], image_rows[12:]
    frame = comps.transformer.config.axes_dims_rope[0] // 2
    assert torch.equal(ref[:, frame:], target[:, frame:])
    assert not torch.equal(ref[:, :frame], target[:, :frame])
