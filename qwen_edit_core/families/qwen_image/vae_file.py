"""The 2025 Qwen-Image family's VAE file: ComfyUI's Wan 2.1 layout or diffusers' (model/single_file.py reads both)."""

from __future__ import annotations

from qwen_edit_core.model.single_file import load_wan_vae_file as load_vae  # noqa: F401 - this family's `load_vae`


def claims(header) -> bool:
    """Whether a VAE file's header is this family's: any VAE no other family claims is (`families.DEFAULT`)."""
    del header
    return True


def directory_config(config: dict | None) -> None:
    """What a VAE file takes from its model directory's vae/config.json: nothing (the file gives its widths, and
    diffusers' class defaults are the real VAE's latent statistics)."""
    del config
