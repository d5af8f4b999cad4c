"""Explicit sigma lists: beside the named schedules, from the call, the config (a list or a preset name) and
`--sigmas`; both families follow the given list exactly as diffusers' pipelines do with `sigmas=`."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from qwen_edit_core.model.components import load_components
from qwen_edit_core.model.devices import DevicePlan
from qwen_edit_core.sample import sampler, schedules

from tolerances import TINY_SAMPLER_ROUNDINGS, assert_close_fp32

DMD = [1.0, 0.9375, 0.875, 0.75, 0.5, 0.25]


def _image(w, h, seed=0):
    return Image.fromarray(np.random.default_rng(seed).integers(0, 255, (h, w, 3), dtype=np.uint8))


def test_presets_and_lists_are_checked():
    assert schedules.parse_sigmas("qwen21-dmd-6step") == tuple(DMD)
    assert schedules.resolve_sigmas("qwen21-dmd-6step") == (tuple(DMD), 1.0)
    assert schedules.resolve_sigmas("1, 0.5 0.25") == ((1.0, 0.5, 0.25), None)
    assert schedules.resolve_sigmas(()) == (None, None) and schedules.resolve_sigmas("") == (None, None)
    with pytest.raises(ValueError, match="must decrease"):
        schedules.check_sigmas([1.0, 0.5, 0.5])
    with pytest.raises(ValueError, match=r"sigmas\[1\] = 1.5 is outside"):
        schedules.check_sigmas([1.0, 1.5])
    with pytest.raises(ValueError, match="neither a preset"):
        schedules.parse_sigmas("dmd")


def test_config_cli_and_settings_take_a_sigma_list():
    from qwen_edit_core import load_config
    from qwen_edit_core.cli import build_parser
    from qwen_edit_core.sample.predict import settings
    assert load_config(overrides={"predict": {"sigmas": [1, 0.5]}}).predict.sigmas == (1.0, 0.5)
    predict = load_config(overrides={"predict": {"sigmas": "qwen21-dmd-6step"}}).predict
    s = settings(predict, schedule=None, shift=None, num_inference_steps=None, true_cfg_scale=None,
                 negative_prompt=" ", seed=0, width=None, height=None)
    assert (s.sigmas, s.num_inference_steps, s.true_cfg_scale) == (tuple(DMD), 6, 1.0)
    s = settings(predict, schedule=None, shift=None, num_inference_steps=None, true_cfg_scale=None,
                 negative_prompt=" ", seed=0, width=None, height=None, sigmas="1.0, 0.5")
    assert (s.sigmas, s.num_inference_steps, s.true_cfg_scale) == ((1.0, 0.5), 2, 4.0)
    args = build_parser().parse_args(["sample", "--model", "m", "--image", "i", "--prompt", "p", "--out", "o",
                                      "--sigmas", "qwen21-dmd-6step", "--no-kv-cache"])
    assert (args.sigmas, args.no_kv_cache) == ("qwen21-dmd-6step", True)


def test_21_sigma_list_matches_the_pipeline(tiny_21_dir):
    from diffusers import FlowMatchEulerDiscreteScheduler, QwenImage21Pipeline
    comps = load_components(tiny_21_dir, DevicePlan.from_mapping({}))
    te = comps.text_encoder
    pipe = QwenImage21Pipeline(scheduler=FlowMatchEulerDiscreteScheduler.from_config(comps.scheduler_config),
                               vae=comps.vae, text_encoder=te.model, processor=te.processor,
                               transformer=comps.transformer)
    refs = [_image(96, 48)]
    sigmas = DMD[:3]
    expected = pipe(prompt="p", image=refs, sigmas=sigmas, output_resolution=64, output_type="np",
                    generator=torch.Generator("cpu").manual_seed(3)).images[0]
    ours = sampler.sample(comps, "p", refs, sampler.SampleSettings(sigmas=tuple(sigmas), true_cfg_scale=1.0,
                                                                   seed=3, vae_area=64 * 64))[0].numpy()
    # the same maths as the pipeline's in another order: a sampler run's roundings, on pictures in [0, 1]
    assert_close_fp32(torch.from_numpy(ours), torch.from_numpy(expected), ops=TINY_SAMPLER_ROUNDINGS,
                      what="2.1 picture vs the pipeline's")


def test_2025_sigma_list_matches_the_pipeline(tiny_edit_dir, small_edit_area):
    from diffusers import FlowMatchEulerDiscreteScheduler, QwenImageEditPipeline
    comps = load_components(tiny_edit_dir, DevicePlan.from_mapping({}))
    te = comps.text_encoder
    pipe = QwenImageEditPipeline(scheduler=FlowMatchEulerDiscreteScheduler.from_config(comps.scheduler_config),
                                 vae=comps.vae, text_encoder=te.model, tokenizer=te.processor.tokenizer,
                                 processor=te.processor, transformer=comps.transformer)
    sigmas = [1.0, 0.5]
    image = _image(64, 64)
    expected = pipe(image=image, prompt="p", negative_prompt=" ", true_cfg_scale=4.0, sigmas=sigmas,
                    num_inference_steps=2, output_type="np", generator=torch.Generator("cpu").manual_seed(3)).images[0]
    ours = sampler.sample(comps, "p", [image], sampler.SampleSettings(sigmas=tuple(sigmas), true_cfg_scale=4.0,
                                                                      seed=3, vae_area=small_edit_area))[0].numpy()
    assert_close_fp32(torch.from_numpy(ours), torch.from_numpy(expected), ops=TINY_SAMPLER_ROUNDINGS,
                      what="2509 picture vs the pipeline's")
