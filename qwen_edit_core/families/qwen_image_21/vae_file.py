"""Qwen-Image-2.1's VAE as ComfyUI ships it: one safetensors file (ComfyUI's vae folder,
`qwen_image_2.1_vae_bf16.safetensors`), read into diffusers' `AutoencoderKLQwenImage21`, streamed.

The layout, from ComfyUI's and diffusers' own source (docs/MODEL.md gives the commits): ComfyUI builds the 2.1 VAE
as its Wan 2.2 VAE (`comfy/ldm/wan/vae2_2.py` `WanVAE`) with temporal kernel 1, no patchify and four image channels
(RGBA). Its module names map one to one onto diffusers' (`is_residual=True`):
- `{encoder,decoder}.conv1` -> `conv_in`; `head.0` -> `norm_out`; `head.2` -> `conv_out`; the top-level `conv1` /
  `conv2` -> `quant_conv` / `post_quant_conv`;
- `middle.0` / `middle.2` -> `mid_block.resnets.0` / `.1`, `middle.1` -> `mid_block.attentions.0`;
- `encoder.downsamples.I.downsamples.J` -> `encoder.down_blocks.I.resnets.J` for a residual block, else (the
  last entry: `resample`, `time_conv`) `encoder.down_blocks.I.downsampler`; the decoder's `upsamples.I.upsamples.J`
  likewise -> `up_blocks.I.resnets.J` / `up_blocks.I.upsampler`;
- inside a residual block `residual.0/2/3/6` -> `norm1/conv1/norm2/conv2`, `shortcut` -> `conv_shortcut`.
ComfyUI's convolutions are 3-D with a temporal kernel of 1; diffusers' 2.1 convolutions are 2-D, so those weights
lose their size-1 time axis. The latent statistics (`latents_mean` / `latents_std`) are not in the file (ComfyUI
keeps them in its latent format): they come from the model directory's vae/config.json when there is one, else
diffusers' defaults (the released 2.1 VAE's).
"""

from __future__ import annotations

import logging
import re
from pathlib import Path

import torch

from qwen_edit_core.model import file_stream, single_file

log = logging.getLogger(__name__)

#: ComfyUI's Wan 2.2 layout (its own test in comfy/sd.py); a 5-D `decoder.head.2.weight` of temporal size 1 is 2.1's
MARKERS = ("decoder.middle.0.residual.0.gamma", "decoder.upsamples.0.upsamples.0.residual.2.weight")
HEAD = "decoder.head.2.weight"
#: diffusers' own 2.1 names (a file saved from AutoencoderKLQwenImage21): 2-D convolutions
DIFFUSERS_MARKER = "decoder.mid_block.resnets.0.norm1.gamma"
_TOP = {"conv1": "quant_conv", "conv2": "post_quant_conv"}
_PARTS = {"conv1": "conv_in", "head.0": "norm_out", "head.2": "conv_out", "middle.0": "mid_block.resnets.0",
          "middle.1": "mid_block.attentions.0", "middle.2": "mid_block.resnets.1"}
_RESIDUAL = {"residual.0.": "norm1.", "residual.2.": "conv1.", "residual.3.": "norm2.", "residual.6.": "conv2.",
             "shortcut.": "conv_shortcut."}
_BLOCK = re.compile(r"(encoder|decoder)\.(?:down|up)samples\.(\d+)\.(?:down|up)samples\.(\d+)\.(.+)")
_STATISTICS = ("latents_mean", "latents_std")
#: modules that are 2-D convolutions in ComfyUI too (no time axis to add back)
_CONV2D = (".attentions.", ".resample.")


def _strip(keys) -> dict[str, str]:
    """{file key: key without ComfyUI's checkpoint prefix (`first_stage_model.`, `vae.`)}."""
    keys = list(keys)
    for prefix in single_file.VAE_PREFIXES:
        if keys and all(k.startswith(prefix) for k in keys):
            return {k: k[len(prefix):] for k in keys}
    return {k: k for k in keys}


def claims(header: dict[str, torch.Tensor]) -> bool:
    """Whether a VAE file's tensors (meta tensors will do) are Qwen-Image-2.1's, in ComfyUI's or diffusers' names
    (`families.family_of` asks each family's `claims`)."""
    tensors = {short: header[key] for key, short in _strip(header).items()}
    head = tensors.get(HEAD)
    if all(m in tensors for m in MARKERS) and head is not None:
        return head.ndim == 5 and head.shape[2] == 1
    out = tensors.get("decoder.conv_out.weight")
    return DIFFUSERS_MARKER in tensors and out is not None and out.ndim == 4


def _residual(rest: str) -> str:
    """A residual block's leaf name in diffusers' words (`residual.2.weight` -> `conv1.weight`)."""
    for old, new in _RESIDUAL.items():
        if rest.startswith(old):
            return new + rest[len(old):]
    return rest


def diffusers_name(key: str) -> str:
    """ComfyUI's name of a 2.1 VAE tensor -> diffusers' (AutoencoderKLQwenImage21); names already diffusers' (or
    unknown) are returned unchanged."""
    top, _, rest = key.partition(".")
    if top in _TOP:
        return f"{_TOP[top]}.{rest}"
    block = _BLOCK.fullmatch(key)
    if block:
        side, i, j, rest = block.groups()
        kind = "down" if side == "encoder" else "up"
        if rest.startswith(("residual.", "shortcut.")):
            return f"{side}.{kind}_blocks.{i}.resnets.{j}.{_residual(rest)}"
        return f"{side}.{kind}_blocks.{i}.{kind}sampler.{rest}"
    for old, new in _PARTS.items():
        if rest.startswith(old + "."):
            tail = rest[len(old) + 1:]
            return f"{top}.{new}.{_residual(tail) if old.startswith('middle.') else tail}"
    return key


def names(header: dict[str, torch.Tensor]) -> dict[str, str]:
    """{file key: diffusers key} of a 2.1 VAE file (either naming)."""
    return {key: diffusers_name(short) for key, short in _strip(header).items()}


def detect_config(tensors: dict[str, torch.Tensor], statistics: dict | None = None, source: str = "file") -> dict:
    """The AutoencoderKLQwenImage21 config of a state dict in diffusers' names (meta tensors will do): widths,
    channel multipliers, residual blocks and temporal down-sampling from the shapes; latent statistics from
    `statistics` (a VAE config) when given, else diffusers' defaults."""
    needed = ("encoder.conv_in.weight", "decoder.conv_out.weight", "decoder.norm_out.gamma", "post_quant_conv.weight")
    missing = [k for k in needed if k not in tensors]
    if missing:
        raise single_file.SingleFileError(
            f"{source}: an incomplete Qwen-Image-2.1 VAE (missing {missing}); expected ComfyUI's "
            "qwen_image_2.1_vae file or diffusers' AutoencoderKLQwenImage21 weights")
    base = tensors["encoder.conv_in.weight"].shape[0]
    blocks = sorted({int(m.group(1)) for k in tensors if (m := re.match(r"encoder\.down_blocks\.(\d+)\.", k))})
    mult = [tensors[f"encoder.down_blocks.{i}.resnets.0.conv1.weight"].shape[0] // base for i in blocks]
    resnets = {m.group(1) for k in tensors if (m := re.match(r"encoder\.down_blocks\.0\.resnets\.(\d+)\.", k))}
    config = {"base_dim": base, "decoder_base_dim": tensors["decoder.norm_out.gamma"].shape[0] // mult[0],
              "z_dim": tensors["post_quant_conv.weight"].shape[0], "dim_mult": mult, "num_res_blocks": len(resnets),
              "temperal_downsample": [f"encoder.down_blocks.{i}.downsampler.time_conv.weight" in tensors
                                      for i in blocks[:-1]],
              "in_channels": tensors["encoder.conv_in.weight"].shape[1],
              "out_channels": tensors["decoder.conv_out.weight"].shape[0],
              "is_residual": True, "attn_scales": [], "scale_factor_spatial": 2 ** (len(mult) - 1)}
    config.update({k: list(statistics[k]) for k in _STATISTICS if statistics and statistics.get(k) is not None})
    return config


def _squeezed(tensors: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """ComfyUI's 3-D convolution weights of temporal size 1 as the 2-D ones diffusers' model has."""
    out = {}
    for key, value in tensors.items():
        target = expected.get(key)
        if target is not None and value.ndim == target.ndim + 1 and value.shape[2] == 1:
            value = value.squeeze(2)
        out[key] = value
    return out


def load_vae_file(path, *, device: torch.device, dtype: torch.dtype, statistics: dict | None = None):
    """A frozen AutoencoderKLQwenImage21 from one file (ComfyUI's or diffusers' names), on `device` in `dtype`,
    streamed one module at a time; `statistics`: a VAE config whose latents_mean/std the model takes (the
    model directory's), else diffusers' defaults."""
    from accelerate import init_empty_weights
    from diffusers import AutoencoderKLQwenImage21

    with torch.inference_mode(False):  # ComfyUI calls loaders under inference mode
        header = single_file.checked_header(path, "VAE")  # refuses convrot, nvfp4, ...
        mapping = names(header)
        renamed = {mapping[k]: header[k] for k in mapping}
        config = detect_config(renamed, statistics, source=str(path))
        with init_empty_weights():
            model = AutoencoderKLQwenImage21(**config).requires_grad_(False)
        expected = model.state_dict()

        def convert(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
            return _squeezed(single_file.dequantize(tensors, dtype), expected)

        single_file.check_state_dict(convert(renamed), expected,
                                     f"{path}: does not match the detected Qwen-Image-2.1 VAE {config['dim_mult']}")
        file_stream.stream_into(model, Path(path), mapping, convert, torch.device(device))
        log.info("%s: Qwen-Image-2.1 VAE, widths %d/%d, %d latent channels, %d image channels", path,
                 config["base_dim"], config["decoder_base_dim"], config["z_dim"], config["out_channels"])
        return model.to(device).eval().requires_grad_(False)


def comfy_name(key: str) -> str:
    """diffusers' name of a 2.1 VAE tensor -> ComfyUI's (the inverse of `diffusers_name`)."""
    for top, new in _TOP.items():
        if key.startswith(new + "."):
            return top + key[len(new):]
    block = re.fullmatch(r"(encoder|decoder)\.(down|up)_blocks\.(\d+)\.(resnets\.(\d+)|\w+sampler)\.(.+)", key)
    if block:
        side, kind, i, part, j, rest = block.groups()
        if j is None:  # the sampler is the block's last entry, after its residual blocks
            return f"{side}.{kind}samples.{i}.{kind}samples.{{last}}.{rest}"
        rest = next((old + rest[len(new):] for old, new in _RESIDUAL.items() if rest.startswith(new)), rest)
        return f"{side}.{kind}samples.{i}.{kind}samples.{j}.{rest}"
    top, _, rest = key.partition(".")
    for old, new in _PARTS.items():
        if rest.startswith(new + "."):
            tail = rest[len(new) + 1:]
            if old.startswith("middle.") and "resnets" in new:
                tail = next((o + tail[len(n):] for o, n in _RESIDUAL.items() if tail.startswith(n)), tail)
            return f"{top}.{old}.{tail}"
    return key


def to_comfy(state: dict[str, torch.Tensor], config) -> dict[str, torch.Tensor]:
    """diffusers' 2.1 VAE state dict in ComfyUI's layout (3-D convolutions of temporal size 1), for writing a file
    ComfyUI reads; `config` is the model's (it gives the residual blocks per level)."""
    out = {}
    for key, value in state.items():
        name = comfy_name(key)
        if "{last}" in name:
            last = config["num_res_blocks"] + (0 if name.startswith("encoder.") else 1)
            name = name.replace("{last}", str(last))
        conv = value.ndim == 4 and not key.endswith("gamma") and not any(p in key for p in _CONV2D)
        out[name] = value.unsqueeze(2) if conv else value
    return out


def directory_config(config: dict | None) -> dict | None:
    """What a VAE file takes from its model directory's vae/config.json: its latent statistics (ComfyUI's file
    has none)."""
    return config


def load_vae(path, *, device: torch.device, dtype: torch.dtype, config: dict | None = None):
    """This family's VAE from one file; `config` gives only its latent statistics."""
    return load_vae_file(path, device=device, dtype=dtype, statistics=config)
