"""The main job on the pretrained toy model (`make demo`): teach it an edit it has never seen, as a LoRA.

Builds the toy model (toys/toy.py: trained tiny VAE and transformer) from the weights shipped with the
package, writes a synthetic dataset of the demo's edit ("invert the colors", data/synthetic.py), caches it,
trains a LoRA, samples held-out controls before and after, and writes the LoRA, `train/loss.png`, a labelled
`before_after.png` (control | target | before LoRA | after LoRA) and `metrics.json` (pixel and latent mean
squared errors of the samples to the targets, and their edge similarity to the targets, before and after).

Speed: the toy model's operations are tiny, so the demo runs torch on one intra-op thread. With two threads
on a busy machine every operation waits for a descheduled partner thread (BENCHMARKS.md, "The demo under load").
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
from pathlib import Path

import numpy as np
import torch
from PIL import Image, ImageDraw, ImageFont

from qwen_edit_core.data import synthetic
from qwen_edit_core.families import variants

log = logging.getLogger(__name__)

CAPTION = synthetic.DEMO_EDIT[0]
SIZE = 128
N_TRAIN, N_HELD_OUT = 24, 4
#: The toy transformer is 64 wide, and inverting the colours negates the whole copy of the control it makes for
#: "keep": a change of rank 64. A rank-16 LoRA (lr 3e-3) negated the mean colours but not the detail and
#: dissolved the shapes into blocks: held-out edge similarity 0.27 after 300 steps; rank 64: 0.52, and 0.57
#: with lr 1e-2 (docs/TOY_MODEL.md). A rank-64 step costs about 16% more, so the demo takes 250 steps.
RANK = 64
LEARNING_RATE = 1e-2
STEPS = 250
COLUMNS = ("control", "target", "before LoRA", "after LoRA")


def write_dataset(folder: Path, n: int, seed: int) -> list[tuple[Path, Path]]:
    """The demo's edit as `n` pairs in the flat layout (NAME_control.png, NAME.png, NAME.txt)."""
    return synthetic.write_pairs(Path(folder), n, seed, CAPTION, SIZE)


def _config(model_dir: Path, data: Path, out_dir: Path, steps: int):
    from qwen_edit_core.config import load_config
    return load_config(overrides={
        "model": {"pretrained_model_name_or_path": str(model_dir), "lora": {"rank": RANK, "alpha": float(RANK),
                                                                             "targets": "all"}},
        "data": {"folder": str(data), "vae_area": SIZE * SIZE, "batch_size": 8},
        "cache": {"dir": str(out_dir / "cache")},
        "train": {"output_dir": str(out_dir / "train"), "max_steps": steps, "seed": 0,
                  "checkpoint_every": steps, "lora_name": "demo_lora"},
        "optimizer": {"lr": LEARNING_RATE, "weight_decay": 0.0},
        "lr_scheduler": {"type": "cosine", "warmup_steps": 20},
        "predict": {"vae_area": SIZE * SIZE}})


def edge_similarity(picture: np.ndarray, target: np.ndarray) -> float:
    """How well `picture` keeps the shapes of `target`, both (H, W, 3) RGB in [0, 1]: the Pearson correlation of
    their gradient magnitudes (central differences, over the three channels together). Inverting the colours
    keeps every edge, so the inverted target scores 1 against its control; shapes dissolved into blocks or
    noise score near 0."""
    def magnitude(image: np.ndarray) -> np.ndarray:
        image = np.asarray(image, dtype=np.float64)
        dx, dy = image[1:-1, 2:] - image[1:-1, :-2], image[2:, 1:-1] - image[:-2, 1:-1]
        return np.sqrt((dx ** 2 + dy ** 2).sum(axis=-1)).ravel()
    return float(np.corrcoef(magnitude(picture), magnitude(target))[0, 1])


def luminance_correlation(picture: np.ndarray, target: np.ndarray) -> float:
    """How well `picture` keeps the light and dark of `target`, both (H, W, 3) RGB in [0, 1]: the Pearson
    correlation of their luminance (the channels' mean) pixel by pixel. For grey targets, whose edges are faint
    where shapes of different hues have close luminance, it says what `edge_similarity` cannot."""
    def luminance(image: np.ndarray) -> np.ndarray:
        return np.asarray(image, dtype=np.float64)[..., :3].mean(axis=-1).ravel()
    return float(np.corrcoef(luminance(picture), luminance(target))[0, 1])


def _family_sampler(components):
    """The sampler module of the components' family (families/<family>/sampler.py: its conditioning, loop,
    decoding and latent packing)."""
    return variants.get(components.variant).family.stage("sampler")




def _evaluate(trainer, held_out, steps: int = 20, sigmas: str | None = None) -> dict:
    """Sample each held-out control (CFG off, seed 0; for Qwen-Image-2.1 the control is reference 1; `sigmas`: a
    preset sigma list run unshifted instead of `steps`); mean squared errors to the target in normalized latents
    and in pixels ([0, 1] RGB), and the pictures' edge similarity to the target."""
    from qwen_edit_core.model import encode
    from qwen_edit_core.sample import sampler, schedules
    comps = trainer.components
    family_sampler = _family_sampler(comps)
    grid = schedules.parse_sigmas(sigmas) if sigmas else None
    settings = sampler.SampleSettings(num_inference_steps=steps, true_cfg_scale=1.0, negative_prompt=None, seed=0,
                                      vae_area=SIZE * SIZE, sigmas=grid, shift=1.0 if grid else None)
    latent_err, pixel_err, edges, images = [], [], [], []
    for control_path, target_path in held_out:
        control, target = encode.open_image(control_path), encode.open_image(target_path)
        cond = family_sampler.build_conditioning(comps, CAPTION, [control], settings)
        latents = family_sampler.denoise(comps, cond, settings)
        target_latents = family_sampler.pack(trainer.encode_image(target, area=SIZE * SIZE)).to(latents.device)
        image = family_sampler.decode(comps, latents, cond.width, cond.height)[0][..., :3]
        target_pixels = torch.from_numpy(np.asarray(target, dtype=np.float32) / 255.0)
        latent_err.append(float((latents - target_latents).float().pow(2).mean()))
        pixel_err.append(float((image - target_pixels).pow(2).mean()))
        edges.append(edge_similarity(image.numpy(), target_pixels.numpy()))
        images.append(image)
    return {"latent_mse": float(np.mean(latent_err)), "pixel_mse": float(np.mean(pixel_err)),
            "edge_similarity": float(np.mean(edges)), "images": images}


def labelled_grid(rows: list[list[Image.Image]], labels: tuple[str, ...], path: Path, cell: int = 128) -> Image.Image:
    """Rows of pictures under a header of column labels, each picture scaled to `cell` pixels; writes `path`."""
    header = 24
    font = ImageFont.load_default(size=14)
    grid = Image.new("RGB", (cell * len(labels), header + cell * len(rows)), "white")
    draw = ImageDraw.Draw(grid)
    for c, label in enumerate(labels):
        draw.text((c * cell + cell // 2, header // 2), label, fill="black", font=font, anchor="mm")
    for r, row in enumerate(rows):
        for c, img in enumerate(row):
            grid.paste(img.resize((cell, cell), Image.NEAREST), (c * cell, header + r * cell))
    grid.save(path)
    return grid


def _to_pil(image: torch.Tensor) -> Image.Image:
    return Image.fromarray((image.numpy() * 255).round().astype(np.uint8))


@contextlib.contextmanager
def one_thread():
    """torch on one intra-op thread inside the block (restored after)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def run_demo(out_dir: Path, steps: int = STEPS, variant: str = variants.DEFAULT, progress=None) -> dict:
    """Run the whole job into `out_dir` with `steps` LoRA steps on the toy model of `variant` (a variant whose family
    ships a toy, `Family.toy`; with in-text references the control is reference 1); returns the metrics (also in
    metrics.json). Each phase is logged as it starts; `progress` (a common.progress.ProgressFn) receives the cache and
    training stages' step events, as for `QwenImageEditTrainer.cache` and `.fit`."""
    with one_thread():
        return _run(Path(out_dir), steps, variant, progress)


def _run(out_dir: Path, steps: int, variant: str, progress=None) -> dict:
    from qwen_edit_core.api import QwenImageEditTrainer
    from qwen_edit_core.toys import toy

    started = time.perf_counter()
    out_dir.mkdir(parents=True, exist_ok=True)
    family = variants.get(variant).family
    # the few-step schedule the family's users sample with (Qwen-Image-2.1: Turbo's 8-step sigma list, unshifted)
    few_steps = family.toy.few_step_sigmas
    model_dir = toy.ensure_toy(out_dir / family.toy.demo_folder, toy.weights_of(family))
    write_dataset(out_dir / "dataset", N_TRAIN, seed=0)
    held_out = write_dataset(out_dir / "held_out", N_HELD_OUT, seed=1)
    log.info("demo: toy model in %s, %d training and %d held-out pairs in %s", model_dir, N_TRAIN, N_HELD_OUT,
             out_dir)
    trainer = QwenImageEditTrainer(_config(model_dir, out_dir / "dataset", out_dir, steps))
    trainer.load_model()
    log.info("demo: sampling the held-out pairs before training")
    before = _evaluate(trainer, held_out)
    few_before = _evaluate(trainer, held_out, sigmas=few_steps) if few_steps else None
    log.info("demo: encoding the training pairs into the embedding cache")
    trainer.cache(progress=progress)
    log.info("demo: training the LoRA for %d steps", steps)
    result = trainer.fit(progress=progress)
    trainer.load_model(which=("vae", "text_encoder"), keep_transformer=True)
    log.info("demo: sampling the held-out pairs with the LoRA")
    after = _evaluate(trainer, held_out)
    few_after = _evaluate(trainer, held_out, sigmas=few_steps) if few_steps else None

    rows = [[Image.open(c).convert("RGB"), Image.open(t).convert("RGB"), _to_pil(b), _to_pil(a)]
            for (c, t), b, a in zip(held_out, before["images"], after["images"])]
    labelled_grid(rows, COLUMNS, out_dir / "before_after.png")
    metrics = {
        "edit": CAPTION,  # not a family name
        "pixel_mse_before": before["pixel_mse"], "pixel_mse_after": after["pixel_mse"],
        "pixel_mse_ratio": after["pixel_mse"] / before["pixel_mse"],
        "latent_mse_before": before["latent_mse"], "latent_mse_after": after["latent_mse"],
        "latent_mse_ratio": after["latent_mse"] / before["latent_mse"],
        "edge_similarity_before": before["edge_similarity"], "edge_similarity_after": after["edge_similarity"],
        "train_steps": result.step, "first_loss": result.history[0][1], "last_loss": result.history[-1][1],
        "lora": str(result.lora_path), "loss_plot": str(result.loss_plot),
        "before_after": str(out_dir / "before_after.png"),
        "seconds": time.perf_counter() - started}
    if few_after is not None:  # the saved LoRA's edit at the few-step schedule 2.1's users sample with
        metrics.update({"fewstep_sigmas": few_steps, "fewstep_pixel_mse_before": few_before["pixel_mse"],
                        "fewstep_pixel_mse_after": few_after["pixel_mse"],
                        "fewstep_edge_similarity_after": few_after["edge_similarity"]})
        log.info("demo: at %s (8 steps) pixel MSE to the targets %.4f -> %.4f, edge similarity %.2f",
                 few_steps, few_before["pixel_mse"], few_after["pixel_mse"], few_after["edge_similarity"])
    (out_dir / "metrics.json").write_text(json.dumps(metrics, indent=1))
    log.info("demo: %r learned as a LoRA in %d steps: pixel MSE to the targets %.4f -> %.4f (%.1fx lower), latent "
             "MSE %.3f -> %.3f, edge similarity %.2f -> %.2f; pictures: %s, loss plot: %s (%.0f s)", CAPTION,
             result.step, before["pixel_mse"], after["pixel_mse"], before["pixel_mse"] / after["pixel_mse"],
             before["latent_mse"], after["latent_mse"], before["edge_similarity"], after["edge_similarity"],
             out_dir / "before_after.png", result.loss_plot, metrics["seconds"])
    return metrics
