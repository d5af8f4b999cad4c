"""What the checks need of one pair, measured once from its pictures and cached by their content hashes.

The registration of target onto control runs on gradient magnitude (skimage.filters.sobel of the luma), which an
edit that recolours (inverts, greys, restyles) leaves in place: the translation is scikit-image's phase correlation
(`skimage.registration.phase_cross_correlation`), the zoom the best of a few scales around 1 by normalised
correlation once that translation is taken out.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, fields
from typing import Optional

import numpy as np
from PIL import Image
from skimage.filters import sobel
from skimage.registration import phase_cross_correlation

from qwen_edit_core.data.doctor.pictures import PairPictures, Picture, luminance, resized

#: bump when a measure changes meaning: cached measures of another version are measured again
VERSION = 3
#: zooms tried between control and target (then refined by a parabola through the best and its neighbours)
SCALES = (0.92, 0.96, 1.0, 1.04, 1.08)
#: correlation at zoom 1 from which the structure already matches: no zoom is searched
MATCHED = 0.995
_LUMA_BINS = 8
#: a pixel's mean over its channels, in 8-bit levels, as one product (reducing the channel axis is slow)
_MEAN_LEVELS = np.full(3, 255 / 3, dtype=np.float32)


@dataclass(frozen=True)
class Measures:
    """One pair's measurements (JSON-able: the doctor's cache holds them by the pair's content key)."""
    target_size: tuple[int, int]
    control_sizes: tuple[tuple[int, int], ...]
    target_features: tuple[float, ...]
    control_features: tuple[float, ...]  # of the source control, the picture the edit starts from
    hashes: tuple[int, ...]  # perceptual hashes: the target, then each control in order
    shift: tuple[float, float]  # (dx, dy) of the target's content against the source, in the target's pixels
    scale: float  # the target's zoom against the source control (1.05: zoomed in by 5 %)
    aligned_ncc: float  # gradient correlation once shift and zoom are taken out (1: same structure)
    change: float  # mean |target - source control|, in 8-bit levels
    reference_ncc: tuple[float, ...]  # the target's `block_similarity` with each control, in control order
    source: int  # index of the control the target resembles most (the one the edit starts from)
    mask_area: Optional[float] = None  # fraction of the target the mask marks as edited
    change_inside: Optional[float] = None  # mean |target - source| inside the mask, 8-bit levels
    change_outside: Optional[float] = None

    def as_dict(self) -> dict:
        """The fields by name (shallow: every value is already a number, tuple or None; `asdict`'s deep copy of
        each one costs as much as a measurement)."""
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @classmethod
    def from_dict(cls, data: dict) -> "Measures":
        tuples = {"target_size", "control_features", "target_features", "hashes", "shift", "reference_ncc"}
        values = {k: tuple(v) if k in tuples else v for k, v in data.items()}
        values["control_sizes"] = tuple(tuple(s) for s in data["control_sizes"])
        return cls(**values)


#: the luma quantiles the features keep
_QUANTILES = np.array([0.05, 0.25, 0.5, 0.75, 0.95])
#: the luma histogram's inner bin edges (values in [0, 1], the last bin closed)
_BIN_EDGES = np.arange(1, _LUMA_BINS, dtype=np.float32) / _LUMA_BINS


#: the features that are levels of the picture (channel means, luma quantiles, sorted channels' means, the 2x2 luma
#: grid), in [0, 1]: two encodes of one picture agree on them within a few 8-bit levels
LEVEL_FEATURES = (0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22)


def features(rgb: np.ndarray, luma: np.ndarray, edges: np.ndarray) -> np.ndarray:
    """A cheap description of a picture (24 numbers) the edit moves consistently: channel means, luma quantiles and
    histogram, the sorted channels' means (saturation), a 2x2 grid of luma and the gradient energy (`luma` is the
    picture's `luminance`, `edges` its gradient magnitude). Few whole-array passes: a small picture's cost is the
    number of numpy calls, not its pixels."""
    h, w = (luma.shape[0] // 2) * 2, (luma.shape[1] // 2) * 2
    ranked = np.sort(luma, axis=None)
    quantiles = ranked[(_QUANTILES * (ranked.size - 1)).astype(np.int64)]
    below = np.searchsorted(ranked, _BIN_EDGES, side="left")  # values under each edge: the histogram's sums
    histogram = np.diff(below, prepend=0, append=ranked.size) / ranked.size
    # channel planes: numpy reduces the 3 interleaved channels of each pixel ten times slower than whole rows
    planes = np.ascontiguousarray(rgb.reshape(-1, 3).T)
    means = planes.mean(axis=1)
    high = np.maximum(np.maximum(planes[0], planes[1]), planes[2]).mean()
    low = np.minimum(np.minimum(planes[0], planes[1]), planes[2]).mean()
    ordered = [low, means.sum() - high - low, high]  # the lowest, middle and highest channel's means
    grid = luma[:h, :w].reshape(2, h // 2, 2, w // 2).mean(axis=(1, 3)).ravel()
    return np.concatenate([means, quantiles, histogram, ordered, grid, [edges.mean()]])


@functools.lru_cache(maxsize=64)
def _low_dct(n: int) -> np.ndarray:
    """The 8 lowest-frequency rows of the DCT-II of length n (8, n)."""
    k, i = np.arange(8)[:, None], np.arange(n)[None, :]
    return (np.cos(np.pi * (2 * i + 1) * k / (2 * n)) / n).astype(np.float32)


def perceptual_hash(luma: np.ndarray) -> int:
    """A 64-bit DCT hash (pHash) of a picture's `luminance`: the 8x8 lowest frequencies, each bit above their
    median (taken on the analysis-size luma directly: its lowest frequencies are the downscaled picture's).
    Re-encoding, faint noise and small resizes change a few bits; another picture about half of them."""
    coefficients = (_low_dct(luma.shape[0]) @ luma @ _low_dct(luma.shape[1]).T).ravel()
    bits = coefficients > np.median(coefficients[1:])
    return int(np.packbits(bits).view(">u8")[0])


def gradient(rgb: np.ndarray) -> np.ndarray:
    """Gradient magnitude of the luma: where the structure is, whatever the colours."""
    return sobel(luminance(rgb))


def ncc(a: np.ndarray, b: np.ndarray) -> float:
    """Normalised correlation of two arrays of one shape (1: equal up to brightness and contrast)."""
    a, b = a - a.mean(), b - b.mean()
    denominator = float(np.sqrt((a * a).sum() * (b * b).sum()))
    return float((a * b).sum() / denominator) if denominator > 0 else 0.0


def block_similarity(a: np.ndarray, b: np.ndarray, blocks: int = 4) -> float:
    """The median over a `blocks` x `blocks` grid of |normalised correlation| of two lumas of one shape: 1 when each
    block shows the same structure, whatever was recoloured or inverted in it (a local edit spoils a few blocks
    only, the median ignores them); about 0.2 for unrelated pictures."""
    h, w = (a.shape[0] // blocks) * blocks, (a.shape[1] // blocks) * blocks

    def tiles(x: np.ndarray) -> np.ndarray:
        x = x[:h, :w].reshape(blocks, h // blocks, blocks, w // blocks).transpose(0, 2, 1, 3)
        x = x.reshape(blocks * blocks, -1)
        return x - x.mean(axis=1, keepdims=True)

    ta, tb = tiles(a), tiles(b)
    denominator = np.sqrt((ta * ta).sum(axis=1) * (tb * tb).sum(axis=1))
    correlation = np.abs((ta * tb).sum(axis=1)) / np.maximum(denominator, 1e-12)
    return float(np.median(np.where(denominator > 1e-9, correlation, 0.0)))


def _warped(moving: np.ndarray, scale: float, shift_rc: np.ndarray) -> np.ndarray:
    """`moving` sampled at scale * (p - centre) + centre - shift for each pixel p: the target on the control's grid."""
    h, w = moving.shape
    cx, cy = w / 2, h / 2
    data = (scale, 0.0, cx - scale * cx - shift_rc[1], 0.0, scale, cy - scale * cy - shift_rc[0])
    image = Image.fromarray(np.ascontiguousarray(moving, dtype=np.float32), mode="F")
    return np.asarray(image.transform((w, h), Image.AFFINE, data, resample=Image.BILINEAR))


def _centre(a: np.ndarray) -> np.ndarray:
    h, w = a.shape
    return a[h // 8: h - h // 8, w // 8: w - w // 8]


def _best_scale(reference: np.ndarray, moving: np.ndarray, shift: np.ndarray, scales) -> tuple[float, float]:
    """(the zoom among `scales` (evenly spaced) that best correlates the centres, refined by a parabola through the
    best score and its two neighbours; that best score)."""
    scores = [ncc(_centre(reference), _centre(_warped(moving, s, shift))) for s in scales]
    best = int(np.argmax(scores))
    scale = float(scales[best])
    if 0 < best < len(scales) - 1:
        left, mid, right = scores[best - 1], scores[best], scores[best + 1]
        curvature = left - 2 * mid + right
        if curvature < 0:
            scale += float(np.clip(0.5 * (left - right) / curvature, -0.5, 0.5)) * (scales[1] - scales[0])
    return scale, scores[best]


def _shift(reference: np.ndarray, moving: np.ndarray, scale: float, upsample: int) -> np.ndarray:
    """The phase correlation's shift of `moving` zoomed by `scale` onto `reference`."""
    zoomed = moving if scale == 1.0 else _warped(moving, scale, np.zeros(2))
    shift, _, _ = phase_cross_correlation(reference, zoomed, upsample_factor=upsample, normalization="phase")
    return np.asarray(shift, dtype=float)


def register(reference: np.ndarray, moving: np.ndarray, upsample: int = 1,
             rounds: int = 1) -> tuple[np.ndarray, float, float]:
    """(shift (row, col) that registers `moving` onto `reference`, zoom of `moving`, correlation once aligned), both
    gradient maps of one shape. Each of `rounds` searches the zoom on a grid three times finer around the last one
    and measures the translation again (1 round: about 1/100 of zoom, enough to flag; 3: for realigning)."""
    shift = _shift(reference, moving, 1.0, upsample)
    scales, scale = np.asarray(SCALES), 1.0
    score = ncc(_centre(reference), _centre(_warped(moving, 1.0, shift)))
    for _ in range(rounds if score < MATCHED else 0):
        scale, score = _best_scale(reference, moving, shift, scales)
        if abs(scale - 1) > 1e-3:
            shift = _shift(reference, moving, scale, upsample)
        step = (scales[1] - scales[0]) / 3
        scales = scale + step * np.arange(-3, 4)
    aligned = ncc(_centre(reference), _centre(_warped(moving, scale, shift)))
    return shift, scale, max(aligned, score)


def _mask_change(diff: np.ndarray, mask: Picture) -> tuple[float, float, float]:
    """(area, mean change inside, mean change outside) of a mask over a per-pixel change map."""
    inside = resized(mask.pixels, (diff.shape[1], diff.shape[0])) >= 0.5
    area = float(inside.mean())
    mean = lambda where: float(diff[where].mean()) if where.any() else 0.0  # noqa: E731
    return area, mean(inside), mean(~inside)


def measure(pair: PairPictures) -> Measures:
    """Every measurement of one pair, on the target's analysis grid: each picture's luma computed once, gradients
    only for the target and the control it was made from."""
    target = pair.target.pixels
    grid = (target.shape[1], target.shape[0])
    controls = [resized(c.pixels, grid) for c in pair.controls]
    target_luma = luminance(target)
    lumas = [luminance(c) for c in controls]
    similarity = tuple(block_similarity(luma, target_luma) for luma in lumas)
    source = int(np.argmax(similarity))  # the control the target was made from: the one it resembles most
    first = controls[source]
    target_gradient, source_gradient = sobel(target_luma), sobel(lumas[source])
    shift, scale, aligned = register(source_gradient, target_gradient)
    to_target_pixels = pair.target.size[0] / grid[0]
    diff = np.abs(target - first) @ _MEAN_LEVELS  # mean over the channels, in 8-bit levels
    mask = _mask_change(diff, pair.mask) if pair.mask is not None else (None, None, None)
    return Measures(
        target_size=pair.target.size, control_sizes=tuple(c.size for c in pair.controls),
        target_features=tuple(features(target, target_luma, target_gradient).tolist()),
        control_features=tuple(features(first, lumas[source], source_gradient).tolist()),
        hashes=(perceptual_hash(target_luma), *(perceptual_hash(luma) for luma in lumas)),
        # the phase correlation's shift registers the target: its content moved the other way
        shift=(float(-shift[1] * to_target_pixels) + 0.0, float(-shift[0] * to_target_pixels) + 0.0), scale=scale,
        aligned_ncc=aligned, change=float(diff.mean()),
        reference_ncc=similarity, source=source,
        mask_area=mask[0], change_inside=mask[1], change_outside=mask[2])
