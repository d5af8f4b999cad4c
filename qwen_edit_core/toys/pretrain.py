"""Build a toy model's weights (`qwen-edit tiny [--variant image-2.1] --pretrained --train`): a VAE, then a
transformer. One build for both families: `Recipe.variant` picks the family's pieces (the 2025 toy's constructed
VAE in families/qwen_image/pretrain.py; the Qwen-Image-2.1 toy's VAE, transformer settings and reference-1 batches in
families/qwen_image_21/pretrain.py); the data, the flow-matching loop, the seeds and the manifest are this module's. The steps below are
the 2025 toy's; families/qwen_image_21/pretrain.py describes the 2.1 toy's.

1. The VAE (AutoencoderKLQwenImage: 8 base channels, 16 latent channels, 8x downscale) starts from
   constructed weights (`pretrain25.constructed_vae`): its encoder averages 4x4-pixel squares into the latent channels,
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
from qwen_edit_core.families.qwen_image_21 import pretrain as pretrain21
from qwen_edit_core.families.qwen_image.pretrain import VAE_CONFIG, constructed_vae
from qwen_edit_core.toys.vae import CONST
from qwen_edit_core.model import encode, variants
from qwen_edit_core.toys import toy
from qwen_edit_core.model.tiny import _isolated_init, build_tiny, transformer_config

log = logging.getLogger(__name__)

#: The keep-the-image prompt's stand-in for an empty prompt (the samplers' default negative prompt).
NEGATIVE = " "
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
    #: the family's variant: "edit" (the 2025 toy) or "image-2.1" (families/qwen_image_21/pretrain.py's VAE and batches)
    variant: str = variants.EDIT.name
    #: 2.1 only: the share of pairs with one or two more references after the edited picture
    #: (families/qwen_image_21/pretrain.py `_distractors`)
    extra_references: float = 0.0

    def __post_init__(self):
        if self.extra_references and not self.is_21:
            raise ValueError(f"Recipe(extra_references={self.extra_references}) is for variant "
                             f"{variants.IMAGE_21.name!r} (the 2025 toy takes one control), got variant {self.variant!r}")

    @property
    def is_21(self) -> bool:
        return self.variant == variants.IMAGE_21.name


def recipe_for(variant: str, seed: int = 0) -> Recipe:
    """The shipped recipe of `variant`'s toy. The 2.1 toy's single-stream transformer shares its projections
    between text and image tokens and copied reference 1 poorly at the 2025 toy's 2 blocks and 1500 steps (held-out
    "keep" 17-21 dB, "move the shapes left" not learned; 2 blocks, 3000 steps: 20-24 dB): it has 3 blocks and
    trains 3000 steps at lr 3e-3."""
    if variant == variants.IMAGE_21.name:
        return Recipe(seed=seed, variant=variant, transformer_steps=3000, transformer_lr=3e-3, layers=3)
    return Recipe(seed=seed, variant=variant)


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
def _dataset(recipe: Recipe, vae, text_encoder, processor) -> list[dict]:
    """The family's (control or reference, prompt) -> target items: the three edits and " " as keep."""
    if recipe.is_21:
        return pretrain21.edit_dataset(recipe, vae, text_encoder, processor, [*synthetic.EDITS, NEGATIVE],
                                       [*synthetic.EDITS.values(), synthetic.keep])
    return edit_dataset(recipe, vae, text_encoder, processor)


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


def _new_transformer(recipe: Recipe):
    """The family's transformer class with the toy settings, seeded."""
    from qwen_edit_core.adapters import multires
    from qwen_edit_core.families import QWEN_IMAGE, QWEN_IMAGE_21

    family = QWEN_IMAGE_21 if recipe.is_21 else QWEN_IMAGE
    with _isolated_init(recipe.seed):
        transformer = family.class_of("transformer")(**_settings(recipe))
    if not recipe.is_21:
        multires.install(transformer)
    return transformer


def _settings(recipe: Recipe) -> dict:
    return pretrain21.transformer_settings(recipe) if recipe.is_21 else transformer_settings(recipe)


def _batch(recipe: Recipe, picked: list[dict], generators: list):
    """One training batch of dataset items in the family's layout."""
    from qwen_edit_core.train.batch import TrainBatch

    side = recipe.size // (pretrain21.PATCH if recipe.is_21 else encode.LATENT_MULTIPLE)
    if recipe.is_21:
        return pretrain21.batch(picked, side, generators)
    return TrainBatch(targets=[it["target"] for it in picked], controls=[it["control"] for it in picked],
                      embeds=encode.pad_embeddings([it["embeds"] for it in picked]),
                      img_shapes=[[(1, side, side), (1, side, side)]] * len(picked), generators=generators)


def train_transformer(recipe: Recipe, items: list[dict], scheduler_config: dict):
    """The toy transformer trained on `items` with the trainer's flow-matching loss."""
    from qwen_edit_core.config import load_config
    from qwen_edit_core.train.batch import flow_loss, sample_generator

    transformer = _new_transformer(recipe)
    config = load_config()
    opt = torch.optim.AdamW(transformer.parameters(), lr=recipe.transformer_lr, weight_decay=0.0)
    order = torch.Generator().manual_seed(recipe.seed + 3)
    started = time.perf_counter()
    for step in range(recipe.transformer_steps):
        for group in opt.param_groups:
            group["lr"] = recipe.transformer_lr * _cosine(step, recipe.transformer_steps)
        picked = [items[i] for i in torch.randint(len(items), (recipe.transformer_batch,), generator=order)]
        batch = _batch(recipe, picked, [sample_generator(recipe.seed, step, 0, i) for i in range(len(picked))])
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
    variant = f" --variant {recipe.variant}" if recipe.is_21 else ""
    command = f"qwen-edit tiny{variant} --pretrained --train --weights-dir WEIGHTS_DIR OUT_DIR"
    return {"command": command + ("" if recipe.seed == 0 else f" --seed {recipe.seed}"), "variant": recipe.variant,
            "seed": recipe.seed, "recipe": asdict(recipe), "text_encoder_seed": 0, "edits": list(synthetic.EDITS),
            "vae_config": {**(pretrain21.VAE_CONFIG if recipe.is_21 else VAE_CONFIG),
                           "latents_mean": vae.config.latents_mean, "latents_std": vae.config.latents_std},
            "transformer_config": _settings(recipe), "sha256": {}}


def pretrain(weights_dir: Path, recipe: Recipe = Recipe()) -> dict:
    """Train both components and write `vae.safetensors`, `transformer.safetensors` and `toy.json` to
    `weights_dir`; returns the manifest. The decoder is trained last, so the transformer's data (the
    encoder's latents) and its random draws do not depend on it."""
    from transformers import AutoProcessor

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    started = time.perf_counter()
    try:
        with tempfile.TemporaryDirectory() as tmp:
            tiny = build_tiny(Path(tmp) / "tiny", variant=recipe.variant, seed=0)
            family = variants.get(recipe.variant).family
            text_encoder = family.class_of("text_encoder").from_pretrained(tiny / "text_encoder").eval()
            processor = AutoProcessor.from_pretrained(tiny / "processor")
            scheduler_config = json.loads((tiny / "scheduler" / "scheduler_config.json").read_text())
            with torch.random.fork_rng(devices=[]):
                vae = pretrain21.make_vae(recipe.seed, recipe.size) if recipe.is_21 else make_vae(recipe)
                items = _dataset(recipe, vae, text_encoder, processor)
                transformer = train_transformer(recipe, items, scheduler_config)
                if not recipe.is_21:
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
