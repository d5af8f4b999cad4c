"""The pretrained toy Qwen-Image-Edit's own pieces; toys/pretrain.py runs the build (`qwen-edit tiny --pretrained
--train`) with them (its docstring describes the steps): the constructed VAE (AutoencoderKLQwenImage: 8 base
channels, 16 latent channels, 8x) with its measured latent statistics and trained decoder, the transformer
settings, the (control, prompt) -> target data and its training batches."""

from __future__ import annotations

import logging
import math
import time

import numpy as np
import torch

from qwen_edit_core.data import synthetic
from qwen_edit_core.families.qwen_image import encode as family_encode
from qwen_edit_core.model import encode
from qwen_edit_core.families.qwen_image.tiny import transformer_config
from qwen_edit_core.toys.pretrain import cosine, vae_input
from qwen_edit_core.toys.vae import CONST, blank_vae, head_gain, identity_latents

log = logging.getLogger(__name__)

#: this toy's changes to `toys.pretrain.Recipe`'s defaults (which are its own): none
RECIPE: dict = {}

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


def transformer_settings(recipe) -> dict:
    """The toy transformer's config: the tiny one with `recipe.heads` heads of `recipe.head_dim` and
    `recipe.layers` blocks. The rotary split keeps Qwen-Image's 1/4 : 3/8 : 3/8 (frames, rows, columns): with
    32-wide heads each image axis gets 6 frequencies, enough to tell all 8 token rows of a 128 px picture
    apart (16-wide heads have one usable frequency per axis, which repeats every 6 tokens)."""
    time = recipe.head_dim // 4
    space = (recipe.head_dim - time) // 2
    return {**transformer_config("tiny", num_layers=recipe.layers), "num_attention_heads": recipe.heads,
            "attention_head_dim": recipe.head_dim, "axes_dims_rope": (time, space, recipe.head_dim - time - space)}


def _stats_batch(rng: np.random.Generator, size: int, n: int = 8):
    """Synthetic pictures under every edit (the demo's too)."""
    edits = [*synthetic.EDITS.values(), synthetic.DEMO_EDIT[1]]
    return [edits[int(rng.integers(0, len(edits)))](synthetic.picture(rng, size)) for _ in range(n)]


@torch.no_grad()
def make_vae(recipe):
    """The constructed VAE with `latents_mean`/`latents_std` set to its latents' per-channel statistics over
    64 synthetic pictures (the always-zero channels 12-15 keep mean 0 and std 1)."""
    if (recipe.constant_latents, recipe.latent_basis) != (0, "squares"):
        raise ValueError(f"Recipe(constant_latents={recipe.constant_latents}, latent_basis={recipe.latent_basis!r}): "
                         f"the {recipe.variant!r} toy's VAE has neither; set them to 0 and 'squares'")
    vae = constructed_vae(VAE_CONFIG).eval()
    rng = np.random.default_rng(recipe.seed + 1)
    z = torch.cat([vae.encode(vae_input(_stats_batch(rng, recipe.size))).latent_dist.mode() for _ in range(8)])
    mean, std = z.mean(dim=(0, 2, 3, 4)), z.std(dim=(0, 2, 3, 4))
    live = std > 1e-6
    mean, std = torch.where(live, mean, 0.0), torch.where(live, std, 1.0)
    vae.register_to_config(latents_mean=[round(float(v), 4) for v in mean],
                           latents_std=[round(float(v), 4) for v in std])
    return vae


@torch.no_grad()
def _wake_residuals(decoder, seed: int) -> None:
    """Make the decoder's residual branches trainable without changing its output: their first norms'
    gains scale the colour channels to unit size (the constant channel dominates the norm, so they would
    reach the branch at 1/CONST) and the constant channel to one, and their conv1 / attention qkv weights
    get a seeded default init. The branches' output layers (conv2, proj) stay zero, so the output is the
    constructed one; with everything zero gradients would only reach biases."""
    generator = torch.Generator().manual_seed(seed)
    for name, module in decoder.named_modules():
        if name.endswith(("conv1", "to_qkv")):
            bound = 1.0 / math.sqrt(module.weight[0].numel())
            module.weight.copy_(torch.rand(module.weight.shape, generator=generator) * 2 * bound - bound)
        if name.endswith(("norm1", "attentions.0.norm")):
            dim = module.gamma.shape[0]
            module.gamma.fill_(CONST / dim ** 0.5)
            module.gamma[3] = 1.0 / dim ** 0.5


def _branch_parameters(decoder) -> list:
    """The residual branches' and attention's parameters (the constructed linear path stays as it is)."""
    return [p for name, p in decoder.named_parameters()
            if (".resnets." in name and ".conv_shortcut." not in name) or ".attentions." in name]


def train_vae_decoder(recipe, vae):
    """Train `vae`'s decoder in place by gradient descent on synthetic pictures (pixel MSE in [-1, 1]
    units, Adam with cosine decay), starting from the constructed weights. The encoder, quant_conv and
    `latents_mean`/`latents_std` are untouched, so the latents (and the transformer trained on them) do not
    change. Only the residual branches and attention train (`_branch_parameters`); their output layers
    start at zero, so training starts at the constructed decoder's output and learns sharper edges and the
    detail the latents carry beyond the cell means (the four 4x4 squares' colours)."""
    _wake_residuals(vae.decoder, recipe.seed + 5)
    params = _branch_parameters(vae.decoder)
    for param in vae.parameters():
        param.requires_grad_(False)
    for param in params:
        param.requires_grad_(True)
    opt = torch.optim.Adam(params, lr=recipe.vae_lr)
    rng = np.random.default_rng(recipe.seed + 4)
    started = time.perf_counter()
    for step in range(recipe.vae_steps):
        for group in opt.param_groups:
            group["lr"] = recipe.vae_lr * cosine(step, recipe.vae_steps)
        pixels = vae_input([synthetic.picture(rng, recipe.size) for _ in range(recipe.vae_batch)])
        with torch.no_grad():
            z = vae.encode(pixels).latent_dist.mode()
        loss = torch.nn.functional.mse_loss(vae.decode(z, return_dict=False)[0], pixels)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if step % 50 == 0 or step == recipe.vae_steps - 1:
            log.info("vae decoder step %d/%d: pixel MSE %.5f (%.0f s)", step + 1, recipe.vae_steps, loss.item(),
                     time.perf_counter() - started)
    for param in vae.parameters():
        param.requires_grad_(False)
    return vae.eval()


@torch.no_grad()
def edit_dataset(recipe, vae, text_encoder, processor, prompts, functions) -> list[dict]:
    """Per (control picture, prompt, edit function): packed control and target tokens (16, 64) and the prompt's
    embeddings. The 2025 toy takes one control per pair: `recipe.extra_references` is refused."""
    if recipe.extra_references:
        raise ValueError(f"Recipe(extra_references={recipe.extra_references}): the {recipe.variant!r} toy takes one "
                         "control per pair; set it to 0")
    rng = np.random.default_rng(recipe.seed + 2)
    items = []
    for start in range(0, recipe.pictures, 32):
        controls = [synthetic.picture(rng, recipe.size) for _ in range(min(32, recipe.pictures - start))]
        control_tokens = family_encode.pack(encode.encode_latents(vae, vae_input(controls)))
        for prompt, function in zip(prompts, functions):
            target_tokens = control_tokens if function is synthetic.keep else \
                family_encode.pack(encode.encode_latents(vae, vae_input([function(c) for c in controls])))
            embeds = family_encode.encode_prompts(text_encoder, processor, [prompt] * len(controls),
                                           [[c] for c in controls], recipe.variant, device=torch.device("cpu"))
            items += [{"control": control_tokens[i], "target": target_tokens[i], "embeds": embeds[i]}
                      for i in range(len(controls))]
    return items


def batch(picked: list[dict], side: int, generators: list):
    """A `TrainBatch` of dataset items: each control after its target, `side` tokens a side."""
    from qwen_edit_core.families.qwen_image.batch import TrainBatch

    return TrainBatch(targets=[it["target"] for it in picked], controls=[it["control"] for it in picked],
                      embeds=encode.pad_embeddings([it["embeds"] for it in picked]),
                      img_shapes=[[(1, side, side), (1, side, side)]] * len(picked), generators=generators)
