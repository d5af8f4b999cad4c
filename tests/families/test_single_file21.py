"""Qwen-Image-2.1 as ComfyUI ships it: a transformer file in ComfyUI's layout (prefixed, fused MLP) loads into
diffusers' model with the directory's exact weights and samples as the directory does; the split layout and bf16
load exactly; a file of the other family than the directory's is refused naming both."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import load_file, save_file

from qwen_edit_core.families.qwen_image_21 import single_file as single_file21
from qwen_edit_core.model.components import ModelNotFoundError, load_components, load_transformer
from qwen_edit_core.model.devices import DevicePlan
from qwen_edit_core.families import QWEN_IMAGE_21
from qwen_edit_core.model.planned_load import load_transformer_file
from qwen_edit_core.sample import sampler

from tolerances import TINY_SAMPLER_ROUNDINGS, assert_close_fp32

CPU = torch.device("cpu")


def _dir_state(model_dir, dtype=torch.float32) -> dict[str, torch.Tensor]:
    model = load_transformer(model_dir, device=CPU, dtype=dtype, family=QWEN_IMAGE_21)
    return {k: v.clone().contiguous() for k, v in model.state_dict().items()}


def _comfy_file(model_dir, path, dtype=torch.float32, fused=True, prefix="model.diffusion_model."):
    state = _dir_state(model_dir, dtype)
    state = single_file21.fuse(state) if fused else state
    save_file({prefix + k: v for k, v in state.items()}, path)
    return path


def test_fused_mlp_is_gate_rows_first(tiny_21_dir):
    state = _dir_state(tiny_21_dir)
    fused = single_file21.fuse(state)
    gate = state["transformer_blocks.0.img_mlp.gate_layer.weight"]
    up = state["transformer_blocks.0.img_mlp.proj.weight"]
    assert torch.equal(fused["transformer_blocks.0.img_mlp.gate_up.weight"], torch.cat([gate, up]))
    assert not any(k.endswith(("img_mlp.proj.weight", "img_mlp.gate_layer.weight")) for k in fused)
    back = single_file21.split_fused(fused)
    assert back.keys() == state.keys() and all(torch.equal(back[k], v) for k, v in state.items())


def test_comfyui_layout_file_loads_exactly_and_samples_as_the_directory(tiny_21_dir, tmp_path):
    path = _comfy_file(tiny_21_dir, tmp_path / "qwen_image_2.1_fp32.safetensors")
    assert "model.diffusion_model.transformer_blocks.0.img_mlp.gate_up.weight" in load_file(path)
    plan = DevicePlan.from_mapping({})
    from_dir = load_components(tiny_21_dir, plan)
    from_file = load_components(tiny_21_dir, plan, transformer_file=path)
    assert type(from_file.transformer) is type(from_dir.transformer)
    same = ("num_layers", "attention_head_dim", "num_attention_heads", "context_in_dim", "mlp_ratio", "in_channels",
            "out_channels", "patch_size", "eps", "causal_condition")
    file_config, dir_config = from_file.transformer.config, from_dir.transformer.config
    assert {k: file_config[k] for k in same} == {k: dir_config[k] for k in same}
    assert list(file_config["axes_dims_rope"]) == list(dir_config["axes_dims_rope"])
    a, b = from_file.transformer.state_dict(), from_dir.transformer.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], v) for k, v in b.items())
    image = Image.fromarray(np.random.default_rng(0).integers(0, 255, (48, 96, 3), dtype=np.uint8))
    settings = sampler.SampleSettings(num_inference_steps=2, true_cfg_scale=1.0, seed=4, vae_area=64 * 64)
    expected = sampler.sample(from_dir, "make it blue", [image], settings)
    got = sampler.sample(from_file, "make it blue", [image], settings)
    assert got.shape == expected.shape and got.shape[-1] == 4
    # the same weights: equal up to the CPU kernels' alignment-dependent rounding (fresh file reads vs mapped)
    assert_close_fp32(got, expected, ops=TINY_SAMPLER_ROUNDINGS, what="picture from the ComfyUI file vs the folder")


def test_split_unprefixed_bf16_file_is_exact(tiny_21_dir, tmp_path):
    path = _comfy_file(tiny_21_dir, tmp_path / "split.safetensors", torch.bfloat16, fused=False, prefix="")
    with torch.inference_mode():
        loaded = load_transformer_file(path, device=CPU, dtype=torch.bfloat16)
    assert not any(p.is_inference() for p in loaded.parameters())
    reference = _dir_state(tiny_21_dir, torch.bfloat16)
    assert all(torch.equal(loaded.state_dict()[k], v) for k, v in reference.items())


def test_file_of_the_other_family_is_refused_naming_both(tiny_21_dir, tiny_edit_dir, tmp_path):
    path = _comfy_file(tiny_21_dir, tmp_path / "qwen_image_2.1.safetensors")
    with pytest.raises(ModelNotFoundError, match="Qwen-Image-2.1 transformer, but the model directory is Qwen-Image "
                                                 r"\(2025.*edit\)"):
        load_components(tiny_edit_dir, DevicePlan.from_mapping({}), which=("transformer",), transformer_file=path)
    old = tmp_path / "qwen_image_edit.safetensors"
    save_file({k: v.contiguous() for k, v in load_file(next((tiny_edit_dir / "transformer").glob("*.safetensors")))
               .items()}, old)
    with pytest.raises(ModelNotFoundError, match=r"Qwen-Image-Edit \(2025\) transformer.*Qwen-Image-2.1"):
        load_components(tiny_21_dir, DevicePlan.from_mapping({}), which=("transformer",), transformer_file=old)


def test_unknown_head_size_and_incomplete_file_are_refused(tiny_21_dir, tmp_path):
    state = single_file21.fuse(_dir_state(tiny_21_dir))
    state["transformer_blocks.0.attn.norm_q.weight"] = torch.ones(24)
    save_file(state, tmp_path / "odd.safetensors")
    with pytest.raises(ValueError, match="24-wide attention heads.*qwen-image-2.1 \\(128\\)"):
        load_transformer_file(tmp_path / "odd.safetensors", device=CPU, dtype=torch.float32)
    state = {k: v for k, v in single_file21.fuse(_dir_state(tiny_21_dir)).items() if not k.startswith("proj_out")}
    save_file(state, tmp_path / "cut.safetensors")
    with pytest.raises(ValueError, match=r"incomplete Qwen-Image-2.1 transformer \(missing \['proj_out.weight'\]"):
        load_transformer_file(tmp_path / "cut.safetensors", device=CPU, dtype=torch.float32)


@pytest.mark.parametrize("new_format", [False, True])
def test_scaled_fp8_file_with_its_fused_mlp_upcasts_or_keeps_the_files_weights(tiny_21_dir, tmp_path, new_format):
    """A scaled-fp8 ComfyUI file (`.scale_weight`, or `.weight_scale` + `.comfy_quant`) whose fused
    `img_mlp.gate_up` carries one per-tensor scale: upcast, the gate and up halves are the file's e4m3 rows times
    that scale, exactly; kept (`fp8="keep"`), each half is an fp8 linear holding the file's bytes unchanged with
    that scale on every row, the same effective weights."""
    from conftest import scaled_fp8

    from qwen_edit_core import speed
    state = scaled_fp8(single_file21.fuse(_dir_state(tiny_21_dir)), new_format=new_format)
    save_file({"model.diffusion_model." + k: v for k, v in state.items()}, tmp_path / "fp8.safetensors")
    upcast = load_transformer_file(tmp_path / "fp8.safetensors", device=CPU, dtype=torch.float32, fp8="upcast")
    kept = load_transformer_file(tmp_path / "fp8.safetensors", device=CPU, dtype=torch.float32, fp8="keep")
    assert type(kept).__name__ == "QwenImage21Transformer2DModel" and speed.has_fp8(kept)
    assert not speed.has_fp8(upcast)
    fused = state["transformer_blocks.1.img_mlp.gate_up.weight"]
    scale = state["transformer_blocks.1.img_mlp.gate_up." + ("weight_scale" if new_format else "scale_weight")]
    mlp = upcast.transformer_blocks[1].img_mlp
    gate, up = fused.chunk(2, dim=0)
    assert torch.equal(mlp.gate_layer.weight, gate.float() * scale) and torch.equal(mlp.proj.weight, up.float() * scale)
    for name, half in (("gate_layer", gate), ("proj", up)):
        layer = getattr(kept.transformer_blocks[1].img_mlp, name)
        assert isinstance(layer, speed.Fp8Linear)
        assert torch.equal(layer.weight_fp8.view(torch.uint8), half.view(torch.uint8))
        assert torch.equal(layer.weight_scale, scale.expand(half.shape[0], 1))
        assert torch.equal(layer.dequantized(torch.float32), getattr(mlp, name).weight)
