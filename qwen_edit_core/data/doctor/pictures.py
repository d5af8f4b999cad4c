"""A pair's pictures as the checks see them: each file's small analysis array, made from the dataset reader's own
decode (`picture_of` an `images.ImageCheck`'s picture) or from the file's bytes read once (`decode`), with the
sha256 of those bytes (the embedding cache's content hash, data/identity.py)."""

from __future__ import annotations

import hashlib
import io
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import numpy as np
from PIL import Image, ImageOps

from qwen_edit_core.data.examples import EditExample

#: the longest side the checks look at (a 1024 px picture is measured at 128 px: 1.5 % of the side is 2 px)
ANALYSIS_SIDE = 128


@dataclass(frozen=True)
class Picture:
    """One decoded file: its sha256 (as `identity.hash_file` gives it), displayed size, and the RGB array in [0, 1]
    at the analysis size (float32 (h, w, 3); masks: (h, w))."""
    sha256: str
    size: tuple[int, int]
    pixels: np.ndarray


def read_bytes(path: Path) -> tuple[str, bytes]:
    """(sha256 hex, the bytes) of a file: read once, hashed and decoded from memory."""
    data = Path(path).read_bytes()
    return hashlib.sha256(data).hexdigest(), data


def analysis_size(size: tuple[int, int], side: int = ANALYSIS_SIDE) -> tuple[int, int]:
    """(w, h) of a picture of `size` scaled so its longest side is at most `side` (never upscaled)."""
    w, h = size
    factor = min(1.0, side / max(w, h))
    return max(8, round(w * factor)), max(8, round(h * factor))


def decode(sha256: str, data: bytes, *, grey: bool = False, side: int = ANALYSIS_SIDE) -> Picture:
    """The Picture of a file's bytes (`picture_of`)."""
    with Image.open(io.BytesIO(data)) as img:
        return picture_of(sha256, img, grey=grey, side=side)


def picture_of(sha256: str, img: Image.Image, *, grey: bool = False, side: int = ANALYSIS_SIDE) -> Picture:
    """The Picture of an opened (or already decoded, as the dataset reader's `ImageCheck.image`) file: EXIF
    orientation applied (as the dataset reads it), RGB (transparency on white), or one grey channel for masks."""
    img = ImageOps.exif_transpose(img)
    if img.mode in ("RGBA", "LA", "PA", "P") and not grey:
        img = img.convert("RGBA")
        img = Image.alpha_composite(Image.new("RGBA", img.size, "white"), img)
    img = img.convert("L" if grey else "RGB")
    small = img.resize(analysis_size(img.size, side), Image.BILINEAR, reducing_gap=2.0)
    return Picture(sha256, img.size, np.asarray(small, dtype=np.float32) / 255.0)


def full_rgb(path: Path) -> Image.Image:
    """A picture at its full size (EXIF orientation applied, RGB): only for fixes and the report's few pairs."""
    with Image.open(path) as img:
        return ImageOps.exif_transpose(img).convert("RGB")


@dataclass(frozen=True)
class PairPictures:
    """A pair's files, each read once."""
    example: EditExample
    target: Picture
    controls: tuple[Picture, ...]
    mask: Optional[Picture]


def luminance(rgb: np.ndarray) -> np.ndarray:
    """Rec. 601 luma of float RGB (h, w, 3)."""
    return rgb @ np.array([0.299, 0.587, 0.114], dtype=np.float32)


def resized(array: np.ndarray, size: tuple[int, int]) -> np.ndarray:
    """A float array (h, w) or (h, w, 3) resized to `size` (w, h) (bilinear): pictures of a pair compared on one
    grid."""
    if array.shape[1] == size[0] and array.shape[0] == size[1]:
        return array
    if array.ndim == 2:
        return np.asarray(Image.fromarray(array, mode="F").resize(size, Image.BILINEAR))
    return np.stack([resized(np.ascontiguousarray(array[..., c]), size) for c in range(array.shape[2])], axis=-1)
