"""Opening and checking one dataset image: the one decode path for validation, training and the cache."""

from __future__ import annotations

import contextlib
import hashlib
import io
import logging
import threading
import warnings
from dataclasses import dataclass, field, replace
from pathlib import Path

from PIL import Image, ImageFile, ImageOps, UnidentifiedImageError

from qwen_edit_core.model.geometry import open_bounded

log = logging.getLogger(__name__)

ACCEPTED_IMAGES = "png, jpg or webp"
_EXIF_ORIENTATION = 0x0112
_ROTATED_ORIENTATIONS = (5, 6, 7, 8)  # these swap width and height
_MODE_NAMES = {"RGBA": "RGB with alpha", "LA": "greyscale with alpha", "L": "greyscale", "P": "palette",
               "PA": "palette with alpha", "1": "1-bit", "CMYK": "CMYK", "YCbCr": "YCbCr", "LAB": "Lab",
               "HSV": "HSV", "I": "32-bit integer", "F": "32-bit float", "I;16": "16-bit greyscale",
               "I;16B": "16-bit greyscale", "I;16L": "16-bit greyscale", "I;16N": "16-bit greyscale"}
_ALPHA_MODES = ("RGBA", "RGBa", "LA", "La", "PA")
# LOAD_TRUNCATED_IMAGES is a process-wide switch; our validation flips it off for its own decode only.
_TRUNCATION_LOCK = threading.Lock()



@dataclass(frozen=True)
class ImageCheck:
    """What validating one image found: its displayed size, mode and EXIF orientation, or a problem; with the
    sha256 of the file's bytes (`identity.hash_file`'s value) and the decoded picture as stored (EXIF orientation
    not applied), so that a consumer of the validation (the dataset doctor) needs no second read or decode."""
    size: tuple[int, int] | None = None  # (w, h) as displayed
    mode: str = ""
    orientation: int = 1
    problem: str | None = None
    sha256: str = ""
    image: Image.Image | None = field(default=None, repr=False, compare=False)


@contextlib.contextmanager
def _truncated_images_fail():
    """Decode with Pillow's LOAD_TRUNCATED_IMAGES off: some hosts switch it on process-wide, and then a cut
    file decodes silently with grey rows instead of failing here."""
    with _TRUNCATION_LOCK:
        previous = ImageFile.LOAD_TRUNCATED_IMAGES
        ImageFile.LOAD_TRUNCATED_IMAGES = False
        try:
            yield
        finally:
            ImageFile.LOAD_TRUNCATED_IMAGES = previous


def _orientation(img: Image.Image) -> int:
    value = img.getexif().get(_EXIF_ORIENTATION, 1)
    return value if isinstance(value, int) and 1 <= value <= 8 else 1


def _decode(path: Path, max_pixels: int) -> ImageCheck:
    """Read `path` once, hash its bytes and fully decode them (the size check comes first, before any pixel is
    allocated); the check keeps the decoded picture."""
    try:
        data = Path(path).read_bytes()
        with _truncated_images_fail(), warnings.catch_warnings():
            # Our own max_pixels check below replaces PIL's bomb warning; its hard error (at twice
            # Image.MAX_IMAGE_PIXELS) still fires inside open() and is reported below.
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            img = Image.open(io.BytesIO(data))  # from memory: nothing to close, the loaded picture is kept
            w, h = img.size
            if w * h > max_pixels:
                return ImageCheck(problem=f"{w}x{h} is {w * h} pixels, over the {max_pixels} pixel limit "
                                          "(decompression bomb guard); accepted: at most that many pixels "
                                          "(raise max_pixels if the image is genuine)")
            img.load()
            return ImageCheck(size=(w, h), mode=img.mode, orientation=_orientation(img),
                              sha256=hashlib.sha256(data).hexdigest(), image=img)
    except Image.DecompressionBombError as err:
        return ImageCheck(problem=f"image is absurdly large ({err}); accepted: at most {max_pixels} pixels")
    except UnidentifiedImageError:
        return ImageCheck(problem=f"not a readable image; accepted: {ACCEPTED_IMAGES}")
    except Exception as err:  # noqa: BLE001 - damaged files make decoders raise anything; name it, don't crash
        return ImageCheck(problem=f"image is truncated or damaged ({type(err).__name__}: {err}); re-export it "
                                  f"as {ACCEPTED_IMAGES}")


def _mode_name(mode: str) -> str:
    return f"{mode} ({_MODE_NAMES[mode]})" if mode in _MODE_NAMES else mode


def inspect_image(path: Path, *, min_side: int, max_pixels: int, convert_modes: bool) -> ImageCheck:
    """Validate one image: decodes, RGB (or `convert_modes`), at least `min_side` and at most `max_pixels`."""
    check = _decode(Path(path), max_pixels)
    if check.problem:
        return check
    if check.mode != "RGB" and not convert_modes:
        return ImageCheck(problem=f"image mode {_mode_name(check.mode)} is not accepted; it must be RGB (8-bit, "
                                  "3 channels, no alpha): re-save it as RGB, or set convert_modes "
                                  "(data.convert_modes) to convert it on load")
    w, h = check.size
    size = (h, w) if check.orientation in _ROTATED_ORIENTATIONS else (w, h)
    if min(size) < min_side:
        return ImageCheck(problem=f"{size[0]}x{size[1]} is too small; accepted: at least {min_side} px on each side")
    return replace(check, size=size)


def check_image(path: Path, *, min_side: int, max_pixels: int,
                convert_modes: bool) -> tuple[tuple[int, int] | None, str | None]:
    """((w, h) as displayed, None) for a usable image, else (None, what is wrong and what is accepted)."""
    check = inspect_image(path, min_side=min_side, max_pixels=max_pixels, convert_modes=convert_modes)
    return check.size, check.problem



def _high_depth_to_rgb(img: Image.Image) -> Image.Image:
    """16-bit (and 32-bit integer/float) greyscale -> 8-bit RGB. PIL's own convert("L") clips these instead of
    scaling them, which would turn most 16-bit images white."""
    import numpy as np

    values = np.asarray(img).astype(np.float64)
    if img.mode.startswith("I;16") or (img.mode == "I" and values.max(initial=0) > 255):
        values = values / 257.0  # 65535 -> 255
    grey = np.clip(np.rint(values), 0, 255).astype(np.uint8)
    return Image.fromarray(grey, mode="L").convert("RGB")


def _to_rgb(img: Image.Image, path, convert_modes: bool) -> Image.Image:
    if img.mode == "RGB":
        return img
    if not convert_modes:
        raise ValueError(f"{path}: image mode {_mode_name(img.mode)} is not RGB; re-save it as RGB or set "
                         "convert_modes (data.convert_modes) to convert it on load")
    log.debug("%s: converting mode %s to RGB", path, img.mode)
    if img.mode in _ALPHA_MODES or "transparency" in img.info:
        rgba = img.convert("RGBA")
        white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(white, rgba).convert("RGB")
    if img.mode in ("I", "F") or img.mode.startswith("I;16"):
        return _high_depth_to_rgb(img)
    return img.convert("RGB")


def load_rgb(path, convert_modes: bool = False) -> Image.Image:
    """The one way every stage opens a dataset image: EXIF orientation applied (the image as displayed), RGB.

    Non-RGB images raise ValueError unless `convert_modes`: then transparency is composited on white and
    16-bit images are scaled to 8 bits.
    """
    with open_bounded(path) as img:
        img = ImageOps.exif_transpose(img)  # a new, loaded image: the file can close
    return _to_rgb(img, path, convert_modes)
