"""The pretrained toy Qwen-Image-2.1's own pieces; `pretrain.py` runs the build (`qwen-edit tiny --variant image-2.1
--pretrained --train`) with them.

1. The VAE (`AutoencoderKLQwenImage21`, 64 latent channels, 16x, RGBA in and out) is constructed and fitted, not
   trained by gradient descent. Its 16x comes from the class's own `patch_size` (16: `_patchify` folds each 16x16
   pixel patch into 1024 channels before the encoder, `_unpatchify` unfolds the decoder's output), with one
   level of residual blocks (`dim_mult [1]`, so no down/up-sampling blocks): the 2.1 architecture's first up
   block repeats each latent pixel to its 2x2 children (`DupUp3D` with equal channel counts), and no
   shift-invariant layer after a repetition can tell the children apart, so a cascade of up blocks could only
   paint each 16 px cell's mean colour.
   - encoder: every residual branch and attention output is zero (the blocks are identities); `conv_in` writes
     the mean RGB of each 4x4-pixel square of the patch into channels 0-47 (16 squares x RGB) and a constant
     channel (CONST, which the RMS norms divide by, so the path stays linear up to SiLU's curvature); `conv_out`
     copies the 48 colour channels to latent channels 0-47 (48-63 stay 0, or `Recipe.constant_latents` of them
     hold 1 once normalized: a constant input for the transformer, whose projections have no bias and whose
     LayerNorms have no shift). `Recipe.latent_basis` "dct" stores each colour channel's 4x4 squares as their
     2-D DCT and the colours as luma and two opponent channels (`latent_basis`), so that normalizing each channel
     to unit variance weighs a token's detail as much as its mean colour. `latents_mean`/`latents_std` are the
     colour channels' measured statistics (the others keep mean 0 and std 1).
   - decoder: identities again up to `conv_out`, whose 3x3 taps map the latents of a cell and its 8 neighbours
     to the cell's 16x16 RGB pixels: a ridge least-squares fit (float64, `_fit_decoder`) to synthetic pictures,
     made on the decoder's own features (so SiLU's curvature is part of the fit). Alpha is 1 (bias only).
2. The transformer (`QwenImage21Transformer2DModel`) learns "keep the image" (copy reference 1), "make it
   grayscale" and "move the shapes left" from (reference, prompt) -> target pairs encoded exactly as the 2.1
   trainer encodes them (`encode21`: one reference, in its vision slots), with the trainer's flow-matching loss
   (`batch.predict` via `flow_loss`).
"""

from __future__ import annotations

import logging

import numpy as np
import torch
from PIL import ImageOps

from qwen_edit_core.data import synthetic
from qwen_edit_core.model import encode
from qwen_edit_core.families.qwen_image_21 import encode as encode21
from qwen_edit_core.toys.vae import CONST, blank_vae, head_gain, identity_latents

log = logging.getLogger(__name__)

#: pixels per latent pixel along each side, all of it from the VAE's patchify
PATCH = 16
#: 4x4-pixel squares per patch side
SQUARES = 4
#: channels of the residual stages (48 colours, the constant channel, 3 spare)
WIDTH = 52
COLOURS = 3 * SQUARES * SQUARES
CONST_CHANNEL = COLOURS
VAE_CONFIG = dict(base_dim=WIDTH, decoder_base_dim=WIDTH, z_dim=64, dim_mult=[1], num_res_blocks=1, attn_scales=[],
                  temperal_downsample=[], dropout=0.0, is_residual=True, in_channels=4 * PATCH * PATCH,
                  out_channels=4 * PATCH * PATCH,
                  patch_size=PATCH, scale_factor_temporal=1, scale_factor_spatial=PATCH)


def _patch_channel(colour: int, x: int, y: int) -> int:
    """The channel `_patchify` gives pixel (x, y) of a patch's colour channel: c * p^2 + x * p + y (it permutes the
    column offset before the row offset)."""
    return colour * PATCH * PATCH + x * PATCH + y


#: `Recipe.latent_basis` choices
BASES = ("squares", "dct")


def latent_basis(basis: str) -> torch.Tensor:
    """(48, 48), orthonormal: the latent colour channels from a patch's square colours (index 3 * square + colour):
    "squares" the identity, "dct" the squares' 2-D DCT-II times (luma, red-green, yellow-blue) per square."""
    if basis not in BASES:
        raise ValueError(f"Recipe(latent_basis={basis!r}): accepted: {', '.join(BASES)}")
    if basis == "squares":
        return torch.eye(COLOURS)
    n = torch.arange(SQUARES, dtype=torch.float64)
    dct = torch.cos(torch.pi * (n[None] + 0.5) * n[:, None] / SQUARES) * (2 / SQUARES) ** 0.5
    dct[0] /= 2 ** 0.5
    colour = torch.tensor([[1, 1, 1], [1, -1, 0], [1, 1, -2]], dtype=torch.float64)
    colour /= colour.norm(dim=1, keepdim=True)
    return torch.kron(torch.kron(dct, dct), colour).float()


@torch.no_grad()
def constructed_vae(config: dict = VAE_CONFIG, constant_latents: int = 0, basis: str = "squares"):
    """The 2.1 VAE (from `blank_vae`: its residual branches and attention outputs zero, the blocks identities) with
    the constructed encoder (`basis`: `latent_basis`; `constant_latents` channels after the colours hold the
    constant) and an identity decoder up to its (unfitted, zero) conv_out."""
    from diffusers import AutoencoderKLQwenImage21

    spare = config["z_dim"] - COLOURS  # conv_out's other z_dim outputs are the logvars
    if not 0 <= constant_latents <= spare:
        raise ValueError(f"Recipe(constant_latents={constant_latents}): accepted 0 to {spare} (the latent channels "
                         f"after the {COLOURS} colour ones, of {config['z_dim']})")
    vae = blank_vae(AutoencoderKLQwenImage21, config)
    enc, dec = vae.encoder, vae.decoder
    squares = torch.zeros(COLOURS, enc.conv_in.weight.shape[1])
    for sy in range(SQUARES):
        for sx in range(SQUARES):
            for c in range(3):
                k = 3 * (sy * SQUARES + sx) + c
                for y in range(4 * sy, 4 * sy + 4):
                    for x in range(4 * sx, 4 * sx + 4):
                        squares[k, _patch_channel(c, x, y)] = 1.0 / 16
    enc.conv_in.weight[:COLOURS, :, 1, 1] = latent_basis(basis) @ squares
    enc.conv_in.bias[CONST_CHANNEL] = CONST
    # conv_out reads SiLU(RMS_norm(x)) ~ x * sqrt(WIDTH) / |x| / 2 with |x| ~ the constant channel (the down
    # block adds its identity resnet to its identity shortcut, doubling colours and constant alike)
    for k in range(COLOURS):
        enc.conv_out.weight[k, k, 1, 1] = head_gain(WIDTH)
    # the constant channel reaches conv_out as SiLU(sqrt(WIDTH)) (it dominates the norm); make_vae leaves it
    # unnormalized, so it stays 1
    feature = WIDTH ** 0.5 * torch.sigmoid(torch.tensor(WIDTH ** 0.5)).item()
    for k in range(COLOURS, COLOURS + constant_latents):
        enc.conv_out.weight[k, CONST_CHANNEL, 1, 1] = 1.0 / feature
    identity_latents(vae, 64)
    for k in range(COLOURS):
        dec.conv_in.weight[k, k, 1, 1] = 1.0
    dec.conv_in.bias[CONST_CHANNEL] = CONST
    return vae


def _pixels(images) -> torch.Tensor:
    """PIL pictures -> (B, 4, 1, H, W) RGBA in [-1, 1], as the 2.1 encoders give the VAE (opaque)."""
    return torch.cat([encode21.prepare_references([img], img.width * img.height).pixels[0] for img in images])


@torch.no_grad()
def _decoder_features(vae, latents: torch.Tensor) -> torch.Tensor:
    """What the decoder's conv_out reads for raw `latents`, unfolded to each cell's 3x3 neighbourhood (zero
    padded as the conv pads): (cells, channels * 9) in conv_out's weight order."""
    seen = []
    hook = vae.decoder.conv_out.register_forward_hook(lambda _m, args, _out: seen.append(args[0]))
    try:
        vae.decode(latents)
    finally:
        hook.remove()
    feats = seen[0][:, :, 0]
    cols = torch.nn.functional.unfold(feats.double(), 3, padding=1)  # (B, C*9, H*W)
    return cols.permute(0, 2, 1).reshape(-1, cols.shape[1])


@torch.no_grad()
def _fit_decoder(vae, rng: np.random.Generator, pictures: int, size: int, ridge: float = 1e-6) -> None:
    """Set the decoder's conv_out (and bias) to the ridge least-squares map from each cell's 3x3 neighbourhood of
    decoder features to its patch of pixels (RGB; alpha is the bias 1), over `pictures` synthetic pictures."""
    from diffusers.models.autoencoders.autoencoder_kl_qwenimage21 import _patchify

    feats, targets = [], []
    for _ in range(pictures // 8):
        pixels = _pixels([_stats_picture(rng, size) for _ in range(8)])
        feats.append(_decoder_features(vae, vae.encode(pixels).latent_dist.mode()))
        patched = _patchify(pixels, PATCH)[:, :, 0].double()  # (B, 1024, h, w)
        targets.append(patched.permute(0, 2, 3, 1).reshape(-1, patched.shape[1]))
    x, y = torch.cat(feats), torch.cat(targets)
    x = torch.cat([x, torch.ones(x.shape[0], 1, dtype=x.dtype)], 1)
    gram = x.T @ x
    gram += ridge * gram.diagonal().mean() * torch.eye(gram.shape[0], dtype=gram.dtype)
    solution = torch.linalg.solve(gram, x.T @ y)  # (C*9 + 1, 1024)
    conv = vae.decoder.conv_out
    rgb = 3 * PATCH * PATCH
    conv.weight.zero_()
    conv.weight[:rgb] = solution[:-1, :rgb].T.reshape(rgb, *conv.weight.shape[1:]).to(conv.weight.dtype)
    conv.bias[:rgb] = solution[-1, :rgb].to(conv.bias.dtype)
    conv.bias[rgb:] = 1.0


def _stats_picture(rng: np.random.Generator, size: int):
    """A synthetic picture under one of the edits the toy model meets (the demo's too)."""
    edits = [*synthetic.EDITS.values(), synthetic.DEMO_EDIT[1]]
    return edits[int(rng.integers(0, len(edits)))](synthetic.picture(rng, size))


#: this toy's changes to `toys.pretrain.Recipe`'s defaults (`toys.pretrain.recipe_for` says why)
RECIPE = dict(transformer_steps=3000, transformer_lr=3e-3, layers=3, reference_steps=400)


@torch.no_grad()
def make_vae(recipe, pictures: int = 256):
    """The constructed encoder with `latents_mean`/`latents_std` from its latents over 64 synthetic pictures
    (`recipe.seed` + 1; the other channels keep mean 0 and std 1), and the fitted decoder (seed + 4)."""
    seed, size = recipe.seed, recipe.size
    vae = constructed_vae(constant_latents=recipe.constant_latents, basis=recipe.latent_basis).eval()
    rng = np.random.default_rng(seed + 1)
    z = torch.cat([vae.encode(_pixels([_stats_picture(rng, size) for _ in range(8)])).latent_dist.mode()
                   for _ in range(8)])
    mean, std = z.mean(dim=(0, 2, 3, 4)), z.std(dim=(0, 2, 3, 4))
    live = torch.arange(mean.shape[0]) < COLOURS
    mean, std = torch.where(live, mean, 0.0), torch.where(live, std, 1.0)
    vae.register_to_config(latents_mean=[round(float(v), 4) for v in mean],
                           latents_std=[round(float(v), 4) for v in std])
    _fit_decoder(vae, np.random.default_rng(seed + 4), pictures, size)
    return vae


def transformer_settings(recipe) -> dict:
    """The toy 2.1 transformer's config: tiny 2.1's with `recipe.layers` blocks of `recipe.heads` heads of
    `recipe.head_dim`, Qwen-Image's 1/4 : 3/8 : 3/8 rotary split (6 frequencies per image axis at 32-wide heads)."""
    from qwen_edit_core.families.qwen_image_21.tiny import transformer_config

    time = recipe.head_dim // 4
    space = (recipe.head_dim - time) // 2
    return {**transformer_config("tiny"), "num_layers": recipe.layers, "num_attention_heads": recipe.heads,
            "attention_head_dim": recipe.head_dim, "axes_dims_rope": (time, space, recipe.head_dim - time - space)}


def _distractors(rng: np.random.Generator, picture, share: float, size: int) -> list:
    """The references after `picture` in one pair: none, or (with probability `share`) one or two, each its colour
    inversion (what the 2.1 sample workflow passes as reference 2) or another picture. Draws nothing when `share`
    is 0, so recipes without extra references build the same bytes as before."""
    if share <= 0 or rng.random() >= share:
        return []
    return [ImageOps.invert(picture.convert("RGB")) if rng.random() < 0.5 else synthetic.picture(rng, size)
            for _ in range(int(rng.integers(1, 3)))]


@torch.no_grad()
def edit_dataset(recipe, vae, text_encoder, processor, prompts, functions) -> list[dict]:
    """Per (picture, prompt): the picture as reference 1 (tokens (64, 64)) followed by `_distractors` (their tokens
    after it, `recipe.extra_references` of the pairs, drawn from seed + 6), the target's tokens (the edit of
    reference 1), the prompt's embeddings and vision-slot mask, encoded as the 2.1 trainer encodes a pair
    (`families/qwen_image_21/example_tensors.py`)."""
    rng = np.random.default_rng(recipe.seed + 2)
    extra_rng = np.random.default_rng(recipe.seed + 6)
    drop = encode21.system_tokens(processor)
    area = recipe.size * recipe.size
    items = []
    for start in range(0, recipe.pictures, 32):
        pictures = [synthetic.picture(rng, recipe.size) for _ in range(min(32, recipe.pictures - start))]
        refs = [encode21.prepare_references([p], area) for p in pictures]
        ref_tokens = encode21.pack(encode.encode_latents(vae, torch.cat([r.pixels[0] for r in refs])))
        for prompt, function in zip(prompts, functions):
            targets = ref_tokens if function is synthetic.keep else \
                encode21.pack(encode.encode_latents(vae, _pixels([function(p) for p in pictures])))
            for i, ref in enumerate(refs):
                tokens, images = ref_tokens[i], ref.images
                extra = _distractors(extra_rng, pictures[i], recipe.extra_references, recipe.size)
                if extra:
                    more = encode21.prepare_references(extra, area)
                    tokens = torch.cat([tokens, *(encode21.pack(encode.encode_latents(vae, px))[0]
                                                  for px in more.pixels)])
                    images = [*images, *more.images]
                text = encode21.encode_prompt(text_encoder, processor, prompt, images, device=torch.device("cpu"),
                                              drop=drop)
                items.append({"reference": tokens, "target": targets[i], "embeds": text.embeds[0],
                              "slots": text.slots[0], "references": len(images)})
    return items


def batch(picked: list[dict], side: int, generators: list):
    """A `TrainBatch21` of dataset items (their references in their slots, the target last), as `batch.collate`
    builds one."""
    from qwen_edit_core.families.qwen_image_21.batch import TrainBatch21

    shapes = [[(1, side, side)] * (it["references"] + 1) for it in picked]
    slots = [torch.cat([it["slots"], torch.ones(it["target"].shape[0] // encode21.TOKENS_PER_SLOT, dtype=torch.bool)])
             for it in picked]
    layouts = [(tuple(s), mask.shape[0], bytes(mask.to(torch.uint8).numpy())) for s, mask in zip(shapes, slots)]
    return TrainBatch21(targets=[it["target"] for it in picked], references=[it["reference"] for it in picked],
                        embeds=[it["embeds"] for it in picked], slots=slots, img_shapes=shapes,
                        generators=generators, loss_masks=[None] * len(picked), layouts=layouts)
