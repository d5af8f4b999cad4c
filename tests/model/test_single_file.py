"""Transformers as ComfyUI single files: prefixes, bf16, scaled fp8, the Edit-2511 marker, clear errors."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import save_file

from qwen_edit_core.sample import sampler
from qwen_edit_core.model.components import load_components, load_transformer
from qwen_edit_core.model.devices import DevicePlan
from qwen_edit_core.model.planned_load import load_transformer_file
from qwen_edit_core.model.single_file import SingleFileError

from conftest import scaled_fp8
from tolerances import TINY_FORWARD_ROUNDINGS, TINY_SAMPLER_ROUNDINGS, assert_close_fp32

CPU = torch.device("cpu")


def _state(model_dir, dtype=torch.float32):
    return {k: v.clone().contiguous() for k, v in
            load_transformer(model_dir, device=CPU, dtype=dtype).state_dict().items()}


def _output(model, seed=0):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        return model(hidden_states=torch.randn(1, 32, 64, generator=g).to(model.dtype),
                     encoder_hidden_states=torch.randn(1, 6, 32, generator=g).to(model.dtype),
                     timestep=torch.tensor([0.4]), img_shapes=[[(1, 4, 4), (1, 4, 4)]], return_dict=False)[0]


def test_prefixed_fp32_file_gives_the_same_sampler_output(tiny_edit_dir, tmp_path):
    state = {f"model.diffusion_model.{k}": v for k, v in _state(tiny_edit_dir).items()}
    save_file(state, tmp_path / "qwen_image_edit_fp32.safetensors")
    plan = DevicePlan.from_mapping({})
    from_dir = load_components(tiny_edit_dir, plan)
    from_file = load_components(tiny_edit_dir, plan, transformer_file=tmp_path / "qwen_image_edit_fp32.safetensors")
    image = Image.fromarray(np.random.default_rng(0).integers(0, 255, (64, 64, 3), dtype=np.uint8))
    settings = sampler.SampleSettings(num_inference_steps=3, seed=2, width=64, height=64, vae_area=64 * 64)
    file_state, dir_state = from_file.transformer.state_dict(), from_dir.transformer.state_dict()
    assert file_state.keys() == dir_state.keys()
    assert all(torch.equal(file_state[k], v) for k, v in dir_state.items())
    a = sampler.sample(from_dir, "blue", [image], settings)
    b = sampler.sample(from_file, "blue", [image], settings)
    # The same weights; the file's tensors are read into fresh aligned memory while diffusers maps the folder's
    # file, and CPU matmul kernels round by the data's alignment: equal up to float32 rounding along the
    # sampler's chain of operations, on pictures in [0, 1] (measured: 1.0e-6; the bound is 1.5e-5).
    assert_close_fp32(b, a, ops=TINY_SAMPLER_ROUNDINGS, what="picture from the file vs the folder")


def test_bf16_file_is_exact_and_trainable_after_inference_mode(tiny_edit_dir, tmp_path):
    save_file(_state(tiny_edit_dir, torch.bfloat16), tmp_path / "bf16.safetensors")
    with torch.inference_mode():
        loaded = load_transformer_file(tmp_path / "bf16.safetensors", device=CPU, dtype=torch.bfloat16)
    assert not any(p.is_inference() for p in loaded.parameters())
    reference = load_transformer(tiny_edit_dir, device=CPU, dtype=torch.bfloat16)
    assert all(torch.equal(loaded.state_dict()[k], v) for k, v in reference.state_dict().items())


@pytest.mark.parametrize("new_format", [False, True])
def test_scaled_fp8_is_upcast_within_tolerance(tiny_edit_dir, tmp_path, new_format):
    """e4m3fn keeps 3 mantissa bits: the transformer output stays within 10% relative error (L2)."""
    save_file(scaled_fp8(_state(tiny_edit_dir), new_format), tmp_path / "fp8.safetensors")
    loaded = load_transformer_file(tmp_path / "fp8.safetensors", device=CPU, dtype=torch.float32)
    reference = load_transformer(tiny_edit_dir, device=CPU, dtype=torch.float32)
    a, b = _output(loaded), _output(reference)
    assert ((a - b).norm() / b.norm()).item() < 0.1
    assert loaded.transformer_blocks[0].attn.to_q.weight.dtype == torch.float32


def test_edit_2511_marker_sets_zero_cond_t(tmp_path):
    from qwen_edit_core.model.tiny import build_tiny
    model_dir = build_tiny(tmp_path / "z", transformer_overrides={"zero_cond_t": True})
    state = _state(model_dir)
    state["__index_timestep_zero__"] = torch.empty(0)
    save_file({f"model.diffusion_model.{k}": v for k, v in state.items()}, tmp_path / "2511.safetensors")
    loaded = load_transformer_file(tmp_path / "2511.safetensors", device=CPU, dtype=torch.float32)
    reference = load_transformer(model_dir, device=CPU, dtype=torch.float32)
    assert loaded.config.zero_cond_t is True
    assert all(torch.equal(loaded.state_dict()[k], v) for k, v in reference.state_dict().items())
    # the same weights in other memory: CPU matmul kernels round by the data's alignment (see above)
    assert_close_fp32(_output(loaded), _output(reference), ops=TINY_FORWARD_ROUNDINGS,
                      what="2511 transformer output from the file vs the folder")


def test_bad_files_name_what_was_expected(tiny_edit_dir, tmp_path):
    state = _state(tiny_edit_dir)
    broken = dict(state)
    del broken["transformer_blocks.1.attn.to_k.weight"]
    save_file(broken, tmp_path / "missing.safetensors")
    with pytest.raises(SingleFileError, match="transformer_blocks.1.attn.to_k.weight"):
        load_transformer_file(tmp_path / "missing.safetensors", device=CPU, dtype=torch.float32)
    wrong = dict(state)
    wrong["transformer_blocks.0.img_mlp.net.2.weight"] = torch.zeros(32, 7)
    save_file(wrong, tmp_path / "wrong.safetensors")
    with pytest.raises(SingleFileError, match="wrong shapes"):
        load_transformer_file(tmp_path / "wrong.safetensors", device=CPU, dtype=torch.float32)
    save_file({"double_blocks.0.img_attn.qkv.weight": torch.zeros(4, 4)}, tmp_path / "flux.safetensors")
    with pytest.raises(SingleFileError, match="not a Qwen-Image transformer"):
        load_transformer_file(tmp_path / "flux.safetensors", device=CPU, dtype=torch.float32)
    odd = dict(state)
    odd["img_in.weight"] = torch.zeros(48, 64)
    save_file(odd, tmp_path / "odd.safetensors")
    with pytest.raises(SingleFileError, match="unknown Qwen-Image architecture"):
        load_transformer_file(tmp_path / "odd.safetensors", device=CPU, dtype=torch.float32)
    with pytest.raises(SingleFileError, match="does not exist"):
        load_transformer_file(tmp_path / "nope.safetensors", device=CPU, dtype=torch.float32)


def test_cli_sample_with_a_transformer_file(tiny_edit_dir, tmp_path):
    from qwen_edit_core.cli import main
    save_file(_state(tiny_edit_dir), tmp_path / "t.safetensors")
    Image.new("RGB", (64, 64), "red").save(tmp_path / "in.png")
    assert main(["sample", "--model", str(tiny_edit_dir), "--transformer-file", str(tmp_path / "t.safetensors"),
                 "--image", str(tmp_path / "in.png"), "--prompt", "x", "--steps", "1", "--vae-area", "4096",
                 "--out", str(tmp_path / "o.png")]) == 0


def _comfy_vae_file(model_dir, path):
    """Our tiny VAE written in ComfyUI's qwen_image_vae layout (key names from tests/model/files, recorded from
    ComfyUI's own WanVAE at tiny size), through the inverse of diffusers' converter."""
    import json
    from pathlib import Path

    from diffusers import AutoencoderKLQwenImage
    from diffusers.loaders.single_file_utils import convert_wan_vae_to_diffusers
    shapes = json.loads((Path(__file__).parent / "files" / "comfy_qwen_vae_tiny_keys.json").read_text())["keys"]
    probe = {k: torch.full(v, float(i)) for i, (k, v) in enumerate(shapes.items())}
    to_diffusers = {}
    for key, value in convert_wan_vae_to_diffusers(dict(probe)).items():
        original = next(k for k in probe if probe[k].flatten()[0].item() == value.flatten()[0].item())
        to_diffusers[original] = key
    state = AutoencoderKLQwenImage.from_pretrained(model_dir, subfolder="vae").state_dict()
    save_file({o: state[d].reshape(shapes[o]).contiguous() for o, d in to_diffusers.items()}, path)
    return path


def test_comfy_layout_vae_file_gives_the_same_latents_and_pixels(tiny_edit_dir, tmp_path):
    import json

    from qwen_edit_core.model import encode
    from qwen_edit_core.model.components import load_vae
    from qwen_edit_core.model.single_file import load_vae_file
    path = _comfy_vae_file(tiny_edit_dir, tmp_path / "qwen_image_vae.safetensors")
    config = json.loads((tiny_edit_dir / "vae" / "config.json").read_text())
    from_file = load_vae_file(path, device=CPU, dtype=torch.float32, config=config)
    from_dir = load_vae(tiny_edit_dir, device=CPU, dtype=torch.float32)
    pixels = torch.rand(1, 3, 1, 64, 64) * 2 - 1
    a, b = encode.encode_latents(from_file, pixels), encode.encode_latents(from_dir, pixels)
    assert torch.equal(a, b)
    assert torch.equal(encode.decode_latents(from_file, a), encode.decode_latents(from_dir, b))
    default = load_vae_file(path, device=CPU, dtype=torch.float32)  # real latents_mean/std, tiny widths
    assert default.config.base_dim == 16 and default.config.latents_mean[0] == -0.7571


def test_vae_file_errors(tiny_edit_dir, tmp_path):
    from qwen_edit_core.model.single_file import load_vae_file
    save_file({"encoder.conv1.weight": torch.zeros(2, 2)}, tmp_path / "other.safetensors")
    with pytest.raises(SingleFileError, match="not a Qwen-Image VAE"):
        load_vae_file(tmp_path / "other.safetensors", device=CPU, dtype=torch.float32)
    path = _comfy_vae_file(tiny_edit_dir, tmp_path / "v.safetensors")
    from safetensors.torch import load_file
    state = load_file(path)
    del state["decoder.head.2.weight"]
    save_file(state, tmp_path / "broken.safetensors")
    with pytest.raises(SingleFileError, match="missing"):
        load_vae_file(tmp_path / "broken.safetensors", device=CPU, dtype=torch.float32)


def test_cli_and_training_take_a_vae_file(tiny_edit_dir, pairs_dir, tmp_path):
    from conftest import train_config

    from qwen_edit_core import QwenImageEditTrainer
    from qwen_edit_core.cli import main
    from qwen_edit_core.data.example_tensors import encoder_identity
    vae = _comfy_vae_file(tiny_edit_dir, tmp_path / "qwen_image_vae.safetensors")
    Image.new("RGB", (64, 64), "red").save(tmp_path / "in.png")
    assert main(["sample", "--model", str(tiny_edit_dir), "--vae-file", str(vae), "--image", str(tmp_path / "in.png"),
                 "--prompt", "x", "--steps", "1", "--vae-area", "4096", "--out", str(tmp_path / "o.png")]) == 0
    assert encoder_identity(tiny_edit_dir, vae) != encoder_identity(tiny_edit_dir)  # a new cache entry
    result = QwenImageEditTrainer(train_config(tiny_edit_dir, pairs_dir, tmp_path / "run", model={
        "vae_file": str(vae)}, train={"max_steps": 2})).fit()
    assert result.step == 2


def test_scaled_fp8_kept_in_fp8_holds_the_files_bytes_and_half_the_memory(tiny_edit_dir, tmp_path):
    """fp8="keep": block linears hold the file's e4m3 bytes unchanged (the same effective weights as the
    upcast path), take a quarter of the fp32 memory, run fp8 matmuls within 2% of the upcast output, and
    take a LoRA; "auto" upcasts on the CPU."""
    from qwen_edit_core.adapters import lora
    from qwen_edit_core import speed as perf
    from qwen_edit_core.model.single_file import _bytes
    state = scaled_fp8(_state(tiny_edit_dir))
    save_file(state, tmp_path / "fp8.safetensors")
    kept = load_transformer_file(tmp_path / "fp8.safetensors", device=CPU, dtype=torch.float32, fp8="keep")
    upcast = load_transformer_file(tmp_path / "fp8.safetensors", device=CPU, dtype=torch.float32, fp8="upcast")
    auto = load_transformer_file(tmp_path / "fp8.safetensors", device=CPU, dtype=torch.float32)
    assert perf.has_fp8(kept) and not perf.has_fp8(upcast) and not perf.has_fp8(auto)
    layer = kept.transformer_blocks[0].attn.to_q
    key = "transformer_blocks.0.attn.to_q"
    assert torch.equal(layer.weight_fp8.view(torch.uint8), state[f"{key}.weight"].view(torch.uint8))
    assert torch.equal(layer.dequantized(torch.float32), upcast.transformer_blocks[0].attn.to_q.weight)
    block_bytes = lambda m: _bytes(m.transformer_blocks)  # noqa: E731
    assert block_bytes(kept) < 0.3 * block_bytes(upcast)
    a, b = _output(kept), _output(upcast)
    assert ((a - b).norm() / b.norm()).item() < 0.02
    lora.inject_lora(kept, lora.LoraSpec(rank=2, alpha=2.0, targets=lora.TARGET_PRESETS["attn"]))
    assert kept.transformer_blocks[0].attn.to_q.base_layer is layer
    with pytest.raises(ValueError, match="fp8 mode 'fast' is not accepted"):
        load_transformer_file(tmp_path / "fp8.safetensors", device=CPU, dtype=torch.float32, fp8="fast")
