"""Controls and references: a multi-reference pair whose references are in another order than the rest of the
dataset's (which control the target resembles most, pair by pair), a control identical or nearly identical to the
target (nothing to learn), a reference that copies another, and a reference of a wildly different aspect."""

from __future__ import annotations

from collections import Counter

import numpy as np

from qwen_edit_core.data.doctor.findings import CheckResult, DoctorSettings, Finding, Measured

#: the share of multi-reference pairs that must agree on the slot of the edited picture before others are judged
MIN_AGREEMENT = 0.6
#: how much more the target must resemble another slot than the usual one (block similarity, 0 to 1)
MIN_MARGIN = 0.25
#: mean change below which a pair shows nothing to learn: 8-bit levels, or this share of the dataset's median change
NO_CHANGE_LEVELS, NO_CHANGE_SHARE = 1.0, 0.05
COPY_BITS = 4
ASPECT_FACTOR = 2.0


def _reference_order(pairs: list[Measured], result: CheckResult) -> int | None:
    """Flag the multi-reference pairs whose target resembles another slot than the usual one; returns the usual
    slot (None when there is none)."""
    multi = [p for p in pairs if len(p.measures.reference_ncc) > 1]
    if len(multi) < 3:
        return None
    slots = Counter(p.measures.source for p in multi)
    usual, count = slots.most_common(1)[0]
    result.stats["edited_slot"] = {f"control {k + 1}": n for k, n in sorted(slots.items())}
    if count / len(multi) < MIN_AGREEMENT:
        result.notes.append(f"references: no usual slot for the edited picture ({dict(slots)}); order not judged")
        return None
    for p in multi:
        sims, source = p.measures.reference_ncc, p.measures.source
        if usual >= len(sims) or source == usual or sims[source] - sims[usual] < MIN_MARGIN:
            continue
        order = list(range(1, len(sims) + 1))
        order[usual], order[source] = order[source], order[usual]
        result.findings.append(Finding(
            p.name, "reference-order", [round(s, 3) for s in sims],
            "reorder the controls: " + ", ".join(map(str, order)),
            f"its target resembles control {source + 1} (similarity {sims[source]:.2f}) more than control "
            f"{usual + 1} ({sims[usual]:.2f}), where {count} of {len(multi)} pairs have the edited picture",
            severity=0.8))
    return usual


def _no_change(pairs: list[Measured], usual: int | None, result: CheckResult) -> None:
    """Flag the pairs whose target hardly differs from the control it resembles most: nothing to learn, or, when
    that control sits in another slot than the dataset's `usual` edited one, a reference that copies the target."""
    median = float(np.median([p.measures.change for p in pairs]))
    limit = max(NO_CHANGE_LEVELS, NO_CHANGE_SHARE * median)
    for p in pairs:
        m = p.measures
        if m.change >= limit:
            continue
        if usual is not None and len(m.reference_ncc) > 1 and m.source != usual:
            result.findings.append(Finding(
                p.name, "duplicate", round(m.change, 3), f"replace control {m.source + 1} (a copy of the target)",
                f"control {m.source + 1} differs from the target by {m.change:.2f} levels on average: a copy of "
                f"the target among the references, not the picture control {usual + 1} edits", severity=0.85))
            continue
        result.findings.append(Finding(
            p.name, "no-change", round(m.change, 3), "drop the pair",
            f"its target differs from control {m.source + 1} by {m.change:.2f} levels on average (the dataset's "
            f"median pair: {median:.1f}): nothing to learn", severity=0.9))


def _copies_and_aspects(pair: Measured, result: CheckResult) -> None:
    """Flag a control that copies another control or the target (the one the edit starts from excepted: an
    unchanged pair is `_no_change`'s), and a control of a wildly different aspect than the pair's others."""
    hashes, sizes = pair.measures.hashes[1:], pair.measures.control_sizes
    for k, code in enumerate(hashes):
        bits = bin(pair.measures.hashes[0] ^ code).count("1")
        if k != pair.measures.source and len(hashes) > 1 and bits <= COPY_BITS:
            result.findings.append(Finding(pair.name, "duplicate", bits, f"replace control {k + 1} (a copy of the "
                                           "target)", f"control {k + 1} is a copy of the target ({bits} of 64 hash "
                                           "bits differ): the answer is among the references", severity=0.85))
    for k in range(1, len(hashes)):
        for j in range(k):
            bits = bin(hashes[j] ^ hashes[k]).count("1")
            if bits <= COPY_BITS:
                result.findings.append(Finding(pair.name, "duplicate", bits, f"drop control {k + 1}",
                                               f"control {k + 1} is a copy of control {j + 1} ({bits} of 64 hash "
                                               "bits differ)", severity=0.6))
                break
    aspects = np.log([w / h for w, h in (pair.measures.target_size, *sizes)])
    typical = float(np.median(aspects))
    for k, aspect in enumerate(aspects[1:]):
        if abs(aspect - typical) > np.log(ASPECT_FACTOR):
            w, h = sizes[k]
            result.findings.append(Finding(pair.name, "size", round(float(np.exp(aspect - typical)), 3), None,
                                           f"control {k + 1} is {w}x{h}, {np.exp(aspect - typical):.2f} times "
                                           "the aspect of its pair's other pictures", severity=0.4))


def check(pairs: list[Measured], settings: DoctorSettings) -> CheckResult:
    result = CheckResult()
    if not pairs:
        return result
    usual = _reference_order(pairs, result)
    _no_change(pairs, usual, result)
    for pair in pairs:
        _copies_and_aspects(pair, result)
    return result
