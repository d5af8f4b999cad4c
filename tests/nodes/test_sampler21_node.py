"""Qwen-Image-2.1 in the nodes, without ComfyUI: the loader detects 2.1 from the directory and from ComfyUI's
transformer file, the Sampler takes ordered references (the image batch, then Reference Images chains of other
sizes, RGBA from a MASK) and returns IMAGE plus MASK (1 - alpha) equal to the core sampler's RGBA picture, and
the sigmas input gives an explicit sigma list or preset."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file

import nodes
from nodes.common import TINY_21_MODEL, TINY_MODEL
from qwen_edit_core.model import encode
from qwen_edit_core.families.qwen_image_21 import single_file as single_file21
from qwen_edit_core.sample import sampler

from tolerances import TINY_SAMPLER_ROUNDINGS, assert_close_fp32

SIDE = 64
#: model, image, prompt, negative, steps, cfg, seed, width, height, shift_mode, uncond_device, vae_side
ARGS = ("make the sky purple", " ", 2, 1.0, 5, 0, 0, "dynamic", "same", SIDE)


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    mp = pytest.MonkeyPatch()
    root = tmp_path_factory.mktemp("comfy21")
    for name in ("QWEN_EDIT_HOME", "QWEN_EDIT_LORAS", "QWEN_EDIT_OUTPUT"):
        mp.setenv(name, str(root / name.lower()))
    mp.chdir(root)
    yield root
    mp.undo()


@pytest.fixture(scope="module")
def model21(env):
    with torch.inference_mode():
        (handle,) = nodes.QwenEditModelLoader().load(TINY_21_MODEL, "cpu", "cpu", "cpu", "float32")
    return handle


def _batch(n, h, w, seed):
    return torch.rand(n, h, w, 3, generator=torch.Generator().manual_seed(seed))


def test_loader_detects_21_from_the_directory_and_from_comfyuis_file(model21, env, monkeypatch):
    assert model21.components.variant == "image-2.1"
    state = single_file21.fuse(model21.components.transformer.state_dict())
    folder = env / "diffusion_models"
    folder.mkdir(exist_ok=True)
    save_file({f"model.diffusion_model.{k}": v.contiguous() for k, v in state.items()},
              folder / "qwen_image_2.1_fp32.safetensors")
    monkeypatch.setattr(nodes.model_nodes.comfy_runtime, "folder_file_path", lambda kind, name: folder / name)
    with torch.inference_mode():
        (handle,) = nodes.QwenEditModelLoader().load(TINY_21_MODEL, "cpu", "cpu", "cpu", "float32",
                                                     transformer_file="qwen_image_2.1_fp32.safetensors")
        assert handle.components.variant == "image-2.1"
        assert handle.components.transformer_file == folder / "qwen_image_2.1_fp32.safetensors"
        with pytest.raises(Exception, match="Qwen-Image-2.1 transformer, but the model directory is Qwen-Image"):
            nodes.QwenEditModelLoader().load(TINY_MODEL, "cpu", "cpu", "cpu", "float32",
                                             transformer_file="qwen_image_2.1_fp32.safetensors")


def test_component_loaders_detect_21_and_take_comfyuis_vae_file(model21, env, monkeypatch):
    from qwen_edit_core.families.qwen_image_21 import vae_file as vae_file21
    vae = model21.components.vae
    folder = env / "vae"
    folder.mkdir(exist_ok=True)
    save_file({k: v.contiguous() for k, v in vae_file21.to_comfy(vae.state_dict(), vae.config).items()},
              folder / "qwen_image_2.1_vae.safetensors")
    monkeypatch.setattr(nodes.model_nodes.comfy_runtime, "folder_file_path", lambda kind, name: folder / name)
    with torch.inference_mode():
        transformer = nodes.QwenEditTransformerLoader().load(TINY_21_MODEL, "cpu", "float32", "none")[0]
        (from_file,) = nodes.QwenEditVAELoader().load(TINY_21_MODEL, "cpu", "float32",
                                                      vae_file="qwen_image_2.1_vae.safetensors")
        (te,) = nodes.QwenEditTextEncoderLoader().load(TINY_21_MODEL, "cpu", "float32", "none")
        (scheduler,) = nodes.QwenEditSchedulerLoader().load(TINY_21_MODEL)
        (assembled,) = nodes.QwenEditAssembleModel().assemble(transformer, from_file, te, scheduler)
        with pytest.raises(Exception, match="Qwen-Image-2.1 vae, but the model directory is Qwen-Image"):
            nodes.QwenEditVAELoader().load(TINY_MODEL, "cpu", "float32", vae_file="qwen_image_2.1_vae.safetensors")
    comps = assembled.components
    assert [type(m).__name__ for m in (comps.transformer, comps.vae, comps.text_encoder.model)] == [
        type(m).__name__ for m in (model21.components.transformer, vae, model21.components.text_encoder.model)]
    assert type(comps.vae).__name__ == "AutoencoderKLQwenImage21" and comps.variant == "image-2.1"
    assert all(torch.equal(comps.vae.state_dict()[k], v) for k, v in vae.state_dict().items())
    image = _batch(1, SIDE, SIDE, 3)
    with torch.inference_mode():
        got = nodes.QwenEditSampler().sample(assembled, image, *ARGS)
        expected = nodes.QwenEditSampler().sample(model21, image, *ARGS)
    # the same weights in other memory (the VAE file read vs the folder mapped): kernels round by alignment
    assert_close_fp32(got[0], expected[0], ops=TINY_SAMPLER_ROUNDINGS, what="RGB with the VAE file vs the folder's")
    assert_close_fp32(got[2], expected[2], ops=TINY_SAMPLER_ROUNDINGS, what="alpha with the VAE file vs the folder's")


def test_sampler_takes_ordered_references_and_returns_image_and_mask(model21):
    batch = _batch(2, 64, 96, 1)  # two references of one size: the image input's batch
    other = _batch(1, 96, 48, 2)  # a third of another size, with transparency, through Reference Images
    mask = torch.zeros(1, 96, 48)
    mask[:, :, :24] = 1.0  # left half transparent
    with torch.inference_mode():
        (refs,) = nodes.QwenEditReferenceImages().collect(other, mask)
        image, latent, out_mask = nodes.QwenEditSampler().sample(model21, batch, *ARGS, references=refs)
    pictures = [encode.as_pil(batch[0]), encode.as_pil(batch[1]),
                encode.as_pil(torch.cat([other[0], (1 - mask[0]).unsqueeze(-1)], dim=-1))]
    assert refs[0].mode == "RGBA" and refs[0].getchannel("A").getextrema() == (0, 255)
    settings = sampler.SampleSettings(num_inference_steps=2, true_cfg_scale=1.0, seed=5, vae_area=SIDE * SIDE)
    expected = sampler.sample(model21.components, "make the sky purple", pictures, settings)
    assert expected.shape[-1] == 4 and image.shape[-1] == 3 and out_mask.shape == image.shape[:3]
    assert torch.equal(image, expected[..., :3]) and torch.equal(out_mask, 1 - expected[..., 3])
    assert latent["samples"].shape[1] == 64  # 2.1's raw VAE latents
    swapped = torch.stack([batch[1], batch[0]])  # order matters
    with torch.inference_mode():
        image2, _, _ = nodes.QwenEditSampler().sample(model21, swapped, *ARGS, references=refs)
    assert not torch.equal(image, image2)


def test_sigmas_input_is_an_explicit_list_or_a_preset(model21):
    with torch.inference_mode():
        image, _, _ = nodes.QwenEditSampler().sample(model21, _batch(1, 64, 64, 3), *ARGS, sigmas="1.0, 0.5 0.25")
    settings = sampler.SampleSettings(sigmas=(1.0, 0.5, 0.25), true_cfg_scale=1.0, seed=5, vae_area=SIDE * SIDE)
    expected = sampler.sample(model21.components, "make the sky purple", [encode.as_pil(_batch(1, 64, 64, 3)[0])],
                              settings)
    assert torch.equal(image, expected[..., :3])
    spec = nodes.QwenEditSampler.INPUT_TYPES()["optional"]["sigmas"]
    assert "qwen21-dmd-6step" in spec[1]["tooltip"]
    from nodes.sample_nodes import _settings
    assert _settings(sigmas="qwen21-dmd-6step").sigmas == (1.0, 0.9375, 0.875, 0.75, 0.5, 0.25)
    assert _settings(sigmas="qwen21-dmd-6step").num_inference_steps == 6
    with pytest.raises(ValueError, match="must decrease"):
        _settings(sigmas="0.5, 1.0")


def test_what_21_does_not_take_is_refused_naming_it(model21):
    eleven = _batch(11, 32, 32, 4)
    with pytest.raises(ValueError, match="11 reference images; Qwen-Image-2.1 takes at most 10"):
        nodes.QwenEditReferenceImages().collect(eleven)
    (six,) = nodes.QwenEditReferenceImages().collect(_batch(6, 32, 32, 5))
    with pytest.raises(ValueError, match="11 reference images"), torch.inference_mode():
        nodes.QwenEditSampler().sample(model21, _batch(5, 32, 32, 6), *ARGS, references=six)
    with pytest.raises(ValueError, match="uncond_device to same and parallel off"):
        nodes.QwenEditSampler().sample(model21, _batch(1, 32, 32, 6), *ARGS[:8], "cpu", SIDE)
    with pytest.raises(ValueError, match="mask .* and image .* differ in size"):
        nodes.QwenEditReferenceImages().collect(_batch(1, 32, 32, 7), torch.zeros(1, 16, 16))


def test_2025_model_returns_an_opaque_mask_and_refuses_references(env):
    with torch.inference_mode():
        (handle,) = nodes.QwenEditModelLoader().load(TINY_MODEL, "cpu", "cpu", "cpu", "float32")
        image, _, mask = nodes.QwenEditSampler().sample(handle, _batch(1, 64, 64, 8), "x", " ", 2, 1.0, 1, 64, 64,
                                                        "dynamic", "same", 64)
        assert image.shape == (1, 64, 64, 3) and torch.equal(mask, torch.zeros(1, 64, 64))
        (refs,) = nodes.QwenEditReferenceImages().collect(_batch(1, 32, 32, 9))
        with pytest.raises(ValueError, match="references are Qwen-Image-2.1's"):
            nodes.QwenEditSampler().sample(handle, _batch(1, 64, 64, 8), "x", " ", 2, 1.0, 1, 64, 64, "dynamic",
                                           "same", 64, references=refs)
