"""Masks: a mask whose region misses where the pair actually changed (more change outside it than inside), or that
marks nothing."""

from __future__ import annotations

from qwen_edit_core.data.doctor.findings import CheckResult, DoctorSettings, Finding, Measured

#: the inverted mask is proposed when it would hold at least this share of the pair's change
INVERT_SHARE = 0.8


def check(pairs: list[Measured], settings: DoctorSettings) -> CheckResult:
    result = CheckResult()
    for p in pairs:
        m = p.measures
        if m.mask_area is None:
            continue
        if m.mask_area <= 0:
            result.findings.append(Finding(p.name, "mask", 0.0, "paint the edited region, or remove the mask",
                                           "its mask marks nothing at the training size", severity=0.8))
            continue
        inside, outside = m.change_inside * m.mask_area, m.change_outside * (1 - m.mask_area)
        share = outside / max(inside + outside, 1e-9)
        if m.change_outside <= m.change_inside:
            continue
        fix = "invert the mask" if share >= INVERT_SHARE else "repaint the mask over the changed region"
        result.findings.append(Finding(
            p.name, "mask", round(share, 3), fix,
            f"{share:.0%} of the pair's change lies outside its mask (mean change {m.change_outside:.1f} levels "
            f"outside, {m.change_inside:.1f} inside, the mask covering {m.mask_area:.0%})", severity=0.5 + share / 2))
    return result
