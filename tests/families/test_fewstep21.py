"""Qwen-Image-2.1's few-step sampling on the tiny 2.1 model: a Turbo-style checkpoint (its own `sample_sigmas`,
shift 1 without dynamic shifting) samples with its schedule by default and equals diffusers' QwenImage21Pipeline;
the named Turbo preset is that schedule; ComfyUI's 2.1 schedule (a fixed mu of 0.69) is its simple scheduler and
Euler step."""

from __future__ import annotations

import json
import logging
import math
import shutil

import numpy as np
import pytest
import torch
from PIL import Image

from qwen_edit_core.families.qwen_image_21 import sampler as sampler21
from qwen_edit_core.model.components import load_components
from qwen_edit_core.model.devices import DevicePlan
from qwen_edit_core.sample import sampler, schedules

from conftest import random_lora_file
from tolerances import assert_close_fp32, tiny_sampler_roundings

SIDE = 64
#: Qwen-Image-2.1-Turbo's `sample_sigmas` (its model_index.json), with the final 0
TURBO = [1.0, 0.978453, 0.95418, 0.926626, 0.89508, 0.845148, 0.704534, 0.414568, 0]


@pytest.fixture(scope="module")
def turbo_dir(tiny_21_dir, tmp_path_factory):
    """The tiny 2.1 model dressed as the Turbo checkpoint: its sigmas in model_index.json, its scheduler's shift."""
    out = tmp_path_factory.mktemp("turbo") / "turbo"
    shutil.copytree(tiny_21_dir, out)
    index = json.loads((out / "model_index.json").read_text())
    (out / "model_index.json").write_text(json.dumps({**index, "sample_sigmas": TURBO}))
    scheduler = json.loads((out / "scheduler" / "scheduler_config.json").read_text())
    (out / "scheduler" / "scheduler_config.json").write_text(json.dumps(
        {**scheduler, "use_dynamic_shifting": False, "shift": 1.0}))
    return out


def _refs():
    rng = np.random.default_rng(3)
    return [Image.fromarray(rng.integers(0, 255, (SIDE, SIDE, 3), dtype=np.uint8))]


def test_a_turbo_checkpoint_samples_with_its_own_schedule_and_equals_the_pipeline(turbo_dir, caplog):
    from diffusers import QwenImage21Pipeline
    pipe = QwenImage21Pipeline.from_pretrained(turbo_dir)
    assert pipe.config.sample_sigmas == TURBO
    expected = pipe(prompt="make it red", image=_refs(), output_resolution=SIDE, output_type="np",
                    generator=torch.Generator("cpu").manual_seed(5)).images[0]
    with caplog.at_level(logging.INFO):
        comps = load_components(turbo_dir, DevicePlan.from_mapping({}))
        settings = sampler.SampleSettings(true_cfg_scale=1.0, seed=5, vae_area=SIDE * SIDE)
        ours = sampler.sample(comps, "make it red", _refs(), settings)[0]
    assert "a few-step checkpoint: it ships its own schedule of 9 sigmas" in caplog.text
    assert "Qwen Research License" in caplog.text
    assert_close_fp32(ours, torch.from_numpy(expected), ops=tiny_sampler_roundings(len(TURBO)),
                      what="Turbo-style checkpoint: ours vs QwenImage21Pipeline")
    preset = sampler.SampleSettings(true_cfg_scale=1.0, seed=5, vae_area=SIDE * SIDE,
                                    sigmas=schedules.parse_sigmas("qwen21-turbo-8step"))
    assert torch.equal(sampler.sample(comps, "make it red", _refs(), preset)[0], ours)  # the preset is its schedule


def test_the_turbo_preset_is_the_checkpoints_sigmas_at_cfg_1():
    assert list(schedules.parse_sigmas("qwen21-turbo-8step")) + [0] == TURBO
    assert schedules.resolve_sigmas("qwen21-turbo-8step")[1] == 1.0


def test_comfyuis_21_schedule_is_its_simple_scheduler_at_mu_069():
    """comfy/supported_models.py QwenImage21 (shift 0.69 on ModelSamplingFlux): a 10000-entry table
    exp(0.69) / (exp(0.69) + 1/t - 1), the simple scheduler's picks, then 0."""
    t = np.arange(1, 10001, dtype=np.float64) / 10000
    table = math.exp(0.69) / (math.exp(0.69) + 1 / t - 1)
    expected = [table[-(1 + int(i * 10000 / 6))] for i in range(6)] + [0.0]
    got = schedules.comfyui_sigmas(6, mu=sampler21.COMFYUI_QWEN21_MU)
    assert_close_fp32(got, torch.tensor(expected, dtype=torch.float32), ops=4, what="ComfyUI 2.1 sigmas")
    assert not torch.allclose(got, schedules.comfyui_sigmas(6))  # not the 2025 family's mu of 1.15


def test_the_comfyui_schedule_runs_its_sigmas_with_eulers_step(tiny_21_dir):
    """Sampling with schedule "comfyui" equals the official loop given ComfyUI's sigmas unshifted (shift 1): the
    same Euler update, in ComfyUI's form; the fixed mu is the same at every size."""
    comps = load_components(tiny_21_dir, DevicePlan.from_mapping({}))
    steps = 3
    comfy = sampler.SampleSettings(num_inference_steps=steps, true_cfg_scale=1.0, seed=2, vae_area=SIDE * SIDE,
                                   schedule="comfyui")
    grid = schedules.comfyui_sigmas(steps, mu=sampler21.COMFYUI_QWEN21_MU)[:-1].tolist()
    official = sampler.SampleSettings(num_inference_steps=steps, true_cfg_scale=1.0, seed=2, vae_area=SIDE * SIDE,
                                      sigmas=tuple(grid), shift=1.0)
    a = sampler.sample(comps, "p", _refs(), comfy)[0]
    b = sampler.sample(comps, "p", _refs(), official)[0]
    assert_close_fp32(a, b, ops=tiny_sampler_roundings(steps), what="ComfyUI's 2.1 schedule vs its sigmas run officially")
    assert not torch.equal(a, sampler.sample(comps, "p", _refs(), sampler.SampleSettings(
        num_inference_steps=steps, true_cfg_scale=1.0, seed=2, vae_area=SIDE * SIDE))[0])


def test_an_unknown_schedule_names_the_21_ones(tiny_21_dir):
    comps = load_components(tiny_21_dir, DevicePlan.from_mapping({}))
    with pytest.raises(ValueError, match="not available for Qwen-Image-2.1; accepted: diffusers, comfyui"):
        sampler.sample(comps, "p", _refs(), sampler.SampleSettings(schedule="lightning", vae_area=SIDE * SIDE))


def test_a_few_step_adapter_stacked_with_a_users_lora_equals_diffusers_set_adapters(tiny_21_dir, tmp_path):
    """The 2.1 few-step recipe users run: a few-step LoRA at half strength under the user's LoRA, on the adapter's
    sigma list; diffusers' `load_lora_weights` + `set_adapters` with the same strengths is the reference."""
    from diffusers import QwenImage21Pipeline

    from qwen_edit_core.adapters import lora
    from qwen_edit_core.families import QWEN_IMAGE_21
    presets = QWEN_IMAGE_21.lora_targets
    fast = random_lora_file(tiny_21_dir, tmp_path / "fast.safetensors", "all", 1, presets)
    mine = random_lora_file(tiny_21_dir, tmp_path / "mine.safetensors", "attn", 2, presets)
    strengths, sigmas = (0.5, 1.0), schedules.parse_sigmas("qwen21-dmd-6step")
    pipe = QwenImage21Pipeline.from_pretrained(tiny_21_dir)
    for path, name in zip((fast, mine), ("fast", "mine")):
        pipe.load_lora_weights(str(path.parent), weight_name=path.name, adapter_name=name)
    pipe.set_adapters(["fast", "mine"], adapter_weights=list(strengths))
    expected = pipe(prompt="make it red", image=_refs(), output_resolution=SIDE, output_type="np",
                    sigmas=list(sigmas), generator=torch.Generator("cpu").manual_seed(5)).images[0]
    comps = load_components(tiny_21_dir, DevicePlan.from_mapping({}))
    lora.apply_loras(comps.transformer, [(lora.read_lora_file(p), s) for p, s in zip((fast, mine), strengths)])
    settings = sampler.SampleSettings(true_cfg_scale=1.0, seed=5, vae_area=SIDE * SIDE, sigmas=sigmas)
    ours = sampler.sample(comps, "make it red", _refs(), settings)[0]
    assert_close_fp32(ours, torch.from_numpy(expected), ops=tiny_sampler_roundings(len(sigmas)) + 8,
                      what="two stacked 2.1 LoRAs: ours vs set_adapters")
