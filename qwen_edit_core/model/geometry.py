"""Pipeline geometry: the (w, h) an image is resized to at a pixel area (shared by encoding, data and sampling)."""

from __future__ import annotations

import math



def calculate_dimensions(area: int, ratio: float) -> tuple[int, int]:
    """(w, h) at pixel `area` for aspect `ratio` = w / h, sides rounded to multiples of 32 with Python's round(),
    exactly as diffusers' qwenimage `calculate_dimensions`."""
    width = math.sqrt(area * ratio)
    return round(width / 32) * 32, round(width / ratio / 32) * 32


def bucket_for(size_wh: tuple[int, int], area: int) -> tuple[int, int]:
    """The bucket (w, h) of an image of `size_wh` at a fixed pixel `area`: exactly the size the sampler uses."""
    return calculate_dimensions(area, size_wh[0] / size_wh[1])
