"""The main job on the embedded tiny model (`make demo`).

Builds the tiny model once, generates a synthetic dataset of a simple learnable edit (invert the colours of
soft random shapes), caches it, trains a LoRA, samples held-out inputs before and after, and writes the LoRA,
`loss.png`, a before/after grid and `metrics.json` with how much closer to the targets the LoRA brings the
samples. The tiny model has random weights and a random VAE, so distances are measured against the VAE's own
reconstruction of each target (what a perfect transformer could reach) and in latent space.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

import numpy as np
import torch
from PIL import Image, ImageDraw, ImageFilter

log = logging.getLogger(__name__)

CAPTION = "invert the colors"
SIZE = 64
N_TRAIN, N_HELD_OUT = 24, 4


def synthetic_pair(rng: np.random.Generator) -> tuple[Image.Image, Image.Image]:
    """(control, target): a few soft coloured shapes on a coloured background, and its colour inverse."""
    image = Image.new("RGB", (SIZE, SIZE), tuple(int(c) for c in rng.integers(0, 255, 3)))
    draw = ImageDraw.Draw(image)
    for _ in range(3):
        x0, y0 = rng.integers(0, SIZE - 16, 2)
        w, h = rng.integers(12, 40, 2)
        box = [int(x0), int(y0), int(min(SIZE, x0 + w)), int(min(SIZE, y0 + h))]
        fill = tuple(int(c) for c in rng.integers(0, 255, 3))
        (draw.ellipse if rng.random() < 0.5 else draw.rectangle)(box, fill=fill)
    control = image.filter(ImageFilter.GaussianBlur(1.5))
    return control, Image.fromarray(255 - np.asarray(control))


def write_dataset(folder: Path, n: int, seed: int) -> list[tuple[Path, Path]]:
    """Flat layout: NAME.png (target), NAME_control.png, NAME.txt."""
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    pairs = []
    for i in range(n):
        control, target = synthetic_pair(rng)
        control.save(folder / f"pair{i:03d}_control.png")
        target.save(folder / f"pair{i:03d}.png")
        (folder / f"pair{i:03d}.txt").write_text(CAPTION, encoding="utf-8")
        pairs.append((folder / f"pair{i:03d}_control.png", folder / f"pair{i:03d}.png"))
    return pairs


def _config(model_dir: Path, data: Path, out_dir: Path):
    from qwen_edit_core.config import load_config
    return load_config(overrides={
        "model": {"pretrained_model_name_or_path": str(model_dir), "lora": {"rank": 16, "alpha": 16.0,
                                                                             "targets": "all"}},
        "data": {"folder": str(data), "vae_area": SIZE * SIZE, "batch_size": 4},
        "cache": {"dir": str(out_dir / "cache")},
        "train": {"output_dir": str(out_dir / "train"), "max_steps": 1500, "seed": 0, "checkpoint_every": 500,
                  "lora_name": "demo_lora"},
        "optimizer": {"lr": 2e-3, "weight_decay": 0.0},
        "lr_scheduler": {"type": "cosine", "warmup_steps": 50},
        "predict": {"vae_area": SIZE * SIZE}})


def _evaluate(trainer, held_out, steps: int = 20) -> dict:
    """Sample each held-out control (CFG off, fixed seed); distances to the target's latents and to the VAE
    reconstruction of the target."""
    from qwen_edit_core.model import encode
    from qwen_edit_core.sample import sampler
    from qwen_edit_core.model.encode import open_image
    comps = trainer.components
    settings = sampler.SampleSettings(num_inference_steps=steps, true_cfg_scale=1.0, negative_prompt=None, seed=0,
                                      vae_area=SIZE * SIZE)
    latent_err, pixel_err, images, reconstructions = [], [], [], []
    for i, (control_path, target_path) in enumerate(held_out):
        control, target = open_image(control_path), open_image(target_path)
        cond = sampler.build_conditioning(comps, CAPTION, [control], settings)
        latents = sampler.denoise(comps, cond, settings)
        target_latents = encode.pack(trainer.encode_image(target, area=SIZE * SIZE)).to(latents.device)
        image = sampler.decode(comps, latents, cond.width, cond.height)[0]
        reconstruction = sampler.decode(comps, target_latents, cond.width, cond.height)[0]
        latent_err.append(float((latents - target_latents).float().pow(2).mean()))
        pixel_err.append(float((image - reconstruction).pow(2).mean()))
        images.append(image)
        reconstructions.append(reconstruction)
    return {"latent_mse": float(np.mean(latent_err)), "pixel_mse_vs_reconstruction": float(np.mean(pixel_err)),
            "images": images, "reconstructions": reconstructions}


def _grid(rows: list[list[Image.Image]], path: Path) -> None:
    cell = SIZE * 2
    grid = Image.new("RGB", (cell * len(rows[0]), cell * len(rows)), "white")
    for r, row in enumerate(rows):
        for c, img in enumerate(row):
            grid.paste(img.resize((cell, cell), Image.NEAREST), (c * cell, r * cell))
    grid.save(path)


def _to_pil(image: torch.Tensor) -> Image.Image:
    return Image.fromarray((image.numpy() * 255).round().astype(np.uint8))


def run_demo(out_dir: Path) -> dict:
    """Run the whole job into `out_dir`; returns the metrics (also written to metrics.json)."""
    from qwen_edit_core.api import QwenImageEditTrainer
    from qwen_edit_core.model.tiny import build_tiny

    started = time.perf_counter()
    out_dir.mkdir(parents=True, exist_ok=True)
    model_dir = out_dir / "tiny-model"
    if not (model_dir / "model_index.json").is_file():
        build_tiny(model_dir)
    write_dataset(out_dir / "dataset", N_TRAIN, seed=0)
    held_out = write_dataset(out_dir / "held_out", N_HELD_OUT, seed=1)
    config = _config(model_dir, out_dir / "dataset", out_dir)

    trainer = QwenImageEditTrainer(config)
    trainer.load_model()
    before = _evaluate(trainer, held_out)
    log.info("before: latent MSE %.4f, pixel MSE %.4f", before["latent_mse"], before["pixel_mse_vs_reconstruction"])

    trainer.cache()
    result = trainer.fit()
    trainer.load_model(which=("vae", "text_encoder"), keep_transformer=True)
    after = _evaluate(trainer, held_out)
    log.info("after:  latent MSE %.4f, pixel MSE %.4f", after["latent_mse"], after["pixel_mse_vs_reconstruction"])

    # Columns: control | target | the target through the tiny random VAE (the best a sample can look) |
    # sample before training | sample after training.
    rows = []
    for (control, target), r, b, a in zip(held_out, after["reconstructions"], before["images"], after["images"]):
        rows.append([Image.open(control).convert("RGB"), Image.open(target).convert("RGB"), _to_pil(r), _to_pil(b),
                     _to_pil(a)])
    _grid(rows, out_dir / "before_after.png")
    metrics = {
        "latent_mse_before": before["latent_mse"], "latent_mse_after": after["latent_mse"],
        "latent_mse_reduction": 1 - after["latent_mse"] / before["latent_mse"],
        "pixel_mse_before": before["pixel_mse_vs_reconstruction"],
        "pixel_mse_after": after["pixel_mse_vs_reconstruction"],
        "pixel_mse_reduction": 1 - after["pixel_mse_vs_reconstruction"] / before["pixel_mse_vs_reconstruction"],
        "train_steps": result.step, "first_loss": result.history[0][1], "last_loss": result.history[-1][1],
        "lora": str(result.lora_path), "loss_plot": str(result.loss_plot), "seconds": time.perf_counter() - started}
    (out_dir / "metrics.json").write_text(json.dumps(metrics, indent=1))
    log.info("demo: the LoRA brings held-out samples %.0f%% closer to the targets in latent space (MSE %.4f -> "
             "%.4f) and %.0f%% closer in pixels (vs the VAE reconstruction of the target); grid: %s; %.0f s",
             100 * metrics["latent_mse_reduction"], before["latent_mse"], after["latent_mse"],
             100 * metrics["pixel_mse_reduction"], out_dir / "before_after.png", metrics["seconds"])
    return metrics
