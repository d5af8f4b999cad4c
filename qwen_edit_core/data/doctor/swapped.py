"""Swapped pairs: a pair whose change points against the dataset's common direction.

Each picture is described by `measure.features`; a pair's change is its target's description minus its control's,
each number scaled by its spread over the dataset. The common direction is the mean of the pairs' unit changes; its
length R (0: the changes point anywhere, 1: all the same way) says whether the edit has one. A pair whose change
has a cosine below `THRESHOLD` with the mean of the other pairs' is flagged, the cosine as its figure.
"""

from __future__ import annotations

import numpy as np

from qwen_edit_core.data.doctor.findings import CheckResult, DoctorSettings, Finding, Measured

#: the least R for the dataset to have a direction to judge by (local object edits score about 0.1 to 0.3)
MIN_DIRECTION = 0.4
#: cosine to the others' direction below which a pair is flagged as swapped
THRESHOLD = -0.2
MIN_PAIRS = 6


def check(pairs: list[Measured], settings: DoctorSettings) -> CheckResult:
    result = CheckResult()
    if len(pairs) < MIN_PAIRS:
        result.notes.append(f"swapped pairs not checked: {len(pairs)} pairs are too few to find the edit's "
                            f"direction (at least {MIN_PAIRS})")
        return result
    controls = np.array([p.measures.control_features for p in pairs])
    targets = np.array([p.measures.target_features for p in pairs])
    spread = np.concatenate([controls, targets]).std(axis=0) + 1e-6
    changes = (targets - controls) / spread
    norms = np.linalg.norm(changes, axis=1, keepdims=True)
    units = changes / np.maximum(norms, 1e-9)
    strength = float(np.linalg.norm(units.mean(axis=0)))
    result.stats["direction"] = round(strength, 3)
    if strength < MIN_DIRECTION:
        result.notes.append(f"no common edit direction (R = {strength:.2f} < {MIN_DIRECTION}: the pairs change in "
                            "different ways, as local object edits do); swapped pairs not judged")
        return result
    total = units.sum(axis=0)
    for pair, unit in zip(pairs, units):
        others = total - unit
        cosine = float(unit @ others / max(np.linalg.norm(others), 1e-9))
        if cosine < THRESHOLD:
            result.findings.append(Finding(
                pair.name, "swapped", round(cosine, 3), "swap the control and the target",
                f"its change points against the dataset's edit (cosine {cosine:.2f} to the other pairs' mean "
                f"change, R = {strength:.2f}); confidence {(1 - cosine) / 2:.0%}", severity=(1 - cosine) / 2))
    return result
