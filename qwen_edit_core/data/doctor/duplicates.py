"""Duplicates and leaks: pairs whose target and edited control have (nearly) the same perceptual hashes as an
earlier pair's, and held-out pairs that (nearly) repeat a training pair, which makes their metric meaningless.

Among thousands of pairs, unrelated pictures of a similar layout come within the hash threshold by chance; a
candidate is kept only when its pictures' levels (`measure.LEVEL_FEATURES`: colour means, luma quantiles, a 2x2
grid) also agree within `DoctorSettings.duplicate_levels`."""

from __future__ import annotations

import numpy as np

from qwen_edit_core.data.doctor.findings import CheckResult, DoctorSettings, Finding, Measured
from qwen_edit_core.data.doctor.measure import LEVEL_FEATURES

_CHUNK = 512


def _signature(pair: Measured) -> tuple[int, int]:
    """(target hash, the edited control's hash)."""
    m = pair.measures
    return m.hashes[0], m.hashes[1 + m.source]


def _levels(pair: Measured) -> np.ndarray:
    """The levels of the pair's target and edited control, in 8-bit levels."""
    m = pair.measures
    levels = [np.take(m.target_features, LEVEL_FEATURES), np.take(m.control_features, LEVEL_FEATURES)]
    return np.concatenate(levels) * 255


def _gap(a: Measured, b: Measured) -> float:
    """The largest difference between two pairs' levels, in 8-bit levels."""
    return float(np.abs(_levels(a) - _levels(b)).max())


def _alike(pair: Measured, others: list[Measured], candidates: np.ndarray, levels: float) -> np.ndarray:
    """The `candidates` (indices into `others`) whose levels agree with `pair`'s within `levels` everywhere."""
    return np.array([k for k in candidates if _gap(pair, others[k]) <= levels], dtype=np.int64)


def distances(rows: list[Measured], columns: list[Measured]):
    """Yield (row index, the 128-bit hash distances to every column) in chunks of rows (10,000 pairs: 10^8 pairs)."""
    a = np.array([_signature(p) for p in rows], dtype=np.uint64).reshape(-1, 2)
    b = np.array([_signature(p) for p in columns], dtype=np.uint64).reshape(-1, 2)
    for start in range(0, len(a), _CHUNK):
        chunk = a[start:start + _CHUNK]
        bits = (np.bitwise_count(chunk[:, None, 0] ^ b[None, :, 0]).astype(np.int16)
                + np.bitwise_count(chunk[:, None, 1] ^ b[None, :, 1]))
        for offset, row in enumerate(bits):
            yield start + offset, row


def check(pairs: list[Measured], held: list[Measured], settings: DoctorSettings) -> CheckResult:
    result = CheckResult()
    ordered = sorted(pairs, key=lambda p: p.name)
    limit = settings.duplicate_bits
    if len(ordered) > 1:
        for i, row in distances(ordered, ordered):
            earlier = _alike(ordered[i], ordered, np.flatnonzero(row[:i] <= limit), settings.duplicate_levels)
            if earlier.size:
                j = int(earlier[np.argmin(row[earlier])])
                bits = int(row[j])
                result.findings.append(Finding(
                    ordered[i].name, "duplicate", bits, f"drop the pair (it repeats {ordered[j].name})",
                    f"its target and control match {ordered[j].name}'s within {bits} of 128 perceptual-hash bits "
                    f"and {_gap(ordered[i], ordered[j]):.1f} levels",
                    severity=0.7 - bits / 256))
    if held and ordered:
        for i, row in distances(held, ordered):
            near = _alike(held[i], ordered, np.flatnonzero(row <= limit), settings.duplicate_levels)
            if near.size:
                j = int(near[np.argmin(row[near])])
                result.findings.append(Finding(
                    held[i].name, "leak", int(row[j]), f"hold out another pair (this one is trained on as "
                                                       f"{ordered[j].name})",
                    f"this held-out pair matches training pair {ordered[j].name} within {int(row[j])} of 128 "
                    f"perceptual-hash bits and {_gap(held[i], ordered[j]):.1f} levels: its validation metric "
                    "measures memory", severity=0.95))
    return result
