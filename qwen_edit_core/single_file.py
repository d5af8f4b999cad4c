"""The model files ComfyUI users already have: a Qwen-Image transformer as one safetensors file.

Layout, learned from ComfyUI's and diffusers' own source:
- Key names are diffusers' module paths: ComfyUI's `comfy/ldm/qwen_image/model.py` names its modules like
  diffusers' `QwenImageTransformer2DModel`, and diffusers' `loaders/single_file_model.py` maps a Qwen-Image
  single file with the identity. Files saved from a ComfyUI model carry the `model.diffusion_model.` prefix
  (stripped by `comfy/sd.py` load_diffusion_model); both are accepted.
- `__index_timestep_zero__` (an empty tensor, registered as a buffer in comfy/ldm/qwen_image/model.py when
  `default_ref_method == "index_timestep_zero"`) marks Edit-2511: `zero_cond_t=True` in diffusers.
- Scaled fp8 (comfy/model_detection.py: a `scaled_fp8` key; comfy/ops.py: per-layer `.scale_weight`, weight
  = fp8 * scale_weight, optional `.scale_input`) and the newer per-layer `.weight_scale` + `.comfy_quant` form.
  fp8 weights are upcast at load to the requested dtype (w = fp8.float() * scale). Keeping them in fp8 for fp8
  matmuls is a GPU path (issue 7), not taken here.
The architecture is read from the shapes and matched against the configs shipped in
`data/transformer_architectures.json`.
"""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

import torch
from safetensors import safe_open

log = logging.getLogger(__name__)

PREFIXES = ("model.diffusion_model.", "diffusion_model.")
ZERO_COND_MARKER = "__index_timestep_zero__"
_SCALE_SUFFIXES = (".scale_weight", ".weight_scale")
_DROP_SUFFIXES = (".scale_input", ".input_scale", ".comfy_quant")
_FP8 = tuple(getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2") if hasattr(torch, n))
ARCHITECTURES = Path(__file__).parent / "data" / "transformer_architectures.json"


class SingleFileError(ValueError):
    """A model file this loader cannot use; the message names the file and what was expected."""


def _read_tensors(path, what: str) -> dict[str, torch.Tensor]:
    """Every tensor of a safetensors file; errors name the file and say what it should be."""
    path = Path(path)
    if not path.is_file():
        raise SingleFileError(f"{what} file {str(path)!r} does not exist")
    try:
        with safe_open(str(path), framework="pt") as fh:
            return {k: fh.get_tensor(k) for k in fh.keys()}
    except Exception as err:  # noqa: BLE001 - safetensors raises several types for damaged files
        raise SingleFileError(f"{str(path)!r} is not a readable safetensors file: {err}") from None


def read_state_dict(path: Path) -> tuple[dict[str, torch.Tensor], dict]:
    """(tensors with diffusers names, flags) of a transformer file; fp8 weights not yet dequantized."""
    tensors = _read_tensors(path, "transformer")
    out, flags = {}, {"zero_cond_t": False, "scaled_fp8": False}
    for key, value in tensors.items():
        for prefix in PREFIXES:
            if key.startswith(prefix):
                key = key[len(prefix):]
                break
        if key == ZERO_COND_MARKER:
            flags["zero_cond_t"] = True
        elif key == "scaled_fp8":
            flags["scaled_fp8"] = True
        elif not key.endswith(_DROP_SUFFIXES):
            out[key] = value
    return out, flags


def dequantize(tensors: dict[str, torch.Tensor], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Upcast fp8 weights with their per-layer scales; cast everything else to `dtype`."""
    scales = {k[: -len(s)]: v for k, v in tensors.items() for s in _SCALE_SUFFIXES if k.endswith(s)}
    out = {}
    for key, value in tensors.items():
        if key.endswith(_SCALE_SUFFIXES):
            continue
        if value.dtype in _FP8:
            scale = scales.get(key.removesuffix(".weight"))
            value = value.float() * (scale.float() if scale is not None else 1.0)
        out[key] = value.to(dtype)
    return out


def detect_config(tensors: dict[str, torch.Tensor], flags: dict, source: str = "file") -> dict:
    """The diffusers config of a Qwen-Image transformer state dict, from its shapes."""
    needed = ("img_in.weight", "txt_in.weight", "proj_out.weight", "transformer_blocks.0.attn.norm_q.weight")
    missing = [k for k in needed if k not in tensors]
    if missing:
        sample = ", ".join(sorted(tensors)[:4])
        raise SingleFileError(f"{source}: not a Qwen-Image transformer (missing {missing}; found keys like {sample}); "
                              "expected a Qwen-Image/-Edit diffusion model from ComfyUI's diffusion_models folder")
    width, in_channels = tensors["img_in.weight"].shape
    head_dim = tensors["transformer_blocks.0.attn.norm_q.weight"].shape[0]
    layers = 1 + max(int(m.group(1)) for k in tensors if (m := re.match(r"transformer_blocks\.(\d+)\.", k)))
    shapes = {"in_channels": in_channels, "attention_head_dim": head_dim, "num_attention_heads": width // head_dim,
              "joint_attention_dim": tensors["txt_in.weight"].shape[1],
              "out_channels": tensors["proj_out.weight"].shape[0] // 4}
    known = json.loads(ARCHITECTURES.read_text())
    for name, config in known.items():
        if all(config[k] == v for k, v in shapes.items()):
            config = {k: v for k, v in config.items() if not k.startswith("_")}
            config.update(num_layers=layers, zero_cond_t=flags["zero_cond_t"],
                          use_additional_t_cond="time_text_embed.addition_t_embedding.weight" in tensors)
            config["axes_dims_rope"] = tuple(config["axes_dims_rope"])
            log.info("%s: %s architecture, %d blocks%s", source, name, layers,
                     ", zero_cond_t (Edit-2511)" if flags["zero_cond_t"] else "")
            return config
    raise SingleFileError(f"{source}: unknown Qwen-Image architecture {shapes}; known: {', '.join(known)} "
                          f"(shipped in {ARCHITECTURES.name})")


def load_transformer_file(path, *, device: torch.device, dtype: torch.dtype):
    """A frozen QwenImageTransformer2DModel from one safetensors file, on `device` in `dtype`."""
    from accelerate import init_empty_weights
    from diffusers import QwenImageTransformer2DModel

    # ComfyUI calls loaders under inference mode: tensors read there could never be trained (LoRA) on.
    with torch.inference_mode(False):
        raw, flags = read_state_dict(path)
        config = detect_config(raw, flags, source=str(path))
        tensors = dequantize(raw, dtype)
        with init_empty_weights():
            model = QwenImageTransformer2DModel(**config)
        expected = model.state_dict()
        missing = sorted(set(expected) - set(tensors))
        unexpected = sorted(set(tensors) - set(expected))
        wrong = [f"{k}: {tuple(tensors[k].shape)} (expected {tuple(v.shape)})" for k, v in expected.items()
                 if k in tensors and tensors[k].shape != v.shape]
        if missing or unexpected or wrong:
            raise SingleFileError(f"{path}: does not match the detected architecture: missing {missing[:4]}, "
                                  f"unexpected {unexpected[:4]}, wrong shapes {wrong[:4]}")
        model.load_state_dict({k: v.to(device) for k, v in tensors.items()}, assign=True)
        model.to(device)
        return model.eval().requires_grad_(False)


# -- VAE ----------------------------------------------------------------------------------------------------
# ComfyUI's qwen_image_vae.safetensors is its Wan 2.1 VAE layout (comfy/sd.py recognises
# `decoder.middle.0.residual.0.gamma` and builds comfy.ldm.wan.vae.WanVAE with dim 96, z_dim 16,
# dim_mult [1, 2, 4, 4], num_res_blocks 2). diffusers' loaders/single_file_utils.py
# `convert_wan_vae_to_diffusers` maps that layout onto AutoencoderKLQwenImage's module names (same architecture;
# the converter assumes num_res_blocks 2, which the real VAE and our tiny VAE have).
VAE_PREFIXES = ("first_stage_model.", "vae.")
WAN_VAE_MARKER = "decoder.middle.0.residual.0.gamma"


def read_vae_state_dict(path) -> dict[str, torch.Tensor]:
    """A VAE file's tensors with diffusers (AutoencoderKLQwenImage) names, whichever of the two layouts."""
    from diffusers.loaders.single_file_utils import convert_wan_vae_to_diffusers

    tensors = _read_tensors(path, "VAE")
    for prefix in VAE_PREFIXES:
        if tensors and all(k.startswith(prefix) for k in tensors):
            tensors = {k[len(prefix):]: v for k, v in tensors.items()}
    if WAN_VAE_MARKER in tensors:
        return convert_wan_vae_to_diffusers(tensors)
    if "decoder.mid_block.resnets.0.norm1.gamma" in tensors:
        return tensors
    sample = ", ".join(sorted(tensors)[:4])
    raise SingleFileError(f"{path}: not a Qwen-Image VAE (found keys like {sample}); expected ComfyUI's "
                          f"qwen_image_vae.safetensors layout ({WAN_VAE_MARKER}) or diffusers' AutoencoderKLQwenImage")


def load_vae_file(path, *, device: torch.device, dtype: torch.dtype, config: dict | None = None):
    """AutoencoderKLQwenImage from one file. `config` defaults to the real Qwen-Image VAE's (diffusers' class
    defaults, latents_mean/std included) with base_dim and z_dim read from the weights."""
    from diffusers import AutoencoderKLQwenImage

    with torch.inference_mode(False):
        tensors = read_vae_state_dict(path)
        if config is None:
            config = {"base_dim": tensors["encoder.conv_in.weight"].shape[0],
                      "z_dim": tensors["post_quant_conv.weight"].shape[0]}
        config = {k: v for k, v in config.items() if not k.startswith("_")}
        model = AutoencoderKLQwenImage(**config)
        expected = model.state_dict()
        missing = sorted(set(expected) - set(tensors))
        wrong = [f"{k}: {tuple(tensors[k].shape)} (expected {tuple(v.shape)})" for k, v in expected.items()
                 if k in tensors and tensors[k].shape != v.shape]
        if missing or wrong:
            raise SingleFileError(f"{path}: does not match a Qwen-Image VAE {config}: missing {missing[:4]}, "
                                  f"wrong shapes {wrong[:4]}")
        model.load_state_dict({k: tensors[k] for k in expected})
        return model.to(device=device, dtype=dtype).eval().requires_grad_(False)
