"""The model files ComfyUI users already have: a Qwen-Image transformer or VAE as one safetensors file (the text
encoder file is families/qwen_image/text_encoder_file.py, which shares the reading and fp8 helpers here).

Layout, learned from ComfyUI's and diffusers' own source:
- Key names are diffusers' module paths: ComfyUI's `comfy/ldm/qwen_image/model.py` names its modules like
  diffusers' Qwen-Image transformer class (the family's `transformer_class`), and diffusers'
  `loaders/single_file_model.py` maps a Qwen-Image single file with the identity. Files saved from a ComfyUI
  model carry the `model.diffusion_model.` prefix (stripped by `comfy/sd.py` load_diffusion_model); both are accepted.
- `__index_timestep_zero__` (`variants.ZERO_COND_MARKER`, an empty tensor registered as a buffer in
  comfy/ldm/qwen_image/model.py when `default_ref_method == "index_timestep_zero"`) marks Edit-2511:
  `zero_cond_t=True` in diffusers.
- Scaled fp8 (comfy/model_detection.py: a `scaled_fp8` key; comfy/ops.py: per-layer `.scale_weight`, weight
  = fp8 * scale_weight, optional `.scale_input`) and the newer per-layer `.weight_scale` + `.comfy_quant` form.
  fp8 weights are either upcast at load to the requested dtype (w = fp8.float() * scale), or kept: the block
  linears become `speed.Fp8Linear` holding the file's e4m3 bytes unchanged with the per-tensor scale as their
  per-channel scales (the same effective weights), and run fp8 matmuls. `fp8="auto"` keeps them where the
  device computes in fp8 (CUDA, compute capability >= 8.9) and upcasts elsewhere; the log says which, with
  the weights' memory (the real transformer's sizes: docs/MODEL.md, "The real model's sizes").
The architecture is read from the shapes by the family's layout (`Family.file_layout`, families/<family>/
single_file.py: the 2025 family's matches the configs shipped in `model/architectures/
transformer_architectures.json`).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch

from qwen_edit_core.model import file_stream


from qwen_edit_core.families import DEFAULT, variants
log = logging.getLogger(__name__)

PREFIXES = ("model.diffusion_model.", "diffusion_model.")
_SCALE_SUFFIXES = (".scale_weight", ".weight_scale")
_DROP_SUFFIXES = (".scale_input", ".input_scale", ".comfy_quant")
_FP8 = tuple(getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2") if hasattr(torch, n))
ARCHITECTURES = Path(__file__).parent / "architectures" / "transformer_architectures.json"


class SingleFileError(ValueError):
    """A model file this loader cannot use; the message names the file and what was expected."""


def _read_tensors(path, what: str) -> dict[str, torch.Tensor]:
    """Every tensor of a safetensors file; errors name the file and say what it should be."""
    path = Path(path)
    if not path.is_file():
        raise SingleFileError(f"{what} file {str(path)!r} does not exist")
    try:
        return file_stream.read_tensors(path)
    except Exception as err:  # noqa: BLE001 - safetensors raises several types for damaged files
        raise SingleFileError(f"{str(path)!r} is not a readable safetensors file: {err}") from None


def check_quant_formats(tensors: dict[str, torch.Tensor], source) -> None:
    """Refuse layers quantized in a format other than scaled fp8 (the `.comfy_quant` JSON names it, e.g. nvfp4,
    whose packed weights and block scales this loader cannot upcast)."""
    formats = {}
    for key, value in tensors.items():
        if key.endswith(".comfy_quant"):
            try:
                formats[key] = json.loads(bytes(value.to(torch.uint8).tolist())).get("format", "")
            except (ValueError, AttributeError):
                formats[key] = "unreadable"
    other = {k: f for k, f in formats.items() if not str(f).startswith("float8")}
    if other:
        key, fmt = next(iter(other.items()))
        raise SingleFileError(f"{source}: {len(other)} layer(s) quantized as {fmt!r} ({key}); only bf16/fp16/fp32 and "
                              "scaled fp8 (float8_e4m3fn / float8_e5m2 with per-tensor scales) are read: use the "
                              "model's bf16 file (ComfyUI's *_bf16.safetensors) or its diffusers directory instead")


def read_state_dict(path: Path) -> tuple[dict[str, torch.Tensor], dict]:
    """(tensors with diffusers names, flags) of a transformer file; fp8 weights not yet dequantized."""
    tensors = _read_tensors(path, "transformer")
    check_quant_formats(tensors, path)
    names, flags = transformer_names(tensors)
    return {names[k]: tensors[k] for k in names}, flags


def transformer_names(tensors: dict[str, torch.Tensor]) -> tuple[dict[str, str], dict]:
    """({file key: diffusers key} of the tensors a model takes, flags) of a transformer file's keys: prefixes
    stripped, markers turned into flags, input scales and quantization notes dropped."""
    names, flags = {}, {"zero_cond_t": False, "scaled_fp8": False}
    for file_key in tensors:
        key = file_key
        for prefix in PREFIXES:
            if key.startswith(prefix):
                key = key[len(prefix):]
                break
        if key == variants.ZERO_COND_MARKER:
            flags["zero_cond_t"] = True
        elif key == "scaled_fp8":
            flags["scaled_fp8"] = True
        elif not key.endswith(_DROP_SUFFIXES):
            names[file_key] = key
    return names, flags


def checked_header(path, what: str) -> dict[str, torch.Tensor]:
    """Every tensor of a safetensors file as a meta tensor (shapes and dtypes), after checking its quantization
    formats (the only tensors read are the small `.comfy_quant` notes); errors name the file and `what` it
    should be."""
    path = Path(path)
    if not path.is_file():
        raise SingleFileError(f"{what} file {str(path)!r} does not exist")
    try:
        header = file_stream.read_header(path)
        check_quant_formats(file_stream.read_tensors(path, [k for k in header if k.endswith(".comfy_quant")]), path)
    except SingleFileError:
        raise
    except Exception as err:  # noqa: BLE001 - a damaged file raises several types
        raise SingleFileError(f"{str(path)!r} is not a readable safetensors file: {err}") from None
    return header


def _read_header(path) -> tuple[dict[str, torch.Tensor], dict[str, str], dict]:
    """(meta tensors by diffusers key, {file key: diffusers key}, flags) of a transformer file."""
    header = checked_header(path, "transformer")
    names, flags = transformer_names(header)
    return {names[k]: header[k] for k in names}, names, flags


def dequantize(tensors: dict[str, torch.Tensor], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Upcast fp8 weights with their per-layer scales; cast everything else to `dtype`."""
    scales = {k[: -len(s)]: v for k, v in tensors.items() for s in _SCALE_SUFFIXES if k.endswith(s)}
    out = {}
    for key, value in tensors.items():
        if key.endswith(_SCALE_SUFFIXES):
            continue
        if value.dtype in _FP8:
            scale = scales.get(key.removesuffix(".weight"))
            value = value.float()
            if scale is not None:
                value.mul_(scale.float())  # in place: one fp32 temporary of the tensor, not two
        out[key] = value.to(dtype)
    return out


def check_state_dict(tensors: dict[str, torch.Tensor], expected: dict[str, torch.Tensor], problem: str) -> None:
    """Raise SingleFileError(`problem`: the first missing and unexpected keys and wrong shapes) unless
    `tensors` has exactly the keys and shapes of `expected`."""
    missing = sorted(set(expected) - set(tensors))
    unexpected = sorted(set(tensors) - set(expected))
    wrong = [f"{k}: {tuple(tensors[k].shape)} (expected {tuple(v.shape)})" for k, v in expected.items()
             if k in tensors and tensors[k].shape != v.shape]
    if missing or unexpected or wrong:
        raise SingleFileError(f"{problem}: missing {missing[:4]}, unexpected {unexpected[:4]}, "
                              f"wrong shapes {wrong[:4]}")


FP8_MODES = ("auto", "keep", "upcast")


def keeps_fp8(mode: str, tensors: dict[str, torch.Tensor], device: torch.device) -> bool:
    """Whether a file's fp8 weights stay in fp8 (`mode` "auto": where the device computes in fp8)."""
    from qwen_edit_core import speed
    if mode not in FP8_MODES:
        raise ValueError(f"fp8 mode {mode!r} is not accepted; accepted: {', '.join(FP8_MODES)}")
    if mode == "upcast" or not any(v.dtype == torch.float8_e4m3fn for v in tensors.values()):
        return False
    device = torch.device(device)
    if mode == "auto":
        return device.type == "cuda" and speed.fp8_matmul_supported(device)
    if not speed.fp8_matmul_supported(device):
        raise ValueError(f"model.transformer_fp8 'keep' needs fp8 matmuls (CUDA compute capability >= 8.9); "
                         f"{device} has none: use 'upcast' or 'auto'")
    return True


def _fp8_state(tensors: dict[str, torch.Tensor], fp8_modules: set[str], dtype: torch.dtype) -> dict:
    """The state dict of a model whose `fp8_modules` are `speed.Fp8Linear`: their e4m3 weights as stored (the
    per-tensor scale broadcast to per-channel scales: the same effective weights), other weights in those
    modules quantized per channel, everything else upcast as `dequantize` does."""
    from qwen_edit_core import speed
    scales = {k[: -len(s)]: v for k, v in tensors.items() for s in _SCALE_SUFFIXES if k.endswith(s)}
    rest = {}
    out = {}
    for key, value in tensors.items():
        module, _, leaf = key.rpartition(".")
        if module not in fp8_modules or leaf != "weight":
            rest[key] = value
            continue
        scale = scales.get(module)
        if value.dtype == torch.float8_e4m3fn and (scale is None or scale.numel() in (1, value.shape[0])):
            scale = torch.ones(()) if scale is None else scale.float()
            out[f"{module}.weight_fp8"] = value
            out[f"{module}.weight_scale"] = scale.reshape(-1, 1).expand(value.shape[0], 1).contiguous()
        else:
            weight = value.float() * (scale.float() if scale is not None and value.dtype in _FP8 else 1.0)
            out[f"{module}.weight_fp8"], out[f"{module}.weight_scale"] = speed.quantize_rows(weight)
    return {**dequantize(rest, dtype), **out}


def _bytes(model) -> int:
    return sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers()))


# -- VAE ----------------------------------------------------------------------------------------------------
# ComfyUI's qwen_image_vae.safetensors is its Wan 2.1 VAE layout (comfy/sd.py recognises
# `decoder.middle.0.residual.0.gamma` and builds comfy.ldm.wan.vae.WanVAE with dim 96, z_dim 16,
# dim_mult [1, 2, 4, 4], num_res_blocks 2). diffusers' loaders/single_file_utils.py
# `convert_wan_vae_to_diffusers` maps that layout onto the Qwen-Image VAE class's module names (same architecture;
# the converter assumes num_res_blocks 2, which the real VAE and our tiny VAE have).
VAE_PREFIXES = ("first_stage_model.", "vae.")
WAN_VAE_MARKER = "decoder.middle.0.residual.0.gamma"


def read_vae_state_dict(path) -> dict[str, torch.Tensor]:
    """A VAE file's tensors with the diffusers Qwen-Image VAE class's (`vae_class`) names, whichever of the two
    layouts."""
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
                          f"qwen_image_vae.safetensors layout ({WAN_VAE_MARKER}) or diffusers' {DEFAULT.vae_class}")


def load_vae_file(path, *, device: torch.device, dtype: torch.dtype, config: dict | None = None):
    """A VAE file as its family's model (`families.family_of` reads the family from the header; its
    families/<family>/vae_file.py `load_vae` loads it); `config` as that loader takes it."""
    from qwen_edit_core.families import DEFAULT, family_of
    family = family_of(checked_header(path, "VAE")) if Path(path).is_file() else DEFAULT
    return family.stage("vae_file").load_vae(path, device=device, dtype=dtype, config=config)
