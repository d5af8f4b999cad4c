"""Misaligned pairs: the target shifted or zoomed against the control it was made from, beyond the dataset's own
motion (the median over its pairs, which is not zero for an edit that moves things), measured by `measure.register`."""

from __future__ import annotations

import numpy as np

from qwen_edit_core.data.doctor.findings import CheckResult, DoctorSettings, Finding, Measured

SHIFT_BINS = (0, 1, 2, 4, 8, 16, 32)


def _histogram(values: np.ndarray, bins: tuple) -> dict[str, int]:
    """{"lo-hi": count} over `bins` edges, the last bin open."""
    edges = list(bins) + [np.inf]
    counts, _ = np.histogram(values, bins=edges)
    return {(f"{lo}-{hi}" if np.isfinite(hi) else f"{lo}+"): int(c) for lo, hi, c in zip(edges, edges[1:], counts)}


def check(pairs: list[Measured], settings: DoctorSettings) -> CheckResult:
    result = CheckResult()
    if not pairs:
        return result
    shifts = np.array([p.measures.shift for p in pairs], dtype=float)
    scales = np.array([p.measures.scale for p in pairs], dtype=float)
    usual_shift, usual_scale = np.median(shifts, axis=0), float(np.median(scales))
    sides = np.array([max(p.measures.target_size) for p in pairs], dtype=float)
    offsets = np.linalg.norm(shifts - usual_shift, axis=1)
    result.stats["shift_px"] = _histogram(np.linalg.norm(shifts, axis=1), SHIFT_BINS)
    result.stats["zoom_pct"] = _histogram(np.abs(scales - 1) * 100, (0, 1, 2, 5, 10))
    if np.linalg.norm(usual_shift) > 1 or abs(usual_scale - 1) > settings.zoom_tolerance:
        result.notes.append(f"the edit itself moves the picture (median shift {usual_shift[0]:.1f}, "
                            f"{usual_shift[1]:.1f} px, zoom {usual_scale:.3f}): pairs are judged against that")
    for pair, shift, scale, offset, side in zip(pairs, shifts, scales, offsets, sides):
        moved = offset > settings.shift_tolerance * side
        zoomed = abs(scale - usual_scale) > settings.zoom_tolerance
        if not (moved or zoomed):
            continue
        fix = (f"realign the target onto its control (shift {shift[0]:.0f}, {shift[1]:.0f} px, zoom {scale:.3f})"
               if settings.pixel_aligned else
               "re-export the target aligned with its control (--fix realigns it for pixel-aligned edits)")
        why = (f"its target is shifted by ({shift[0]:.1f}, {shift[1]:.1f}) px and zoomed by {scale:.3f} against its "
               f"control (dataset median ({usual_shift[0]:.1f}, {usual_shift[1]:.1f}) px, {usual_scale:.3f})")
        severity = min(1.0, max(offset / (0.1 * side), abs(scale - usual_scale) / 0.1))
        result.findings.append(Finding(pair.name, "misaligned",
                                       {"dx": round(float(shift[0]), 2), "dy": round(float(shift[1]), 2),
                                        "zoom": round(float(scale), 4)}, fix, why, severity=severity))
    return result
