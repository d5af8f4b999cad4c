"""Qwen-Image-2.1 as ComfyUI ships it: the transformer as one safetensors file (ComfyUI's diffusion_models
folder, e.g. `qwen_image_2.1_bf16.safetensors`), read into diffusers' `QwenImage21Transformer2DModel`.

The layout, from ComfyUI's and diffusers' own source (docs/MODEL.md gives the commits):
- the module names are diffusers' (`comfy/ldm/qwen_image21/model.py` names its modules as diffusers'
  `transformer_qwenimage21.py` does), optionally under the `model.diffusion_model.` prefix of a file
  saved from a ComfyUI model;
- except the MLP: ComfyUI builds the SwiGLU with `fused_mlp` and stores `img_mlp.gate_up.weight`, the gate and
  up projections stacked on the output axis, gate rows first (`[gate_layer; proj]`: diffusers'
  `convert_qwen_image21_transformer_checkpoint_to_diffusers` splits it the same way); a file with the split
  `img_mlp.proj` / `gate_layer` is read as it is (ComfyUI's `model_detection.py` accepts both);
- `txt_in.text_norm.weight` marks a 2.1 transformer (the 2025 models have `txt_norm`).
The architecture is read from the shapes (blocks, heads, widths, MLP ratio) and matched by head size against the
2.1 configs shipped in `model/architectures/transformer_architectures.json` (the rotary axes are not in the
weights). This module is the 2.1 family's file layout (`families.Family.layout`): the file is loaded by the same
code as a 2025 one (`load_transformer_file`, the planned loader of model/planned_load.py), scaled fp8
layers upcast or kept in fp8 as there; other quantized formats (ComfyUI's int8 "convrot", nvfp4) are refused
naming the format (`single_file.check_quant_formats`).
"""

from __future__ import annotations

import json
import logging
import re

import torch

from qwen_edit_core.model import single_file
from qwen_edit_core.families import QWEN_IMAGE_21

log = logging.getLogger(__name__)

#: a key only the 2.1 transformer has
MARKER = QWEN_IMAGE_21.file_marker
FUSED_MODULE = "img_mlp.gate_up"
FUSED = FUSED_MODULE + ".weight"
FAMILY = QWEN_IMAGE_21.name


#: why a text encoder file is refused for this family and what to use ({found}: what the file is)
TEXT_ENCODER_REFUSAL = (
    "Qwen-Image-2.1's text encoder (Qwen3-VL) is not read from {found}. ComfyUI ships it only as int8 'convrot' "
    "(qwen3vl_8b_int8_convrot.safetensors), which this project does not read: leave the text encoder file empty, "
    "and the 2.1 model directory's text_encoder/ (Qwen3VLForConditionalGeneration) is loaded")


def split_fused(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """ComfyUI's fused `img_mlp.gate_up` (gate rows first) -> diffusers' `gate_layer` and `proj`, as stored or
    upcast: the weight's rows split in two (each half its own tensor), a scaled-fp8 file's per-tensor scale
    (`.scale_weight`, `.weight_scale`) given to both halves, a per-row one split with the rows; other tensors
    unchanged."""
    out = {}
    for key, value in tensors.items():
        module, _, leaf = key.rpartition(".")
        if not module.endswith(FUSED_MODULE):
            out[key] = value
            continue
        # copies, not views: a half kept as it is (an offloaded block's host weight) must not hold the other's bytes
        gate, up = (value, value) if value.numel() == 1 else (half.clone() for half in value.chunk(2, dim=0))
        out[f"{module[:-len(FUSED_MODULE)]}img_mlp.gate_layer.{leaf}"] = gate
        out[f"{module[:-len(FUSED_MODULE)]}img_mlp.proj.{leaf}"] = up
    return out


#: the family's file layout (families.Family.layout): a file's tensors onto diffusers' keys
to_model = split_fused


def fuse(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """diffusers' 2.1 state dict in ComfyUI's layout (`img_mlp.gate_up` = [gate_layer; proj]); the inverse of
    `split_fused`, for writing a file ComfyUI reads."""
    out = {}
    for key, value in state.items():
        if key.endswith("img_mlp.gate_layer.weight"):
            out[key.replace("gate_layer", "gate_up")] = torch.cat(
                [value, state[key.replace("gate_layer", "proj")]], dim=0)
        elif not key.endswith("img_mlp.proj.weight"):
            out[key] = value
    return out


def _architecture(head_dim: int, source: str) -> tuple[str, dict]:
    """The shipped 2.1 config (name, config) with this head size."""
    known = {n: c for n, c in json.loads(single_file.ARCHITECTURES.read_text()).items() if c.get("_family") == FAMILY}
    for name, config in known.items():
        if config["attention_head_dim"] == head_dim:
            return name, {k: v for k, v in config.items() if not k.startswith("_")}
    shipped = ", ".join(f"{n} ({c['attention_head_dim']})" for n, c in known.items())
    raise single_file.SingleFileError(
        f"{source}: a Qwen-Image-2.1 transformer with {head_dim}-wide attention heads, which no shipped 2.1 "
        f"architecture has (known: {shipped}, in {single_file.ARCHITECTURES.name})")


def detect_config(tensors: dict[str, torch.Tensor], flags: dict | None = None, source: str = "file") -> dict:
    """The diffusers config of a 2.1 transformer state dict (diffusers names; the fused MLP may be kept); `flags`
    (single_file.transformer_names': the 2025 family's markers) change nothing here."""
    needed = ("img_in.weight", "proj_out.weight", MARKER, "transformer_blocks.0.attn.norm_q.weight")
    missing = [k for k in needed if k not in tensors]
    mlp = tensors.get(f"transformer_blocks.0.{FUSED}", tensors.get("transformer_blocks.0.img_mlp.proj.weight"))
    if missing or mlp is None:
        raise single_file.SingleFileError(
            f"{source}: an incomplete Qwen-Image-2.1 transformer (missing {missing or ['the blocks MLP']}); expected "
            "ComfyUI's qwen_image_2.1 diffusion model file or diffusers' QwenImage21Transformer2DModel weights")
    width, in_channels = tensors["img_in.weight"].shape
    head_dim = tensors["transformer_blocks.0.attn.norm_q.weight"].shape[0]
    name, config = _architecture(head_dim, source)
    rows = mlp.shape[0] // (2 if f"transformer_blocks.0.{FUSED}" in tensors else 1)
    layers = 1 + max(int(m.group(1)) for k in tensors if (m := re.match(r"transformer_blocks\.(\d+)\.", k)))
    config.update(in_channels=in_channels, out_channels=tensors["proj_out.weight"].shape[0], num_layers=layers,
                  attention_head_dim=head_dim, num_attention_heads=width // head_dim,
                  context_in_dim=tensors[MARKER].shape[0], mlp_ratio=rows // width)
    config["axes_dims_rope"] = tuple(config["axes_dims_rope"])
    log.info("%s: Qwen-Image-2.1 transformer (%s rotary axes), %d blocks, width %d", source, name, layers, width)
    return config
