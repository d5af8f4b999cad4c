"""The 2025 Qwen-Image family's VAE file: ComfyUI's Wan 2.1 layout or diffusers' (model/single_file.py reads both)."""

from __future__ import annotations

import torch

from qwen_edit_core.model import single_file


def claims(header) -> bool:
    """Whether a VAE file's header is this family's: any VAE no other family claims is (`families.DEFAULT`)."""
    del header
    return True


def directory_config(config: dict | None) -> None:
    """What a VAE file takes from its model directory's vae/config.json: nothing (the file gives its widths, and
    diffusers' class defaults are the real VAE's latent statistics)."""
    del config


def load_vae(path, *, device: torch.device, dtype: torch.dtype, config: dict | None = None):
    """AutoencoderKLQwenImage from one file (the 2025 family's `load_vae`). `config` defaults to the real
    Qwen-Image VAE's (diffusers' class defaults, latents_mean/std included) with base_dim and z_dim read from the
    weights."""
    from diffusers import AutoencoderKLQwenImage

    with torch.inference_mode(False):
        tensors = single_file.read_vae_state_dict(path)
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
            raise single_file.SingleFileError(f"{path}: does not match a Qwen-Image VAE {config}: "
                                              f"missing {missing[:4]}, wrong shapes {wrong[:4]}")
        model.load_state_dict({k: tensors[k] for k in expected})
        return model.to(device=device, dtype=dtype).eval().requires_grad_(False)
