"""Stock ComfyUI LATENTs: Encode Image and the samplers output the Qwen-Image VAE's raw latents (what ComfyUI's
VAE Encode gives and its VAE Decode takes), Decode Latent accepts them, and they agree with ComfyUI's own
latent format for Qwen-Image (re-derived below from ComfyUI commit a125cd84b054a57729b5eecab930ca9408719832,
comfy/latent_formats.py class Wan21, used by comfy/supported_models.py QwenImage)."""

from __future__ import annotations

import pytest
import torch

import nodes
from nodes.common import TINY_MODEL

from tolerances import TINY_VAE_ROUNDINGS, assert_close_fp32

#: ComfyUI's Wan21 latent format (Qwen-Image's): per-channel mean and std, scale_factor 1.0
WAN21_MEAN = [-0.7571, -0.7089, -0.9113, 0.1075, -0.1745, 0.9653, -0.1517, 1.5508,
              0.4134, -0.0715, 0.5517, -0.3632, -0.1922, -0.9497, 0.2503, -0.2921]
WAN21_STD = [2.8184, 1.4541, 2.3275, 2.6558, 1.2196, 1.7708, 2.6052, 2.0743,
             3.2687, 2.1526, 2.8652, 1.5579, 1.6382, 1.1253, 2.8251, 1.9160]


def comfy_process_in(latent: torch.Tensor) -> torch.Tensor:
    """Wan21.process_in: (latent - mean) * scale_factor / std, stats viewed (1, 16, 1, 1, 1)."""
    mean = torch.tensor(WAN21_MEAN).view(1, 16, 1, 1, 1)
    std = torch.tensor(WAN21_STD).view(1, 16, 1, 1, 1)
    return (latent - mean) * 1.0 / std


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    patch = pytest.MonkeyPatch()
    patch.setenv("QWEN_EDIT_HOME", str(tmp_path_factory.mktemp("home")))
    with torch.inference_mode():
        (handle,) = nodes.QwenEditModelLoader().load(TINY_MODEL, "cpu", "cpu", "cpu", "float32")
    patch.undo()
    # the real Qwen-Image VAE's statistics (diffusers' AutoencoderKLQwenImage defaults) on the tiny VAE
    vae = handle.components.vae
    vae.register_to_config(latents_mean=WAN21_MEAN, latents_std=WAN21_STD)
    return handle


def _image(seed=0, h=64, w=64):
    return torch.rand(1, h, w, 3, generator=torch.Generator().manual_seed(seed))


def test_encode_image_gives_a_stock_latent_comfyui_normalizes_to_ours(model):
    with torch.inference_mode():
        latent, stock = nodes.QwenEditEncodeImage().encode(model, torch.cat([_image(0), _image(1)]), 64)
    samples = stock["samples"]
    assert set(stock) == {"samples"} and samples.shape == (2, 16, 1, 8, 8) and samples.dtype == torch.float32
    # de-normalised by us, normalised again as ComfyUI does: a multiply-add each way, in another order
    assert_close_fp32(comfy_process_in(samples), torch.cat(latent), ops=4, what="ComfyUI-normalised stock latent")


def test_stock_latent_decodes_to_the_same_picture(model):
    with torch.inference_mode():
        latent, stock = nodes.QwenEditEncodeImage().encode(model, _image(), 64)
        (ours,) = nodes.QwenEditDecodeLatent().decode(model, latent)
        (from_stock,) = nodes.QwenEditDecodeLatent().decode(model, samples=stock)
        four_d = {"samples": stock["samples"][:, :, 0]}  # ComfyUI's empty Qwen-Image latents are 4-D
        (from_4d,) = nodes.QwenEditDecodeLatent().decode(model, samples=four_d)
    # the stock latent goes through its de-normalisation and back (a few roundings), then the decoder
    assert_close_fp32(from_stock, ours, ops=TINY_VAE_ROUNDINGS, what="picture decoded from the stock latent")
    assert_close_fp32(from_4d, ours, ops=TINY_VAE_ROUNDINGS, what="picture decoded from a 4-D stock latent")
    # what ComfyUI's VAE Decode computes from the stock latent: the VAE on the raw latent, (x + 1) / 2
    raw = stock["samples"]
    with torch.no_grad():
        pixels = model.components.vae.decode(raw, return_dict=False)[0][:, :, 0]
    comfy = (pixels / 2 + 0.5).clamp(0, 1).permute(0, 2, 3, 1)
    assert float((comfy - ours).abs().max()) <= 2 / 255


def test_sampler_latent_output_is_its_image(model):
    args = (_image(), "make it blue", " ", 2, 3.0, 1, 0, 0, "dynamic", "same", 64)
    with torch.inference_mode():
        image, stock, _ = nodes.QwenEditSampler().sample(model, *args)
        (decoded,) = nodes.QwenEditDecodeLatent().decode(model, samples=stock)
    assert stock["samples"].shape == (1, 16, 1, 8, 8)
    assert_close_fp32(decoded, image, ops=TINY_VAE_ROUNDINGS, what="picture decoded from the sampler's latent")


def test_wrong_latents_are_refused_with_the_shape(model):
    with pytest.raises(ValueError, match=r"expected \(batch, 16, 1"):
        nodes.QwenEditDecodeLatent().decode(model, samples={"samples": torch.zeros(1, 4, 8, 8)})
    with pytest.raises(ValueError, match="connect latent"):
        nodes.QwenEditDecodeLatent().decode(model)


def test_stats_are_comfyuis():
    """The real Qwen-Image VAE's diffusers statistics are ComfyUI's Wan21 numbers."""
    from diffusers import AutoencoderKLQwenImage
    import inspect
    defaults = {p.name: p.default for p in inspect.signature(AutoencoderKLQwenImage.__init__).parameters.values()}
    assert defaults["latents_mean"] == WAN21_MEAN and defaults["latents_std"] == WAN21_STD
