"""What the toy models' constructed VAEs share (the 2025 toy's in families/qwen_image/pretrain.py, the toy 2.1's in
families/qwen_image_21/pretrain.py).

Each starts as `blank_vae`: the family's VAE class with every weight zero but the RMS norms' gains (one), so
every residual branch and attention output is zero and each block is the identity (plus its shortcut). A
constant channel of CONST runs beside the colours, so each RMS norm divides by it alone and the path stays
linear up to SiLU's curvature (`head_gain`); `identity_latents` makes the latent path an identity.
"""

from __future__ import annotations

import torch

#: the constructed VAEs' constant channel (large, so the RMS norms divide by it alone)
CONST = 1000.0


def blank_vae(vae_class, config: dict):
    """A `vae_class(**config)` with every parameter zero, the norms' gains (`gamma`) one."""
    vae = vae_class(**config)
    for param in vae.parameters():
        param.zero_()
    for name, param in vae.named_parameters():
        if name.endswith("gamma"):
            param.fill_(1.0)
    return vae


def head_gain(dim: int) -> float:
    """A conv_out's gain after RMS_norm(dim) and SiLU: the norm scales by sqrt(dim)/|f| (|f| ~ CONST, the
    constant channel) and SiLU(u) ~ u/2 near 0."""
    return 2 * CONST / dim ** 0.5


def identity_latents(vae, z_dim: int) -> None:
    """quant_conv passes the encoder's first `z_dim` channels on as the posterior's mean, with a log-variance of
    -10 (the posterior is, almost, its mode); post_quant_conv is the identity. The convolutions' centre tap,
    whatever their dimensions (the 2025 VAE's are 3-D, the 2.1 VAE's 2-D)."""
    quant, post = vae.quant_conv.weight, vae.post_quant_conv.weight
    centre = (0,) * (quant.dim() - 2)
    quant[(slice(0, z_dim), slice(0, z_dim), *centre)] = torch.eye(z_dim)
    vae.quant_conv.bias[z_dim:] = -10.0
    post[(slice(None), slice(None), *centre)] = torch.eye(z_dim)
