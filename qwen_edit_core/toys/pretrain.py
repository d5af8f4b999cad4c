"""Build a toy model's weights (`qwen-edit tiny [--variant V] --pretrained --train`, V a family's `Toy.variant`): a
VAE, then a transformer. One build for both families: `Recipe.variant` picks the family's pieces (the 2025 toy's
constructed VAE in families/qwen_image/pretrain.py; the Qwen-Image-2.1 toy's VAE, transformer settings and
reference-1 batches in families/qwen_image_21/pretrain.py); the data, the flow-matching loop, the seeds and the
manifest are this module's. The steps below are the 2025 toy's; families/qwen_image_21/pretrain.py describes the
2.1 toy's.

1. The VAE (the family's `vae_class`: 8 base channels, 16 latent channels, 8x downscale) starts from constructed weights
   (families/qwen_image/pretrain.py `constructed_vae`): its encoder averages 4x4-pixel squares into the latent channels,
   its decoder upsamples the cell colours smoothly. The encoder is kept as constructed (`latents_mean`/`latents_std`
   are its latents' measured per-channel statistics, so normalized latents have unit scale as the flow-matching maths
   assumes); the decoder's residual branches are then trained by gradient descent on synthetic pictures
   (`train_vae_decoder`), starting at the constructed output. (Training the whole architecture from random weights
   barely moved in the CPU time available: 300 Adam steps, pixel MSE 0.17 -> 0.15 in [-1, 1] units.)
2. The transformer (the family's `transformer_class`: 2 blocks, 2 heads of 32) learns the edits of
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

import dataclasses
import json
import logging
import math
import tempfile
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from qwen_edit_core.data import synthetic
from qwen_edit_core.families import variants
from qwen_edit_core.model import encode
from qwen_edit_core.model.tiny import _isolated_init, build_tiny
from qwen_edit_core.toys import toy

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
    #: the variant of the toy's family (`Toy.variant`); the family's pretrain
    #: stage module supplies its VAE, transformer settings, data and batches
    variant: str = variants.DEFAULT
    #: the share of pairs with one or two more references after the edited picture, for a family that takes several
    #: (families/qwen_image_21/pretrain.py `_distractors`; the 2025 family refuses it)
    extra_references: float = 0.0
    #: the 2.1 toy's VAE: latent channels after the colours that hold a constant, and the colour channels' basis
    #: (families/qwen_image_21/pretrain.py `constructed_vae`; the 2025 family refuses other values)
    constant_latents: int = 0
    latent_basis: str = "squares"
    #: a second phase for a family that takes several references (`train_references`): this many more steps from
    #: the first phase's transformer, at `reference_lr`, on the pairs drawn again with `reference_share` of them
    #: given one or two more references after the edited picture
    reference_steps: int = 0
    reference_share: float = 0.5
    reference_lr: float = 1e-3

    @property
    def family(self):
        """The family whose toy this recipe builds."""
        return variants.get(self.variant).family


def recipe_for(variant: str, seed: int = 0) -> Recipe:
    """The shipped recipe of `variant`'s toy. The 2.1 toy's single-stream transformer shares its projections
    between text and image tokens and copied reference 1 poorly at the 2025 toy's 2 blocks and 1500 steps (held-out
    "keep" 17-21 dB, "move the shapes left" not learned; 2 blocks, 3000 steps: 20-24 dB): it has 3 blocks and
    trains 3000 steps at lr 3e-3."""
    return Recipe(seed=seed, variant=variant, **variants.get(variant).family.stage("pretrain").RECIPE)


def cosine(step: int, total: int, warmup: int = 20) -> float:
    """The learning-rate factor at `step` of `total`: linear warm-up over `warmup` steps, then cosine decay."""
    if step < warmup:
        return (step + 1) / warmup
    return 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, total - warmup)))


def vae_input(images) -> torch.Tensor:
    """PIL images -> (B, 3, 1, H, W) in [-1, 1] (the pipelines' VAE input)."""
    return torch.cat([encode.pixels_for_vae(img, img.width, img.height) for img in images])


def _stage(recipe: Recipe):
    """The toy's family's pretrain stage module (families/<family>/pretrain.py): VAE_CONFIG, RECIPE, make_vae,
    train_vae_decoder (a family whose `Toy.vae_trains_alone`), transformer_settings, edit_dataset, batch."""
    return recipe.family.stage("pretrain")


@torch.no_grad()
def _dataset(recipe: Recipe, vae, text_encoder, processor) -> list[dict]:
    """The family's (control or reference, prompt) -> target items: the three edits and " " as keep."""
    return _stage(recipe).edit_dataset(recipe, vae, text_encoder, processor, [*synthetic.EDITS, NEGATIVE],
                                       [*synthetic.EDITS.values(), synthetic.keep])


def _new_transformer(recipe: Recipe):
    """The family's transformer class with the toy settings, seeded (with the joint attention processor of
    padded batches where the family trains them, as the trainer installs it)."""
    from qwen_edit_core.adapters import multires

    with _isolated_init(recipe.seed):
        transformer = recipe.family.class_of("transformer")(**_stage(recipe).transformer_settings(recipe))
    if recipe.family.padded_batches:
        multires.install(transformer)
    return transformer


def _batch(recipe: Recipe, picked: list[dict], generators: list):
    """One training batch of dataset items in the family's layout."""
    return _stage(recipe).batch(picked, recipe.size // recipe.family.token_pixels, generators)


def train_transformer(recipe: Recipe, items: list[dict], scheduler_config: dict):
    """The toy transformer trained on `items` with the trainer's flow-matching loss."""
    transformer = _new_transformer(recipe)
    return _fit(recipe, transformer, items, scheduler_config, recipe.transformer_steps, recipe.transformer_lr,
                seed=recipe.seed, order_seed=recipe.seed + 3)


def train_references(recipe: Recipe, transformer, vae, text_encoder, processor, scheduler_config: dict):
    """The second phase (`recipe.reference_steps`): `transformer` trained on, with a fresh optimizer and schedule,
    the pairs drawn again with `recipe.reference_share` of them given more references after the edited one. The
    first phase only ever shows one reference, and the transformer then mixes every reference's tokens at the
    same spatial position (the rotary grid is the same for each image), so the 2.1 sample workflow's reference 2,
    the colour inversion of reference 1, cancels it to grey (BENCHMARKS.md, "Toy model builds"). A family whose toy takes one control refuses the
    extra references (its `edit_dataset`)."""
    shared = _dataset(dataclasses.replace(recipe, extra_references=recipe.reference_share), vae, text_encoder,
                      processor)
    return _fit(recipe, transformer, shared, scheduler_config, recipe.reference_steps, recipe.reference_lr,
                seed=recipe.seed + 1, order_seed=recipe.seed + 7)


def _fit(recipe: Recipe, transformer, items: list[dict], scheduler_config: dict, steps: int, lr: float, *,
         seed: int, order_seed: int):
    """`steps` AdamW steps (cosine schedule from `lr`, clipped gradients) of `recipe.transformer_batch` items drawn
    from `order_seed`, with per-sample noise from `seed`; returns `transformer`."""
    from qwen_edit_core.config import load_config
    from qwen_edit_core.train.batch import flow_loss, sample_generator

    config = load_config()
    opt = torch.optim.AdamW(transformer.parameters(), lr=lr, weight_decay=0.0)
    order = torch.Generator().manual_seed(order_seed)
    started = time.perf_counter()
    for step in range(steps):
        for group in opt.param_groups:
            group["lr"] = lr * cosine(step, steps)
        picked = [items[i] for i in torch.randint(len(items), (recipe.transformer_batch,), generator=order)]
        batch = _batch(recipe, picked, [sample_generator(seed, step, 0, i) for i in range(len(picked))])
        loss, _ = flow_loss(transformer, batch, config, scheduler_config)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(transformer.parameters(), 1.0)
        opt.step()
        if step % 100 == 0 or step == steps - 1:
            log.info("transformer step %d/%d: loss %.4f (%.0f s)", step + 1, steps, loss.item(),
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
    variant = f" --variant {recipe.variant}" if recipe.variant != variants.DEFAULT else ""
    command = f"qwen-edit tiny{variant} --pretrained --train --weights-dir WEIGHTS_DIR OUT_DIR"
    return {"command": command + ("" if recipe.seed == 0 else f" --seed {recipe.seed}"), "variant": recipe.variant,
            "seed": recipe.seed, "recipe": asdict(recipe), "text_encoder_seed": 0, "edits": list(synthetic.EDITS),
            "vae_config": {**_stage(recipe).VAE_CONFIG,
                           "latents_mean": vae.config.latents_mean, "latents_std": vae.config.latents_std},
            "transformer_config": _stage(recipe).transformer_settings(recipe), "sha256": {}}


@contextmanager
def _one_thread():
    """Every build runs on one thread (its numbers do not depend on the machine's core count), restored after."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


@contextmanager
def _encoders(recipe: Recipe):
    """The tiny text encoder, processor and scheduler config the recipe's family builds (seed 0), while the body
    runs (they live in a temporary folder)."""
    from transformers import AutoProcessor

    with tempfile.TemporaryDirectory() as tmp:
        tiny = build_tiny(Path(tmp) / "tiny", variant=recipe.variant, seed=0)
        text_encoder = recipe.family.class_of("text_encoder").from_pretrained(tiny / "text_encoder").eval()
        processor = AutoProcessor.from_pretrained(tiny / "processor")
        yield text_encoder, processor, json.loads((tiny / "scheduler" / "scheduler_config.json").read_text())


def pretrain(weights_dir: Path, recipe: Recipe = Recipe()) -> dict:
    """Train both components and write `vae.safetensors`, `transformer.safetensors` and `toy.json` to
    `weights_dir`; returns the manifest. The decoder is trained last, so the transformer's data (the
    encoder's latents) and its random draws do not depend on it."""
    started = time.perf_counter()
    with _one_thread(), _encoders(recipe) as (text_encoder, processor, scheduler_config):
        with torch.random.fork_rng(devices=[]):
            vae = _stage(recipe).make_vae(recipe)
            items = _dataset(recipe, vae, text_encoder, processor)
            transformer = train_transformer(recipe, items, scheduler_config)
            if recipe.reference_steps:
                transformer = train_references(recipe, transformer, vae, text_encoder, processor, scheduler_config)
            if recipe.family.toy.vae_trains_alone:
                _stage(recipe).train_vae_decoder(recipe, vae)
    info = _manifest(recipe, vae)
    _save(Path(weights_dir), info, {"vae": vae, "transformer": transformer})
    log.info("toy weights written to %s in %.0f s", weights_dir, time.perf_counter() - started)
    return info


def pretrain_vae(weights_dir: Path, recipe: Recipe = Recipe()) -> dict:
    """Rebuild only `vae.safetensors` (constructed encoder, trained decoder) in `weights_dir`, keeping its
    `transformer.safetensors`: the encoder and latent statistics do not depend on the decoder's training,
    so the transformer stays valid. Updates `toy.json`; returns it."""
    info = toy.manifest(weights_dir)
    started = time.perf_counter()
    with _one_thread(), torch.random.fork_rng(devices=[]):
        vae = _stage(recipe).train_vae_decoder(recipe, _stage(recipe).make_vae(recipe))
    fresh = _manifest(recipe, vae)
    if fresh["vae_config"] != info["vae_config"]:
        raise ValueError(f"{Path(weights_dir) / toy.MANIFEST}: the VAE's latent statistics changed; the "
                         f"transformer must be retrained with `{fresh['command']}`")
    info.update(recipe=fresh["recipe"])
    _save(Path(weights_dir), info, {"vae": vae})
    log.info("toy VAE written to %s in %.0f s", weights_dir, time.perf_counter() - started)
    return info


def pretrain_references(weights_dir: Path, recipe: Recipe) -> dict:
    """Run only the second phase of `recipe` (`train_references`) on the transformer in `weights_dir`, which must be
    the first phase's: built by the same recipe with `reference_steps` 0 (its manifest says so). The VAE is the
    one in `weights_dir` (`make_vae`'s, as its sha256 says), so the whole build from scratch writes the same
    files. Updates `transformer.safetensors` and `toy.json`; returns the manifest."""
    from safetensors.torch import load_file

    info = toy.check_weights(weights_dir)
    first = asdict(dataclasses.replace(recipe, reference_steps=0))
    if {**first, **info["recipe"]} != first:
        raise ValueError(f"{Path(weights_dir) / toy.MANIFEST}: built by the recipe {info['recipe']}, not the first "
                         f"phase of {asdict(recipe)}; run the whole build with `{info['command']}`")
    started = time.perf_counter()
    with _one_thread(), _encoders(recipe) as (text_encoder, processor, scheduler_config):
        with torch.random.fork_rng(devices=[]):
            with _isolated_init(recipe.seed):
                vae = recipe.family.class_of("vae")(**info["vae_config"]).eval()
            vae.load_state_dict(load_file(str(Path(weights_dir) / "vae.safetensors")))
            transformer = _new_transformer(recipe)
            transformer.load_state_dict(load_file(str(Path(weights_dir) / "transformer.safetensors")))
            transformer = train_references(recipe, transformer, vae, text_encoder, processor, scheduler_config)
    fresh = {**_manifest(recipe, vae), "sha256": dict(info["sha256"])}
    _save(Path(weights_dir), fresh, {"transformer": transformer})
    log.info("toy transformer's second phase written to %s in %.0f s", weights_dir, time.perf_counter() - started)
    return fresh
