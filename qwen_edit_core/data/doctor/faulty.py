"""A synthetic "invert the colors" dataset with planted faults, the doctor's test and documentation dataset.

`write_faulty_dataset(root)` writes `root/train/` (flat layout, two controls per pair: the picture to invert and
an unrelated second reference) and `root/heldout/` (pairs meant for `train.validation_pairs`), and returns
which pairs carry which fault. The faults are the ones edit-LoRA datasets are known to carry: before and after
swapped, a target shifted or zoomed against its control, a near-duplicate pair, a mask on the wrong half of a
local edit, the two references in the other order, and a held-out pair that is also in the training set.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from PIL import Image

from qwen_edit_core.data.synthetic import DEMO_EDIT, invert, picture

PROMPT = DEMO_EDIT[0]
#: planted faults of the 24 training pairs: pair index -> (kind, detail)
PLANTED = {1: ("swapped", None), 8: ("swapped", None), 15: ("swapped", None),
           3: ("misaligned", (6, 0)), 10: ("misaligned", (-8, 6)), 17: ("misaligned", (0, -12)),
           5: ("misaligned", 1.05), 12: ("misaligned", 1.05),
           20: ("duplicate", 2), 22: ("duplicate", 9),
           18: ("mask", "wrong half"), 13: ("reference-order", None)}
#: clean pairs whose edit is local (the left half inverted) with a correct mask
MASKED_CLEAN = (4, 11)
#: held-out pair index -> the training pair it copies (a leak), or None (a clean held-out pair)
HELD_OUT = {0: None, 1: 6}


@dataclass(frozen=True)
class FaultyDataset:
    """Where the dataset was written and which pair names carry which planted fault."""
    train: Path
    heldout: Path
    faults: dict[str, str] = field(default_factory=dict)  # pair name -> kind
    shifts: dict[str, tuple[int, int]] = field(default_factory=dict)  # shifted pair -> (dx, dy) of the target


def _light(image: Image.Image) -> Image.Image:
    """The picture printed on white (its values halved towards 255): the controls are light pictures, so the
    edit has a direction a swapped pair points against. Inverting is its own inverse: on pictures drawn like
    their inverses, a swapped pair would be as valid an inversion as any other and nothing could tell."""
    return Image.fromarray((np.asarray(image, dtype=np.uint16) // 2 + 128).astype(np.uint8))


def _canvas(rng: np.random.Generator, size: int, pad: int) -> Image.Image:
    """A light picture larger than `size` by `pad` on every side, so shifted and zoomed crops show real content."""
    return _light(picture(rng, size + 2 * pad))


def _crop(canvas: Image.Image, size: int, pad: int, dx: int = 0, dy: int = 0, zoom: float = 1.0) -> Image.Image:
    """The `size` square at the canvas centre moved by (dx, dy), or zoomed in by `zoom` (resampled to `size`)."""
    side = size / zoom
    left, top = pad + dx + (size - side) / 2, pad + dy + (size - side) / 2
    box = (left, top, left + side, top + side)
    return canvas.resize((size, size), Image.BICUBIC, box=box) if zoom != 1.0 else canvas.crop(
        tuple(int(round(v)) for v in box))


def _noisy(image: Image.Image, rng: np.random.Generator) -> Image.Image:
    """A near-duplicate: the same picture with faint noise (another encode of the same photo)."""
    pixels = np.asarray(image, dtype=np.float32) + rng.normal(0, 2.0, (image.height, image.width, 3))
    return Image.fromarray(np.clip(np.round(pixels), 0, 255).astype(np.uint8))


def _half(size: int, left: bool) -> np.ndarray:
    mask = np.zeros((size, size), np.uint8)
    mask[:, : size // 2] = 255
    return mask if left else 255 - mask


def _pair(rng: np.random.Generator, size: int, index: int) -> tuple[list[Image.Image], Image.Image, np.ndarray | None]:
    """(controls, target, mask or None) of training pair `index`, its planted fault applied."""
    pad = size // 4
    canvas = _canvas(rng, size, pad)
    control, reference = _crop(canvas, size, pad), _light(picture(rng, size))
    kind, detail = PLANTED.get(index, (None, None))
    mask = None
    if kind == "misaligned" and isinstance(detail, tuple):
        target = invert(_crop(canvas, size, pad, *detail))
    elif kind == "misaligned":
        target = invert(_crop(canvas, size, pad, zoom=detail))
    elif index in MASKED_CLEAN or kind == "mask":
        left = np.asarray(control).copy()
        left[:, : size // 2] = 255 - left[:, : size // 2]
        target, mask = Image.fromarray(left), _half(size, left=kind != "mask")
    else:
        target = invert(control)
    if kind == "swapped":
        control, target = target, control
    controls = [reference, control] if kind == "reference-order" else [control, reference]
    return controls, target, mask


def _write(folder: Path, name: str, controls, target: Image.Image, mask: np.ndarray | None) -> None:
    for k, image in enumerate(controls, 1):
        image.save(folder / f"{name}_control_{k}.png")
    target.save(folder / f"{name}.png")
    (folder / f"{name}.txt").write_text(PROMPT, encoding="utf-8")
    if mask is not None:
        Image.fromarray(mask, mode="L").save(folder / f"{name}_mask.png")


def write_faulty_dataset(root, size: int = 64, seed: int = 0, count: int = 24) -> FaultyDataset:
    """Write the planted-fault dataset under `root` (train/ and heldout/); returns what was planted where.
    `count` >= 24 keeps the planted pairs and adds clean ones."""
    if count < 24:
        raise ValueError(f"count {count}: the planted faults need at least 24 pairs")
    root = Path(root)
    train, heldout = root / "train", root / "heldout"
    train.mkdir(parents=True, exist_ok=True)
    heldout.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    written: dict[int, tuple] = {}
    faults, shifts = {}, {}
    for i in range(count):
        name = f"pair{i:03d}"
        kind, detail = PLANTED.get(i, (None, None))
        if kind == "duplicate":
            controls, target, mask = written[detail]
            controls, target = [_noisy(c, rng) for c in controls], _noisy(target, rng)
        else:
            controls, target, mask = _pair(rng, size, i)
        written[i] = (controls, target, mask)
        _write(train, name, controls, target, mask)
        if kind:
            faults[name] = kind
        if kind == "misaligned" and isinstance(detail, tuple):
            shifts[name] = detail
    for j, source in HELD_OUT.items():
        name = f"held{j:03d}"
        if source is None:
            controls, target, mask = _pair(rng, size, -1)
        else:
            controls, target, mask = written[source]
            faults[name] = "leak"
        _write(heldout, name, controls, target, mask)
    return FaultyDataset(train, heldout, faults, shifts)


def score(report, dataset: FaultyDataset) -> tuple[float, float]:
    """(recall, precision) of a doctor report on the planted faults: the share of planted (pair, kind) faults found,
    and the share of flagged pairs that carry a planted fault (a clean pair flagged lowers it)."""
    found = {(f.pair, f.kind) for f in report.findings}
    recall = sum((pair, kind) in found for pair, kind in dataset.faults.items()) / max(1, len(dataset.faults))
    flagged = report.flagged
    precision = sum(name in dataset.faults for name in flagged) / len(flagged) if flagged else 1.0
    return recall, precision
