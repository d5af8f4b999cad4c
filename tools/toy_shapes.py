"""How well a toy Qwen-Image-2.1 keeps shapes: builds the toy's weights with a recipe (or takes built ones) and prints
the 2025 demo's edge similarity (`demo.edge_similarity`) and the luminance correlation (`demo.luminance_correlation`)
of each pretrained edit to its target, [edge, luminance] per held-out picture of tests/toys (seed 12345, 128 px, 20
steps, CFG 1): with the picture as the one reference, and for "make it grayscale" also with its inverse as
reference 2 (the 2.1 sample workflow's references). One JSON line.

    PYTHONPATH=. OMP_NUM_THREADS=1 .venv/bin/python tools/toy_shapes.py OUT --steps 600 --constant-latents 16
    PYTHONPATH=. .venv/bin/python tools/toy_shapes.py OUT --weights qwen_edit_core/toys/weights/qwen-image-2.1

The recipe starts from the shipped one (`toys.pretrain.recipe_for`); `cpu_s` is the build's CPU time.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path

import numpy as np
import torch
from PIL import ImageOps

from qwen_edit_core.data import synthetic
from qwen_edit_core.toys import toy
from qwen_edit_core.toys.pretrain import pretrain, recipe_for

VARIANT = "image-2.1"


def _sample(components, prompt: str, references, settings) -> np.ndarray:
    """The 2.1 sampler's RGB picture in [0, 1] for `references` (reference 1 first)."""
    from qwen_edit_core.families.qwen_image_21 import sampler as sampler21

    cond = sampler21.build_conditioning(components, prompt, references, settings)
    latents = sampler21.denoise(components, cond, settings)
    return sampler21.decode(components, latents, cond.width, cond.height)[0][..., :3].numpy()


def scores(model_dir: Path, pictures: int = 3) -> dict:
    """{case: [[edge similarity, luminance correlation] per held-out picture]} for every pretrained edit with one
    reference and "make it grayscale" with two."""
    from qwen_edit_core.api import QwenImageEditTrainer
    from qwen_edit_core.config import load_config
    from qwen_edit_core.demo import edge_similarity, luminance_correlation
    from qwen_edit_core.sample import sampler

    trainer = QwenImageEditTrainer(load_config(overrides={"model": {"pretrained_model_name_or_path": str(model_dir)}}))
    trainer.load_model()
    settings = sampler.SampleSettings(num_inference_steps=20, true_cfg_scale=1.0, negative_prompt=None, seed=0,
                                      vae_area=128 * 128)
    rng = np.random.default_rng(12345)  # the builds draw from seeds 0-4
    held_out = [synthetic.picture(rng, 128) for _ in range(pictures)]
    cases = [(prompt, 1) for prompt in synthetic.EDITS] + [("make it grayscale", 2)]
    result = {}
    for prompt, count in cases:
        scored = []
        for p in held_out:
            image = _sample(trainer.components, prompt, [p, ImageOps.invert(p.convert("RGB"))][:count], settings)
            target = np.asarray(synthetic.EDITS[prompt](p), dtype=np.float32) / 255.0
            scored.append([round(edge_similarity(image, target), 2), round(luminance_correlation(image, target), 2)])
        result[f"{prompt} ({count} reference{'s' if count > 1 else ''})"] = scored
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path, help="a folder for the weights and the model directory")
    parser.add_argument("--weights", type=Path, help="built weights to score instead of building")
    parser.add_argument("--steps", type=int, help="transformer steps (default: the shipped recipe's)")
    parser.add_argument("--constant-latents", type=int, default=0, help="Recipe.constant_latents")
    parser.add_argument("--latent-basis", default="squares", help="Recipe.latent_basis: squares or dct")
    parser.add_argument("--extra-references", type=float, default=0.0, help="Recipe.extra_references")
    parser.add_argument("--reference-steps", type=int, help="Recipe.reference_steps (default: the shipped recipe's)")
    args = parser.parse_args()
    weights, cpu = args.weights, None
    if weights is None:
        shipped = recipe_for(VARIANT)
        recipe = dataclasses.replace(shipped, transformer_steps=args.steps or shipped.transformer_steps,
                                     constant_latents=args.constant_latents, latent_basis=args.latent_basis,
                                     extra_references=args.extra_references,
                                     reference_steps=shipped.reference_steps if args.reference_steps is None
                                     else args.reference_steps)
        weights, started = args.out / "weights", time.process_time()
        pretrain(weights, recipe)
        cpu = round(time.process_time() - started)
    torch.set_num_threads(1)
    model = toy.build_toy(args.out / "model", weights)
    print(json.dumps({"weights": str(weights), "cpu_s": cpu, **scores(model)}))


if __name__ == "__main__":
    main()
