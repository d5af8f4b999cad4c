"""The 2025 toy model's constructed VAE (AutoencoderKLQwenImage: 8 base channels, 16 latent channels, 8x); the
build (`pretrain.py`) measures its latent statistics and trains its decoder. See `constructed_vae`."""

from __future__ import annotations

import torch

from qwen_edit_core.toys.vae import CONST, blank_vae, head_gain, identity_latents

VAE_CONFIG = dict(base_dim=8, z_dim=16, dim_mult=[1, 2, 4, 4], num_res_blocks=1, attn_scales=[],
                  temperal_downsample=[False, True, True], dropout=0.0)
#: the 2x2 sub-positions a latent cell's 12 colour channels hold (4 px squares of an 8 px cell)
_SUBCELLS = ((0, 0), (0, 1), (1, 0), (1, 1))


def _copy_shortcuts(vae, channels: int = 4) -> None:
    for name, module in vae.named_modules():
        if name.endswith("conv_shortcut") and hasattr(module, "weight"):
            for c in range(channels):
                module.weight[c, c, 0, 0, 0] = 1.0


@torch.no_grad()
def constructed_vae(config: dict):
    """An AutoencoderKLQwenImage (from `blank_vae`) whose weights compute, exactly up to SiLU's curvature
    (< 0.3 % here):

    - encoder: RGB and a constant channel (CONST) through 2x2 averages at the first two downsamples, a
      2x2 space-to-depth at the third, so latent channels 0-11 are the mean colours of the four 4x4-pixel
      squares of each 8x8-pixel cell (12-15 stay 0);
    - decoder: the cell's mean colour, upsampled three times (nearest, then a [1 2 1] tent filter per axis;
      the constant channel is filtered alike, and the final RMS norm divides by it, so borders are a
      normalized convolution): a smooth 8x-upsampled picture.
    Training (`train_vae`) starts from here.
    """
    from diffusers import AutoencoderKLQwenImage

    vae = blank_vae(AutoencoderKLQwenImage, config)
    enc, dec = vae.encoder, vae.decoder
    for c in range(3):
        enc.conv_in.weight[c, c, 2, 1, 1] = 1.0
    enc.conv_in.bias[3] = CONST
    _copy_shortcuts(vae)
    for block in (enc.down_blocks[1], enc.down_blocks[3]):
        conv = block.resample[1]
        for c in range(4):
            conv.weight[c, c, :2, :2] = 0.25 if c < 3 else 0.0
        conv.weight[3, 3, 0, 0] = 1.0
    last = enc.down_blocks[5].resample[1]
    for k, (dy, dx) in enumerate(_SUBCELLS):
        for c in range(3):
            last.weight[3 * k + c, c, dy, dx] = 1.0
    last.weight[12, 3, 0, 0] = 1.0
    gain = head_gain(enc.conv_out.weight.shape[1])
    for c in range(12):
        enc.conv_out.weight[c, c, 2, 1, 1] = gain
    identity_latents(vae, 16)
    for k in range(4):
        for c in range(3):
            dec.conv_in.weight[c, 3 * k + c, 2, 1, 1] = 0.25
    dec.conv_in.bias[3] = CONST
    tent = torch.tensor([1.0, 2.0, 1.0])
    tent = torch.outer(tent, tent) / 16
    for block in dec.up_blocks:
        for up in block.upsamplers or []:
            for c in range(4):
                up.resample[1].weight[c, c] = tent
    gain = head_gain(dec.conv_out.weight.shape[1])
    for c in range(3):
        dec.conv_out.weight[c, c, 2, 1, 1] = gain
    return vae
