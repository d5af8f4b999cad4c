"""Held-out validation pairs: a few pairs kept out of training, sampled at each validation step, and their
distance to their targets logged to `validation/metrics.csv` and plotted to `validation/metrics.png`.

The training loss of a flow model mixes every noise level and falls slowly whether or not the edit is learned;
the error of what the LoRA actually draws from a pair it never saw says whether it learns the edit and when it
starts to overfit (the held-out error turns up while the training loss keeps falling).

Per validation step and averaged over the held-out pairs: `latent_mse` (sampled latents against the target's
cached latents, in the normalized latent units the loss uses), `pixel_mse` (the decoded picture against the
target image resized to the sampled size, both as 8-bit RGB in [0, 1]), and for pairs with a mask
`pixel_mse_in_mask` / `pixel_mse_out_mask` (white = the edited region; empty when no pair has a mask). Each
pair's picture and sampled latents are written to `validation/heldout/step-0000012/NAME.png` / `.safetensors`, so the
numbers can be checked by hand.
"""

from __future__ import annotations

import csv
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np
import torch

from qwen_edit_core.common.files import save_png, save_safetensors, writing
from qwen_edit_core.data.examples import EditExample
from qwen_edit_core.model.geometry import open_bounded

log = logging.getLogger(__name__)

COLUMNS = ("step", "latent_mse", "pixel_mse", "pixel_mse_in_mask", "pixel_mse_out_mask")


def split_heldout(examples: Sequence[EditExample], spec: int | str, load_folder) -> tuple[list, list]:
    """(training examples, held-out examples) for `train.validation_pairs`: a number N keeps the last N pairs of
    the dataset (in name order) out of training; a folder's pairs (loaded by `load_folder`) are held out as they
    are, and a pair of that folder whose target is also in the dataset is refused (it would be trained on)."""
    ordered = sorted(examples, key=lambda e: e.name)
    if isinstance(spec, str) and spec:
        held = list(load_folder(spec))
        shared = sorted({e.target.resolve() for e in held} & {e.target.resolve() for e in ordered})
        if shared:
            raise ValueError(f"train.validation_pairs {spec!r}: {len(shared)} pair(s) are also in data.folder "
                             f"(e.g. {str(shared[0])!r}); held-out pairs must not be trained on: use another folder")
        return list(examples), held
    count = int(spec or 0)
    if count < 0 or count >= len(ordered):
        raise ValueError(f"train.validation_pairs {count} must be >= 0 and less than the dataset's "
                         f"{len(ordered)} pairs (at least one pair must be left to train on)")
    held = ordered[len(ordered) - count:] if count else []
    names = {e.name for e in held}
    return [e for e in examples if e.name not in names], held


def target_pixels(example: EditExample, width: int, height: int) -> np.ndarray:
    """The pair's target as (H, W, 3) uint8 at the sampled size (bicubic), as the metrics compare it."""
    from PIL import Image
    from qwen_edit_core.data.images import load_rgb
    image = load_rgb(example.target, convert_modes=True)
    return np.asarray(image.resize((width, height), Image.BICUBIC), dtype=np.uint8)


def mask_pixels(example: EditExample, width: int, height: int) -> np.ndarray | None:
    """The pair's edit mask as an (H, W) bool array at the sampled size (white = edited), or None."""
    if example.mask is None:
        return None
    from PIL import Image
    with open_bounded(example.mask, "mask") as mask:
        return np.asarray(mask.convert("L").resize((width, height), Image.BILINEAR)) >= 128


def pixel_errors(sampled: np.ndarray, target: np.ndarray, mask: np.ndarray | None) -> tuple[float, float, float]:
    """(mse, mse inside the mask, mse outside it) of two (H, W, 3) uint8 pictures in [0, 1] units; the region
    values are NaN without a mask (or when a region is empty)."""
    err = ((sampled.astype(np.float64) - target.astype(np.float64)) / 255.0) ** 2
    per_pixel = err.mean(axis=-1)
    if mask is None:
        return float(per_pixel.mean()), float("nan"), float("nan")
    inside = float(per_pixel[mask].mean()) if mask.any() else float("nan")
    outside = float(per_pixel[~mask].mean()) if (~mask).any() else float("nan")
    return float(per_pixel.mean()), inside, outside


@dataclass(frozen=True)
class HeldOutPair:
    """One held-out pair: its dataset example and its cache tensors (conditioning and target latents)."""
    example: EditExample
    tensors: dict


class HeldOutMetrics:
    """Callable(step, write=True): sample every held-out pair with the training transformer (the first
    validation preview's settings), decode it with the VAE, and append the step's mean errors to
    `validation/metrics.csv`; keeps `rows` for the result and the job's live view."""

    def __init__(self, components, pairs: Sequence[HeldOutPair], settings, out_dir: Path):
        self.components, self.pairs, self.settings = components, list(pairs), settings
        self.out_dir = out_dir / "validation"
        self.csv = self.out_dir / "metrics.csv"
        self.rows: list[tuple] = []

    def pair_errors(self, pair: HeldOutPair, picture_path: Path | None) -> tuple[float, float, float, float]:
        """(latent mse, pixel mse, in mask, out of mask) of one pair sampled now."""
        from qwen_edit_core.families import family_of
        transformer = self.components.transformer
        sampling = family_of(pair.tensors).stage("sampler")  # the entry's family samples and packs it
        cond = sampling.conditioning_from_entry(pair.tensors, next(transformer.parameters()).device,
                                                transformer.img_in.weight.dtype)
        latents = sampling.denoise(self.components, cond, self.settings)
        target = sampling.pack(pair.tensors["target_latents"][None]).to(latents.device, torch.float32)
        latent_mse = float(((latents.float() - target) ** 2).mean())
        pixels = sampling.decode(self.components, latents, cond.width, cond.height)[0, ..., :3]  # 2.1: RGBA
        picture = (pixels.numpy() * 255).round().clip(0, 255).astype(np.uint8)
        if picture_path is not None:
            from PIL import Image
            with writing(picture_path, "a held-out pair's picture", self._survivor, key="train.output_dir"):
                save_png(Image.fromarray(picture), picture_path)
                save_safetensors({"latents": latents.float()}, picture_path.with_suffix(".safetensors"))
        example = pair.example
        errors = pixel_errors(picture, target_pixels(example, cond.width, cond.height),
                              mask_pixels(example, cond.width, cond.height))
        return (latent_mse, *errors)

    def __call__(self, step: int, write: bool = True) -> tuple:
        transformer = self.components.transformer
        transformer.eval()
        folder = self.out_dir / "heldout" / f"step-{step:07d}"
        try:
            with torch.no_grad():
                errors = [self.pair_errors(p, folder / f"{p.example.name}.png" if write else None)
                          for p in self.pairs]
        finally:
            transformer.train()
        row = (step, *(_nanmean(column) for column in zip(*errors)))
        self.rows.append(row)
        if write:
            self._write(row)
        log.info("held-out pairs at step %d: latent mse %.5f, pixel mse %.5f (in mask %.5f, outside %.5f)", *row)
        return row

    def _survivor(self) -> str:
        from qwen_edit_core.train.checkpoint import survivor
        return survivor(self.out_dir.parent / "checkpoints")

    def _write(self, row: tuple) -> None:
        with writing(self.csv, "the held-out metrics", self._survivor, key="train.output_dir"):
            self._write_files(row)

    def _write_files(self, row: tuple) -> None:
        from qwen_edit_core.train.log import plot_loss
        self.out_dir.mkdir(parents=True, exist_ok=True)
        new = not self.csv.is_file()
        with open(self.csv, "a", newline="", encoding="utf-8") as fh:
            writer = csv.writer(fh)
            if new:
                writer.writerow(COLUMNS)
            writer.writerow([row[0], *("" if v != v else f"{v:.8g}" for v in row[1:])])
        plot_loss([(r[0], r[2]) for r in self.rows], self.out_dir / "metrics.png",
                  title="Held-out pairs: error of the sampled picture", ylabel="pixel MSE to the target (RGB, 0-1)")


def _nanmean(values) -> float:
    finite = [v for v in values if v == v]
    return sum(finite) / len(finite) if finite else float("nan")


def read_metrics(path: Path) -> list[dict]:
    """The rows of a `validation/metrics.csv` as dicts of floats (a missing region value: None)."""
    if not path.is_file():
        return []
    with open(path, newline="", encoding="utf-8") as fh:
        return [{k: (int(v) if k == "step" else float(v) if v else None) for k, v in row.items()}
                for row in csv.DictReader(fh)]


def heldout_text(rows: Sequence[dict]) -> str:
    """The status line's part for the held-out pairs (rows of `read_metrics`): the latest pixel and latent
    errors and the step with the lowest pixel error (a later rise is overfitting); "" without rows."""
    if not rows:
        return ""
    last, best = rows[-1], min(rows, key=lambda r: r["pixel_mse"])
    return (f", held-out pixel MSE {last['pixel_mse']:.4f} (latent {last['latent_mse']:.4f}; lowest "
            f"{best['pixel_mse']:.4f} at step {best['step']})")


class Validations:
    """Several validation callables as one (the validation image's previews, the held-out pairs)."""

    def __init__(self, *calls):
        self.calls = [c for c in calls if c is not None]

    def __call__(self, step: int, write: bool = True):
        results = [call(step, write=write) for call in self.calls]
        return results[0] if results else None
