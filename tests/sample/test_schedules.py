"""Named schedules: Lightning parity with diffusers' pipelines (two stacked LoRAs), ComfyUI parity with its
schedule and CFG re-derived from its source, and CFG 1 running no negative pass in any CFG mode.

ComfyUI facts (commit a125cd84b054a57729b5eecab930ca9408719832): comfy/supported_models.py QwenImage
sampling_settings {"multiplier": 1.0, "shift": 1.15} on ModelType.FLUX -> comfy/model_sampling.py
ModelSamplingFlux (10000 sigmas flux_time_shift(1.15, 1.0, t)) and CONST (denoised = x - v * sigma);
comfy/samplers.py simple_scheduler and cfg_function; comfy/k_diffusion/sampling.py sample_euler;
comfy/sample.py prepare_noise; comfy_extras/nodes_model_advanced.py ModelSamplingAuraFlow (multiplier 1.0).
"""

from __future__ import annotations

import logging
import math

import numpy as np
import pytest
import torch
from PIL import Image

from qwen_edit_core.adapters import lora
from qwen_edit_core.model.components import load_components, load_transformer
from qwen_edit_core.model.devices import DevicePlan
from qwen_edit_core.families.qwen_image import encode as family_encode
from qwen_edit_core.families.qwen_image import sampler as family_sampler
from qwen_edit_core.sample import sampler, schedules

from conftest import random_lora_file
from tolerances import TINY_FORWARD_ROUNDINGS, assert_close_fp32, tiny_sampler_roundings

#: the Lightning LoRAs' published scheduler config (FlowMatchEulerDiscreteScheduler), written out literally
LIGHTNING_SCHEDULER = {"base_image_seq_len": 256, "base_shift": math.log(3), "invert_sigmas": False,
                       "max_image_seq_len": 8192, "max_shift": math.log(3), "num_train_timesteps": 1000,
                       "shift": 1.0, "shift_terminal": None, "stochastic_sampling": False,
                       "time_shift_type": "exponential", "use_beta_sigmas": False, "use_dynamic_shifting": True,
                       "use_exponential_sigmas": False, "use_karras_sigmas": False}


def _assert_same(ours: np.ndarray, ref: np.ndarray, steps: int) -> None:
    """The pipeline's maths in another order (our schedule and LoRA stack code): equal up to a sampler run's
    float32 roundings."""
    assert_close_fp32(torch.from_numpy(ours), torch.from_numpy(ref), ops=tiny_sampler_roundings(steps),
                      what=f"our {steps}-step Lightning picture vs the pipeline's")


def _image(w: int, h: int, seed: int) -> Image.Image:
    return Image.fromarray(np.random.default_rng(seed).integers(0, 255, (h, w, 3), dtype=np.uint8))


def _lora_file(model_dir, path, targets: str, seed: int, comfy_prefix: bool):
    """A LoRA made with the project's own LoRA code (conftest.random_lora_file); `comfy_prefix=False` writes
    the Lightning files' layout (bare module paths, lora_down/lora_up, .alpha)."""
    from safetensors.torch import load_file, save_file
    random_lora_file(model_dir, path, targets, seed)
    if not comfy_prefix:
        save_file({k.removeprefix("diffusion_model."): v for k, v in load_file(path).items()}, path)
    return path


@pytest.fixture(scope="module")
def two_loras(tiny_edit_dir, tmp_path_factory):
    folder = tmp_path_factory.mktemp("loras")
    light = _lora_file(tiny_edit_dir, folder / "lightning.safetensors", "all", 1, comfy_prefix=False)
    mine = _lora_file(tiny_edit_dir, folder / "mine.safetensors", "attn", 2, comfy_prefix=True)
    return light, mine


def _lightning_reference(cls, model_dir, loras, strengths, images, steps, **size):
    from diffusers import FlowMatchEulerDiscreteScheduler
    pipe = cls.from_pretrained(model_dir, scheduler=FlowMatchEulerDiscreteScheduler.from_config(LIGHTNING_SCHEDULER))
    for path, name in zip(loras, ("lightning", "mine")):
        pipe.load_lora_weights(str(path), adapter_name=name)
    pipe.set_adapters(["lightning", "mine"], adapter_weights=list(strengths))
    out = pipe(image=images, prompt="make it night", negative_prompt=" ", true_cfg_scale=1.0,
               num_inference_steps=steps, generator=torch.Generator("cpu").manual_seed(5), output_type="np", **size)
    return np.asarray(out.images[0], dtype=np.float32)


def _lightning_ours(comps, loras, strengths, images, steps, **kw):
    lora.apply_loras(comps.transformer, [(lora.read_lora_file(p), s) for p, s in zip(loras, strengths)])
    settings = sampler.SampleSettings(num_inference_steps=steps, true_cfg_scale=1.0, seed=5, schedule="lightning",
                                      **kw)
    return sampler.sample(comps, "make it night", images, settings)[0].numpy()


@pytest.fixture(scope="module")
def edit_comps(tiny_edit_dir):
    return load_components(tiny_edit_dir, DevicePlan.from_mapping({}))


@pytest.mark.parametrize("steps", [4, 8])
def test_lightning_with_two_loras_matches_diffusers_edit(tiny_edit_dir, edit_comps, two_loras, small_edit_area,
                                                         steps):
    from diffusers import QwenImageEditPipeline
    image, strengths = _image(96, 64, 0), (1.0, 0.7)
    ref = _lightning_reference(QwenImageEditPipeline, tiny_edit_dir, two_loras, strengths, image, steps,
                               height=128, width=160)
    ours = _lightning_ours(edit_comps, two_loras, strengths, [image], steps, height=128, width=160,
                           vae_area=small_edit_area)
    assert ours.shape == ref.shape == (128, 160, 3)
    _assert_same(ours, ref, steps)
    # the schedule matters: the base schedule with the same LoRAs gives another image
    base = sampler.sample(edit_comps, "make it night", [image], sampler.SampleSettings(
        num_inference_steps=steps, true_cfg_scale=1.0, seed=5, height=128, width=160,
        vae_area=small_edit_area))[0].numpy()
    assert np.abs(base - ref).max() > 1e-2


@pytest.mark.parametrize("steps", [4, 8])
def test_lightning_with_two_loras_matches_diffusers_edit_plus(tiny_plus_dir, two_loras_plus, monkeypatch, steps):
    from diffusers import QwenImageEditPlusPipeline
    from diffusers.pipelines.qwenimage import pipeline_qwenimage_edit_plus as module
    monkeypatch.setattr(module, "VAE_IMAGE_SIZE", 128 * 128)
    monkeypatch.setattr(module, "CONDITION_IMAGE_SIZE", 96 * 96)
    images, strengths = [_image(96, 64, 1), _image(64, 112, 2)], (0.9, 1.3)
    ref = _lightning_reference(QwenImageEditPlusPipeline, tiny_plus_dir, two_loras_plus, strengths, images, steps,
                               height=96, width=128)
    comps = load_components(tiny_plus_dir, DevicePlan.from_mapping({}))
    ours = _lightning_ours(comps, two_loras_plus, strengths, images, steps, height=96, width=128,
                           vae_area=128 * 128, vl_area=96 * 96)
    _assert_same(ours, ref, steps)


@pytest.fixture(scope="module")
def two_loras_plus(tiny_plus_dir, tmp_path_factory):
    folder = tmp_path_factory.mktemp("loras_plus")
    light = _lora_file(tiny_plus_dir, folder / "lightning.safetensors", "all", 3, comfy_prefix=False)
    mine = _lora_file(tiny_plus_dir, folder / "mine.safetensors", "attn", 4, comfy_prefix=True)
    return light, mine


# -- ComfyUI, re-derived from its source -------------------------------------------------------------------------
def _comfy_table(shift):
    """ModelSamplingFlux (shift None: Qwen-Image's default mu 1.15) or ModelSamplingAuraFlow(shift) sigmas."""
    if shift is None:
        t = torch.arange(1, 10001, 1) / 10000
        return math.exp(1.15) / (math.exp(1.15) + (1 / t - 1) ** 1.0)
    t = torch.arange(1, 1001, 1) / 1000 * 1.0
    return shift * (t / 1.0) / (1 + (shift - 1) * (t / 1.0))


def _comfy_simple(table, steps):
    ss = len(table) / steps
    return torch.FloatTensor([float(table[-(1 + int(x * ss))]) for x in range(steps)] + [0.0])


def _comfy_reference(comps, cond, steps, cfg, seed, shift=None):
    """ComfyUI's KSampler(euler, simple) in its own arithmetic: noise from torch.manual_seed, CONST
    denoised = x - v * sigma, cfg on the denoised predictions (uncond skipped at cfg 1), Euler on d."""
    transformer = comps.transformer
    h, w = cond.height // 8, cond.width // 8
    with torch.random.fork_rng(devices=[]):
        noise = torch.randn((1, 16, h, w), generator=torch.manual_seed(seed), dtype=torch.float32, device="cpu")
    sigmas = _comfy_simple(_comfy_table(shift), steps)
    x = sigmas[0] * noise + (1.0 - sigmas[0]) * torch.zeros_like(noise)

    def denoised(x, sigma, embeds):
        tokens = x.view(1, 16, h // 2, 2, w // 2, 2).permute(0, 2, 4, 1, 3, 5).reshape(1, h * w // 4, 64)
        hidden = torch.cat([tokens, cond.control_tokens], dim=1)
        v = transformer(hidden_states=hidden, timestep=sigma.reshape(1), encoder_hidden_states=embeds.embeds,
                        encoder_hidden_states_mask=embeds.mask_or_none(), img_shapes=[cond.img_shapes],
                        return_dict=False)[0][:, : tokens.shape[1]]
        v = v.reshape(1, h // 2, w // 2, 16, 2, 2).permute(0, 3, 1, 4, 2, 5).reshape(1, 16, h, w)
        return x - v * sigma

    with torch.no_grad():
        for i in range(steps):
            sigma = sigmas[i]
            den = denoised(x, sigma, cond.cond)
            if not math.isclose(cfg, 1.0):
                den_u = denoised(x, sigma, cond.uncond)
                den = den_u + (den - den_u) * cfg
            d = (x - den) / sigma
            x = x + d * (sigmas[i + 1] - sigma)
    return x


def test_comfyui_sigmas_follow_its_simple_scheduler():
    expected = [math.exp(1.15) / (math.exp(1.15) + 1 / t - 1) for t in (1.0, 0.75, 0.5, 0.25)] + [0.0]
    # the table's float32 formula (an exp, a sum, two divisions) against float64 rounded once to float32
    assert_close_fp32(schedules.comfyui_sigmas(4), torch.tensor(expected), ops=4, what="ComfyUI simple sigmas")
    aura = [3.0 * t / (1 + 2.0 * t) for t in (1.0, 0.75, 0.5, 0.25)] + [0.0]
    assert_close_fp32(schedules.comfyui_sigmas(4, shift=3.0), torch.tensor(aura), ops=4, what="AuraFlow-shift sigmas")
    assert torch.equal(schedules.comfyui_sigmas(7), _comfy_simple(_comfy_table(None), 7))


@pytest.mark.parametrize("cfg, shift", [(4.0, None), (2.5, 3.1), (1.0, None)])
def test_comfyui_schedule_matches_comfyui_sampling(edit_comps, cfg, shift):
    comps = edit_comps
    lora.use_adapters(comps.transformer, [], [])
    settings = sampler.SampleSettings(num_inference_steps=5, true_cfg_scale=cfg, seed=11, width=128, height=96,
                                      schedule="comfyui", shift=shift)
    cond = sampler.build_conditioning(comps, "add snow", [_image(96, 64, 3)], settings)
    if cfg == 1.0:
        assert cond.uncond is None
        cond = family_sampler.Conditioning(cond.cond, cond.cond, cond.control_tokens, cond.img_shapes, cond.width,
                                    cond.height)
    ours = sampler.denoise(comps, cond, settings)
    ref = _comfy_reference(comps, cond, 5, cfg, 11, shift)
    ours_unpacked = family_encode.unpack(ours, cond.height, cond.width)[:, :, 0]
    # the same maths in another order (ComfyUI's denoised/derivative form of the Euler step, CFG on denoised
    # latents): five steps, each one transformer forward's roundings
    assert_close_fp32(ours_unpacked, ref, ops=5 * TINY_FORWARD_ROUNDINGS, what="latent vs ComfyUI's sampling")
    # ComfyUI differs from diffusers' schedule and CFG: the default preset gives another latent
    other = sampler.denoise(comps, cond, sampler.SampleSettings(num_inference_steps=5, true_cfg_scale=cfg, seed=11))
    assert (family_encode.unpack(other, cond.height, cond.width)[:, :, 0] - ref).abs().max() > 1e-2


# -- CFG 1 runs no negative prompt -----------------------------------------------------------------------------------
class _Counter:
    def __init__(self, module):
        self.calls = 0
        self.handle = module.register_forward_hook(self)

    def __call__(self, *args):
        self.calls += 1


@pytest.fixture(scope="module")
def replica(tiny_edit_dir):
    return load_transformer(tiny_edit_dir, device=torch.device("cpu"), dtype=torch.float32)


@pytest.mark.parametrize("mode", ["sequential", "batched", "split"])
@pytest.mark.parametrize("schedule", ["diffusers", "lightning", "comfyui"])
def test_cfg_one_runs_no_negative_pass(edit_comps, replica, monkeypatch, caplog, mode, schedule):
    comps = edit_comps
    main, other = _Counter(comps.transformer), _Counter(replica)
    prompts = []
    encode_prompts = family_encode.encode_prompts
    monkeypatch.setattr(family_encode, "encode_prompts",
                        lambda model, proc, texts, *a, **k: prompts.extend(texts) or encode_prompts(model, proc, texts,
                                                                                                    *a, **k))
    settings = sampler.SampleSettings(num_inference_steps=3, true_cfg_scale=1.0, negative_prompt="blurry", seed=0,
                                      width=64, height=64, cfg_mode=mode, schedule=schedule)
    with caplog.at_level(logging.INFO, logger="qwen_edit_core.sample.sampler"):
        sampler.sample(comps, "sharpen", [_image(64, 64, 0)], settings, uncond_transformer=replica)
    main.handle.remove()
    other.handle.remove()
    assert prompts == ["sharpen"]
    assert (main.calls, other.calls) == (3, 0)
    assert ("nothing" in caplog.text and "split" in caplog.text) == (mode == "split")
