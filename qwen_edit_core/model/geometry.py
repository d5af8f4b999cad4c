"""Pipeline geometry: the (w, h) an image is resized to at a pixel area (shared by encoding, data and sampling)."""

from __future__ import annotations

import contextlib
import logging
import math
import warnings

log = logging.getLogger(__name__)

#: The one set of image limits for training and sampling: every side of an input image (target, control) at
#: least MIN_SIDE px, at most MAX_PIXELS pixels; an output size is rounded down to SIZE_MULTIPLE (the VAE's 8x
#: downscale times the transformer's 2x2 patch), and each rounding is logged with its before and after size.
MIN_SIDE = 64
MAX_PIXELS = 64_000_000
SIZE_MULTIPLE = 16
#: the longest side a size may have (an image of MIN_SIDE by this is MAX_PIXELS) and the most sampling steps
MAX_SIDE = MAX_PIXELS // MIN_SIDE
MAX_STEPS = 1000


def size_problem(width: int | None, height: int | None) -> str | None:
    """Why an output size typed by a user (either side may be left to the default) is over the image limits,
    or None."""
    for name, value in (("width", width), ("height", height)):
        if value is not None and value > MAX_SIDE:
            return f"{name}={value} is over {MAX_SIDE} px (the image limit is {MAX_PIXELS} pixels)"
    if width is not None and height is not None and width * height > MAX_PIXELS:
        return f"{width}x{height} is {width * height} pixels, over the {MAX_PIXELS} pixel limit"
    return None


@contextlib.contextmanager
def open_bounded(path, what: str = "image"):
    """PIL's lazy open of `path` with the image limit checked from its header, before any pixel is decoded: a
    ValueError naming the file when it is over MAX_PIXELS (PIL's own decompression-bomb error included)."""
    from PIL import Image
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", Image.DecompressionBombWarning)  # our limit below is the lower one
        try:
            img = Image.open(path)
        except Image.DecompressionBombError as err:
            raise ValueError(f"{what} {str(path)!r} is refused before decoding: {err}; accepted: at most "
                             f"{MAX_PIXELS} pixels") from None
    with img:
        w, h = img.size
        if w * h > MAX_PIXELS:
            raise ValueError(f"{what} {str(path)!r} is {w}x{h}, {w * h} pixels, refused before decoding "
                             f"(decompression bomb guard); accepted: at most {MAX_PIXELS} pixels")
        yield img


def check_image_size(size_wh: tuple[int, int], what: str) -> None:
    """ValueError when an input image is outside the limits (the same rule the dataset applies)."""
    w, h = size_wh
    if min(w, h) < MIN_SIDE:
        raise ValueError(f"{what} is {w}x{h}, too small; accepted: at least {MIN_SIDE} px on each side")
    if w * h > MAX_PIXELS:
        raise ValueError(f"{what} is {w}x{h}, too large; accepted: at most {MAX_PIXELS} pixels")


def round_output_size(width: int, height: int, what: str = "output") -> tuple[int, int]:
    """(width, height) rounded down to SIZE_MULTIPLE; the rounding, if any, is logged with both sizes."""
    rounded = (width // SIZE_MULTIPLE * SIZE_MULTIPLE, height // SIZE_MULTIPLE * SIZE_MULTIPLE)
    if rounded != (width, height):
        log.info("%s size %dx%d rounded down to %dx%d (a multiple of %d px)", what, width, height, *rounded,
                 SIZE_MULTIPLE)
    return rounded



def calculate_dimensions(area: int, ratio: float) -> tuple[int, int]:
    """(w, h) at pixel `area` for aspect `ratio` = w / h, sides rounded to multiples of 32 with Python's round(),
    exactly as diffusers' qwenimage `calculate_dimensions`."""
    width = math.sqrt(area * ratio)
    return round(width / 32) * 32, round(width / ratio / 32) * 32


def bucket_for(size_wh: tuple[int, int], area: int) -> tuple[int, int]:
    """The bucket (w, h) of an image of `size_wh` at a fixed pixel `area`: exactly the size the sampler uses."""
    return calculate_dimensions(area, size_wh[0] / size_wh[1])
