"""Build the toy model's weights (`qwen-edit tiny --pretrained --train`): a VAE, then a transformer.

1. The VAE (AutoencoderKLQwenImage: 8 base channels, 16 latent channels, 8x downscale) starts from
   constructed weights (`constructed_vae`): its encoder averages 4x4-pixel squares into the latent channels,
   its decoder upsamples the cell colours smoothly. The encoder is kept as constructed (`latents_mean`/
   `latents_std` are its latents' measured per-channel statistics, so normalized latents have unit scale as
   the flow-matching maths assumes); the decoder's residual branches are then trained by gradient descent
   on synthetic pictures (`train_vae_decoder`), starting at the constructed output. (Training the whole
   architecture from random weights barely moved in the CPU time available: 300 Adam steps, pixel MSE
   0.17 -> 0.15 in [-1, 1] units.)
2. The transformer (QwenImageTransformer2DModel: 2 blocks, 2 heads of 32) learns the edits of
   `synthetic.EDITS` from (control, prompt) -> target pairs in that VAE's latent space with the trainer's own
   flow-matching loss (train/batch.py `flow_loss`: the sampler's shifted timesteps, per-sample generators).
   Prompts are embedded by the random tiny text encoder of `build_tiny(seed=0)`, which is kept as it is:
   the transformer learns to tell its embeddings of the few fixed prompts apart. The samplers' default
   negative prompt " " is trained as "keep the image".
3. The VAE decoder is trained last (the transformer only sees the encoder's latents, so it does not depend
   on the decoder); `qwen-edit tiny --pretrained --train-vae` reruns this step alone.

Deterministic for its seed: every draw comes from seeded generators and the intra-op thread count is fixed
to one for the build (float sums then do not depend on the machine's core count).
"""

from __future__ import annotations

import json
import logging
import math
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

from qwen_edit_core.data import synthetic
from qwen_edit_core.model import encode, toy, variants
from qwen_edit_core.model.tiny import _isolated_init, build_tiny, transformer_config

log = logging.getLogger(__name__)

VAE_CONFIG = dict(base_dim=8, z_dim=16, dim_mult=[1, 2, 4, 4], num_res_blocks=1, attn_scales=[],
                  temperal_downsample=[False, True, True], dropout=0.0)
#: The keep-the-image prompt's stand-in for an empty prompt (the samplers' default negative prompt).
NEGATIVE = " "
#: the constructed VAE's constant channel (large, so the RMS norms divide by it alone)
CONST = 1000.0


#: the 2x2 sub-positions a latent cell's 12 colour channels hold (4 px squares of an 8 px cell)
_SUBCELLS = ((0, 0), (0, 1), (1, 0), (1, 1))


def _zero_residuals(vae) -> None:
    """Residual branches and attention outputs to zero: every residual block and attention block is the
    identity (plus its 1x1 shortcut), so the VAE starts as the linear path set below."""
    for name, param in vae.named_parameters():
        if name.endswith(("conv2.weight", "conv2.bias", "proj.weight", "proj.bias")) or ".conv_shortcut." in name:
            param.zero_()


def _copy_shortcuts(vae, channels: int = 4) -> None:
    for name, module in vae.named_modules():
        if name.endswith("conv_shortcut") and hasattr(module, "weight"):
            for c in range(channels):
                module.weight[c, c, 0, 0, 0] = 1.0


def _head_gain(dim: int) -> float:
    """conv_out's gain after RMS_norm(dim) and SiLU: the norm scales by sqrt(dim)/|f| (|f| ~ CONST, the
    constant channel) and SiLU(u) ~ u/2 near 0."""
    return 2 * CONST / dim ** 0.5


@torch.no_grad()
def constructed_vae(config: dict):
    """An AutoencoderKLQwenImage whose weights compute, exactly up to SiLU's curvature (< 0.3 % here):

    - encoder: RGB and a constant channel (CONST) through 2x2 averages at the first two downsamples, a
      2x2 space-to-depth at the third, so latent channels 0-11 are the mean colours of the four 4x4-pixel
      squares of each 8x8-pixel cell (12-15 stay 0);
    - decoder: the cell's mean colour, upsampled three times (nearest, then a [1 2 1] tent filter per axis;
      the constant channel is filtered alike, and the final RMS norm divides by it, so borders are a
      normalized convolution): a smooth 8x-upsampled picture.
    Training (`train_vae`) starts from here.
    """
    from diffusers import AutoencoderKLQwenImage

    vae = AutoencoderKLQwenImage(**config)
    for param in vae.parameters():
        param.zero_()
    for name, param in vae.named_parameters():
        if name.endswith("gamma"):
            param.fill_(1.0)
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
    gain = _head_gain(enc.conv_out.weight.shape[1])
    for c in range(12):
        enc.conv_out.weight[c, c, 2, 1, 1] = gain
    vae.quant_conv.weight[:16, :16, 0, 0, 0] = torch.eye(16)
    vae.quant_conv.bias[16:] = -10.0  # log-variance: the posterior is (almost) its mode
    vae.post_quant_conv.weight[:, :, 0, 0, 0] = torch.eye(16)
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
    gain = _head_gain(dec.conv_out.weight.shape[1])
    for c in range(3):
        dec.conv_out.weight[c, c, 2, 1, 1] = gain
    return vae


@dataclass(frozen=True)
class Recipe:
    """Everything the weights depend on (with the code)."""

    seed: int = 0
    size: int = 128
    pictures: int = 192
    transformer_steps: int = 1500
    transformer_batch: int = 16
    transformer_lr: float = 2e-3
    heads: int = 2
    head_dim: int = 32
    layers: int = 2
    vae_steps: int = 300
    vae_batch: int = 4
    vae_lr: float = 5e-4


def transformer_settings(recipe: Recipe) -> dict:
    """The toy transformer's config: the tiny one with `recipe.heads` heads of `recipe.head_dim` and
    `recipe.layers` blocks. The rotary split keeps Qwen-Image's 1/4 : 3/8 : 3/8 (frames, rows, columns): with
    32-wide heads each image axis gets 6 frequencies, enough to tell all 8 token rows of a 128 px picture
    apart (16-wide heads have one usable frequency per axis, which repeats every 6 tokens)."""
    time = recipe.head_dim // 4
    space = (recipe.head_dim - time) // 2
    return {**transformer_config("tiny", num_layers=recipe.layers), "num_attention_heads": recipe.heads,
            "attention_head_dim": recipe.head_dim, "axes_dims_rope": (time, space, recipe.head_dim - time - space)}


def _cosine(step: int, total: int, warmup: int = 20) -> float:
    if step < warmup:
        return (step + 1) / warmup
    return 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, total - warmup)))


def _pixels(images) -> torch.Tensor:
    """PIL images -> (B, 3, 1, H, W) in [-1, 1] (the pipelines' VAE input)."""
    return torch.cat([encode.pixels_for_vae(img, img.width, img.height) for img in images])


def _stats_batch(rng: np.random.Generator, size: int, n: int = 8):
    """Synthetic pictures under every edit (the demo's too)."""
    edits = [*synthetic.EDITS.values(), synthetic.DEMO_EDIT[1]]
    return [edits[int(rng.integers(0, len(edits)))](synthetic.picture(rng, size)) for _ in range(n)]


@torch.no_grad()
def make_vae(recipe: Recipe):
    """The constructed VAE with `latents_mean`/`latents_std` set to its latents' per-channel statistics over
    64 synthetic pictures (the always-zero channels 12-15 keep mean 0 and std 1)."""
    vae = constructed_vae(VAE_CONFIG).eval()
    rng = np.random.default_rng(recipe.seed + 1)
    z = torch.cat([vae.encode(_pixels(_stats_batch(rng, recipe.size))).latent_dist.mode() for _ in range(8)])
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


def train_vae_decoder(recipe: Recipe, vae):
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
            group["lr"] = recipe.vae_lr * _cosine(step, recipe.vae_steps)
        pixels = _pixels([synthetic.picture(rng, recipe.size) for _ in range(recipe.vae_batch)])
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
def edit_dataset(recipe: Recipe, vae, text_encoder, processor) -> list[dict]:
    """Per (control picture, prompt): packed control and target tokens (16, 64) and the prompt's embeddings."""
    rng = np.random.default_rng(recipe.seed + 2)
    prompts = [*synthetic.EDITS, NEGATIVE]
    functions = [*synthetic.EDITS.values(), synthetic.keep]
    items = []
    for start in range(0, recipe.pictures, 32):
        controls = [synthetic.picture(rng, recipe.size) for _ in range(min(32, recipe.pictures - start))]
        control_tokens = encode.pack(encode.encode_latents(vae, _pixels(controls)))
        for prompt, function in zip(prompts, functions):
            target_tokens = control_tokens if function is synthetic.keep else \
                encode.pack(encode.encode_latents(vae, _pixels([function(c) for c in controls])))
            embeds = encode.encode_prompts(text_encoder, processor, [prompt] * len(controls),
                                           [[c] for c in controls], variants.EDIT.name, device=torch.device("cpu"))
            items += [{"control": control_tokens[i], "target": target_tokens[i], "embeds": embeds[i]}
                      for i in range(len(controls))]
    return items


def train_transformer(recipe: Recipe, items: list[dict], scheduler_config: dict):
    """The toy transformer trained on `items` with the trainer's flow-matching loss."""
    from diffusers import QwenImageTransformer2DModel

    from qwen_edit_core.adapters import multires
    from qwen_edit_core.config import load_config
    from qwen_edit_core.train.batch import TrainBatch, flow_loss, sample_generator

    with _isolated_init(recipe.seed):
        transformer = QwenImageTransformer2DModel(**transformer_settings(recipe))
    multires.install(transformer)
    config = load_config()
    opt = torch.optim.AdamW(transformer.parameters(), lr=recipe.transformer_lr, weight_decay=0.0)
    order = torch.Generator().manual_seed(recipe.seed + 3)
    side = recipe.size // encode.LATENT_MULTIPLE
    started = time.perf_counter()
    for step in range(recipe.transformer_steps):
        for group in opt.param_groups:
            group["lr"] = recipe.transformer_lr * _cosine(step, recipe.transformer_steps)
        picked = [items[i] for i in torch.randint(len(items), (recipe.transformer_batch,), generator=order)]
        batch = TrainBatch(targets=[it["target"] for it in picked], controls=[it["control"] for it in picked],
                           embeds=encode.pad_embeddings([it["embeds"] for it in picked]),
                           img_shapes=[[(1, side, side), (1, side, side)]] * len(picked),
                           generators=[sample_generator(recipe.seed, step, 0, i) for i in range(len(picked))])
        loss, _ = flow_loss(transformer, batch, config, scheduler_config)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(transformer.parameters(), 1.0)
        opt.step()
        if step % 100 == 0 or step == recipe.transformer_steps - 1:
            log.info("transformer step %d/%d: loss %.4f (%.0f s)", step + 1, recipe.transformer_steps, loss.item(),
                     time.perf_counter() - started)
    return transformer


def _save(weights_dir: Path, info: dict, modules: dict) -> None:
    """Write each module's `<name>.safetensors` with its sha256 into `info`, then `toy.json`."""
    from safetensors.torch import save_file

    weights_dir.mkdir(parents=True, exist_ok=True)
    for name, module in modules.items():
        state = {k: v.detach().contiguous() for k, v in module.state_dict().items()}
        save_file(state, str(weights_dir / f"{name}.safetensors"), metadata={"format": "pt"})
        info["sha256"][f"{name}.safetensors"] = toy.sha256(weights_dir / f"{name}.safetensors")
    (weights_dir / toy.MANIFEST).write_text(json.dumps(info, indent=1) + "\n")


def _manifest(recipe: Recipe, vae) -> dict:
    command = "qwen-edit tiny --pretrained --train --weights-dir WEIGHTS_DIR OUT_DIR"
    return {"command": command + ("" if recipe.seed == 0 else f" --seed {recipe.seed}"),
            "seed": recipe.seed, "recipe": asdict(recipe), "text_encoder_seed": 0, "edits": list(synthetic.EDITS),
            "vae_config": {**VAE_CONFIG, "latents_mean": vae.config.latents_mean,
                           "latents_std": vae.config.latents_std},
            "transformer_config": transformer_settings(recipe), "sha256": {}}


def pretrain(weights_dir: Path, recipe: Recipe = Recipe()) -> dict:
    """Train both components and write `vae.safetensors`, `transformer.safetensors` and `toy.json` to
    `weights_dir`; returns the manifest. The decoder is trained last, so the transformer's data (the
    encoder's latents) and its random draws do not depend on it."""
    from transformers import AutoProcessor, Qwen2_5_VLForConditionalGeneration

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    started = time.perf_counter()
    try:
        with tempfile.TemporaryDirectory() as tmp:
            tiny = build_tiny(Path(tmp) / "tiny", variant=variants.EDIT.name, seed=0)
            text_encoder = Qwen2_5_VLForConditionalGeneration.from_pretrained(tiny / "text_encoder").eval()
            processor = AutoProcessor.from_pretrained(tiny / "processor")
            scheduler_config = json.loads((tiny / "scheduler" / "scheduler_config.json").read_text())
            with torch.random.fork_rng(devices=[]):
                vae = make_vae(recipe)
                items = edit_dataset(recipe, vae, text_encoder, processor)
                transformer = train_transformer(recipe, items, scheduler_config)
                train_vae_decoder(recipe, vae)
    finally:
        torch.set_num_threads(threads)
    info = _manifest(recipe, vae)
    _save(Path(weights_dir), info, {"vae": vae, "transformer": transformer})
    log.info("toy weights written to %s in %.0f s", weights_dir, time.perf_counter() - started)
    return info


def pretrain_vae(weights_dir: Path, recipe: Recipe = Recipe()) -> dict:
    """Rebuild only `vae.safetensors` (constructed encoder, trained decoder) in `weights_dir`, keeping its
    `transformer.safetensors`: the encoder and latent statistics do not depend on the decoder's training,
    so the transformer stays valid. Updates `toy.json`; returns it."""
    info = toy.manifest(weights_dir)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    started = time.perf_counter()
    try:
        with torch.random.fork_rng(devices=[]):
            vae = train_vae_decoder(recipe, make_vae(recipe))
    finally:
        torch.set_num_threads(threads)
    fresh = _manifest(recipe, vae)
    if fresh["vae_config"] != info["vae_config"]:
        raise ValueError(f"{Path(weights_dir) / toy.MANIFEST}: the VAE's latent statistics changed; the "
                         f"transformer must be retrained with `{fresh['command']}`")
    info.update(recipe=fresh["recipe"])
    _save(Path(weights_dir), info, {"vae": vae})
    log.info("toy VAE written to %s in %.0f s", weights_dir, time.perf_counter() - started)
    return info
