"""Qwen-Image-2.1's VAE as ComfyUI ships it (its Wan 2.2 layout, temporal kernel 1, RGBA) loads into diffusers'
AutoencoderKLQwenImage21 with the directory's exact weights, config and latent statistics, and encodes, decodes
(alpha included) and samples as the directory's VAE does; files of the other family, and any 2.1 text encoder file
(ComfyUI ships only int8 convrot), are refused naming what to use."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import load_file, save_file

from qwen_edit_core.model import encode
from qwen_edit_core.families.qwen_image_21 import vae_file as vae_file21
from qwen_edit_core.model.components import ModelNotFoundError, load_components, load_text_encoder, load_vae
from qwen_edit_core.model.devices import DevicePlan
from qwen_edit_core.model.single_file import SingleFileError, load_vae_file
from qwen_edit_core.sample import sampler

from tolerances import TINY_SAMPLER_ROUNDINGS, TINY_VAE_ROUNDINGS, assert_close_fp32

CPU = torch.device("cpu")
#: key names and shapes of ComfyUI's own 2.1 VAE module at the tiny sizes (see the file's _source)
COMFY_KEYS = Path(__file__).parent / "files" / "comfy_qwen_image21_vae_tiny_keys.json"


def _comfy_vae_file(model_dir, path, dtype=torch.float32, prefix=""):
    """The directory's VAE written in ComfyUI's layout."""
    vae = load_vae(model_dir, device=CPU, dtype=dtype)
    state = vae_file21.to_comfy(vae.state_dict(), vae.config)
    save_file({prefix + k: v.contiguous() for k, v in state.items()}, path)
    return path


def test_written_layout_is_comfyuis_module_key_for_key(tiny_21_dir, tmp_path):
    shapes = json.loads(COMFY_KEYS.read_text())["keys"]
    written = load_file(_comfy_vae_file(tiny_21_dir, tmp_path / "v.safetensors"))
    assert {k: list(v.shape) for k, v in written.items()} == shapes


def test_comfyui_vae_file_loads_exactly_and_decodes_rgba_as_the_directory(tiny_21_dir, tmp_path):
    path = _comfy_vae_file(tiny_21_dir, tmp_path / "qwen_image_2.1_vae.safetensors")
    with torch.inference_mode():  # as ComfyUI calls loaders
        from_file = load_components(tiny_21_dir, DevicePlan.from_mapping({}), which=("vae",), vae_file=path).vae
    from_dir = load_vae(tiny_21_dir, device=CPU, dtype=torch.float32)
    assert type(from_file) is type(from_dir) and not any(p.is_inference() for p in from_file.parameters())
    public = {k: v for k, v in from_dir.config.items() if not k.startswith("_")}
    assert {k: from_file.config[k] for k in public} == public  # latent statistics from the directory
    a, b = from_file.state_dict(), from_dir.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], v) for k, v in b.items())
    pixels = torch.rand(1, 4, 1, 64, 96, generator=torch.Generator().manual_seed(0)) * 2 - 1
    latents = encode.encode_latents(from_dir, pixels)
    # the same weights in other memory: CPU kernels round by the data's alignment
    assert_close_fp32(encode.encode_latents(from_file, pixels), latents, ops=TINY_VAE_ROUNDINGS,
                      what="latents encoded by the VAE file vs the folder's")
    decoded, expected = encode.decode_latents(from_file, latents), encode.decode_latents(from_dir, latents)
    assert decoded.shape[1] == 4  # alpha included
    assert_close_fp32(decoded, expected, ops=TINY_VAE_ROUNDINGS, what="RGBA decoded by the VAE file vs the folder's")


def test_prefixed_bf16_file_is_exact_and_defaults_to_the_released_statistics(tiny_21_dir, tmp_path):
    path = _comfy_vae_file(tiny_21_dir, tmp_path / "vae_bf16.safetensors", torch.bfloat16, prefix="first_stage_model.")
    loaded = load_vae_file(path, device=CPU, dtype=torch.bfloat16)  # no directory: diffusers' defaults
    reference = load_vae(tiny_21_dir, device=CPU, dtype=torch.bfloat16).state_dict()
    assert all(torch.equal(loaded.state_dict()[k], v) for k, v in reference.items())
    assert loaded.config.latents_mean[:2] == [0.5126, 0.7721] and len(loaded.config.latents_std) == 64
    own = next((tiny_21_dir / "vae").glob("*.safetensors"))  # diffusers' own names are read too
    same = load_vae(tiny_21_dir, device=CPU, dtype=torch.bfloat16, vae_file=own).state_dict()
    assert all(torch.equal(same[k], v) for k, v in reference.items())


def test_sampling_with_the_vae_file_matches_the_directory(tiny_21_dir, tmp_path):
    path = _comfy_vae_file(tiny_21_dir, tmp_path / "qwen_image_2.1_vae.safetensors")
    plan = DevicePlan.from_mapping({})
    from_file, from_dir = load_components(tiny_21_dir, plan, vae_file=path), load_components(tiny_21_dir, plan)
    image = Image.fromarray(np.random.default_rng(1).integers(0, 255, (64, 32, 4), dtype=np.uint8), "RGBA")
    settings = sampler.SampleSettings(num_inference_steps=2, true_cfg_scale=1.0, seed=3, vae_area=64 * 64)
    got = sampler.sample(from_file, "a red cup", [image], settings)
    expected = sampler.sample(from_dir, "a red cup", [image], settings)
    assert got.shape == expected.shape and got.shape[-1] == 4
    assert_close_fp32(got, expected, ops=TINY_SAMPLER_ROUNDINGS, what="RGBA sampled with the VAE file vs the folder's")


def test_vae_files_of_the_other_family_are_refused_naming_both(tiny_21_dir, tiny_edit_dir, tmp_path):
    path = _comfy_vae_file(tiny_21_dir, tmp_path / "qwen_image_2.1_vae.safetensors")
    with pytest.raises(ModelNotFoundError, match=r"Qwen-Image-2.1 vae, but the model directory is Qwen-Image \(2025"):
        load_components(tiny_edit_dir, DevicePlan.from_mapping({}), which=("vae",), vae_file=path)
    old = next((tiny_edit_dir / "vae").glob("*.safetensors"))
    with pytest.raises(ModelNotFoundError, match=r"Qwen-Image-Edit \(2025\) vae.*Qwen-Image-2.1"):
        load_vae(tiny_21_dir, device=CPU, dtype=torch.float32, vae_file=old)


def test_incomplete_21_vae_file_is_refused(tiny_21_dir, tmp_path):
    state = load_file(_comfy_vae_file(tiny_21_dir, tmp_path / "v.safetensors"))
    del state["encoder.downsamples.1.downsamples.0.residual.6.weight"]
    save_file(state, tmp_path / "cut.safetensors")
    with pytest.raises(SingleFileError, match=r"Qwen-Image-2.1 VAE.*missing \['encoder.down_blocks.1.resnets.0.conv2"):
        load_vae_file(tmp_path / "cut.safetensors", device=CPU, dtype=torch.float32)


def test_21_text_encoder_files_are_refused_naming_convrot_and_what_to_use(tiny_21_dir, tmp_path):
    note = torch.tensor(list(json.dumps({"format": "int8_convrot"}).encode()), dtype=torch.uint8)
    path = tmp_path / "qwen3vl_8b_int8_convrot.safetensors"
    save_file({"model.layers.0.self_attn.q_proj.weight": torch.zeros(4, 4, dtype=torch.int8),
               "model.layers.0.self_attn.q_proj.comfy_quant": note}, path)
    expected = r"not read from a file quantized as 'int8_convrot'.*model directory's text_encoder/"
    with pytest.raises(SingleFileError, match=expected):
        load_components(tiny_21_dir, DevicePlan.from_mapping({}), text_encoder_file=path)
    with pytest.raises(SingleFileError, match=expected):
        load_text_encoder(tiny_21_dir, device=CPU, dtype=torch.float32, text_encoder_file=path)
    save_file({"model.norm.weight": torch.ones(4)}, tmp_path / "plain.safetensors")
    with pytest.raises(SingleFileError, match="not read from a single file.*ships it only as int8 'convrot'"):
        load_text_encoder(tiny_21_dir, device=CPU, dtype=torch.float32, text_encoder_file=tmp_path / "plain.safetensors")
