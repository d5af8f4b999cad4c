"""Synthetic pictures and edits: what the toy model learns from and what the demo teaches it.

A picture is a smooth two-colour gradient background with a few saturated shapes (rectangles, ellipses,
triangles) and text-like strokes, lightly blurred. Edits are exact pixel functions of the control picture, so
a (control, prompt) pair has one right answer:

- `EDITS` (the toy model's pretraining): "keep the image", "make it grayscale", "move the shapes left"
  (the picture shifted left by a quarter of its width, wrapping around);
- `DEMO_EDIT` ("invert the colors"): the new edit the demo teaches as a LoRA; the toy model never saw it.

Everything is drawn from a numpy Generator, so a seed gives the same pictures on every machine.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import numpy as np
from PIL import Image, ImageDraw, ImageFilter


def _colour(rng: np.random.Generator) -> tuple[int, int, int]:
    """A saturated colour: one channel high, one low, one anywhere (so grayscale visibly changes it)."""
    channels = rng.permutation(3)
    value = [0, 0, 0]
    value[channels[0]] = int(rng.integers(170, 256))
    value[channels[1]] = int(rng.integers(0, 90))
    value[channels[2]] = int(rng.integers(0, 256))
    return tuple(value)


def picture(rng: np.random.Generator, size: int = 64) -> Image.Image:
    """One synthetic RGB picture of `size` x `size` pixels."""
    top, bottom = np.array(_colour(rng), float), np.array(_colour(rng), float)
    ramp = np.linspace(0.0, 1.0, size)[:, None, None]
    if rng.random() < 0.5:
        ramp = ramp.transpose(1, 0, 2)
    background = ((1 - ramp) * top + ramp * bottom) * 0.6 + 40
    image = Image.fromarray(np.broadcast_to(background, (size, size, 3)).astype(np.uint8))
    draw = ImageDraw.Draw(image)
    for _ in range(int(rng.integers(2, 4))):
        x0, y0 = (int(v) for v in rng.integers(0, size * 3 // 4, 2))
        w, h = (int(v) for v in rng.integers(size // 5, size // 2, 2))
        box = [x0, y0, min(size - 1, x0 + w), min(size - 1, y0 + h)]
        kind = int(rng.integers(0, 3))
        if kind == 0:
            draw.rectangle(box, fill=_colour(rng))
        elif kind == 1:
            draw.ellipse(box, fill=_colour(rng))
        else:
            draw.polygon([(box[0], box[3]), (box[2], box[3]), ((box[0] + box[2]) // 2, box[1])], fill=_colour(rng))
    for _ in range(int(rng.integers(0, 3))):
        points = [tuple(int(v) for v in rng.integers(0, size, 2)) for _ in range(3)]
        draw.line(points, fill=_colour(rng), width=max(1, size // 32))
    return image.filter(ImageFilter.GaussianBlur(size / 64))


def keep(image: Image.Image) -> Image.Image:
    return image.copy()


def grayscale(image: Image.Image) -> Image.Image:
    return image.convert("L").convert("RGB")


def move_left(image: Image.Image) -> Image.Image:
    return Image.fromarray(np.roll(np.asarray(image), -image.width // 4, axis=1))


def invert(image: Image.Image) -> Image.Image:
    return Image.fromarray(255 - np.asarray(image))


#: The toy model's pretraining edits: prompt -> pixel function.
EDITS: dict[str, Callable[[Image.Image], Image.Image]] = {
    "keep the image": keep, "make it grayscale": grayscale, "move the shapes left": move_left}
#: The demo's new edit (prompt, function).
DEMO_EDIT: tuple[str, Callable[[Image.Image], Image.Image]] = ("invert the colors", invert)


def write_pairs(folder: Path, n: int, seed: int, prompt: str = DEMO_EDIT[0], size: int = 64) -> list[tuple[Path, Path]]:
    """Write `n` pairs of one edit in the flat layout (NAME_control.png, NAME.png, NAME.txt); returns
    [(control path, target path)]. `prompt` is a key of `EDITS` or the demo's edit."""
    edits = {**EDITS, DEMO_EDIT[0]: DEMO_EDIT[1]}
    if prompt not in edits:
        raise ValueError(f"unknown synthetic edit {prompt!r}; accepted: {', '.join(edits)}")
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    pairs = []
    # imported here: that module imports torch, which `qwen-edit --help` (its demo command reads this module) never
    # loads
    from qwen_edit_core.common.files import png_bytes

    for i in range(n):
        control = picture(rng, size)
        _write_new(folder / f"pair{i:03d}_control.png", png_bytes(control))
        _write_new(folder / f"pair{i:03d}.png", png_bytes(edits[prompt](control)))
        _write_new(folder / f"pair{i:03d}.txt", prompt.encode("utf-8"))
        pairs.append((folder / f"pair{i:03d}_control.png", folder / f"pair{i:03d}.png"))
    return pairs


def _write_new(path: Path, data: bytes) -> None:
    """Write `data` atomically unless `path` holds it already: a training job reading the folder (ComfyUI's demo
    workflows share one) never sees a file rewritten or half written when a workflow writes the same pairs again."""
    from qwen_edit_core.common.files import write_bytes  # imported here, as png_bytes is

    if path.is_file() and path.read_bytes() == data:
        return
    write_bytes(path, data)
