"""Sizes: pictures upscaled by more than `max_upscale` per side to reach the training area, controls of another
aspect than their target (the bucketing would distort one of them), and the buckets' fill (a bucket of one pair
never fills a batch)."""

from __future__ import annotations

import math
from collections import Counter

from qwen_edit_core.data.doctor.findings import CheckResult, DoctorSettings, Finding, Measured
from qwen_edit_core.model.geometry import bucket_for

#: controls whose aspect differs from the target's by more than this fraction are flagged
ASPECT_TOLERANCE = 0.05


def check(pairs: list[Measured], settings: DoctorSettings) -> CheckResult:
    result = CheckResult()
    for p in pairs:
        m = p.measures
        (tw, th), (cw, ch) = m.target_size, m.control_sizes[m.source]
        ratio = (cw / ch) / (tw / th)
        if abs(ratio - 1) > ASPECT_TOLERANCE:
            result.findings.append(Finding(p.name, "size", round(ratio, 3), f"crop control {m.source + 1} to the "
                                           "target's aspect", f"control {m.source + 1} is {cw}x{ch} but the target "
                                           f"{tw}x{th} (aspect ratio {ratio:.2f}): one of them is distorted in its "
                                           "bucket", severity=0.5))
        if settings.area:
            factor = math.sqrt(settings.area / (tw * th))
            if factor > settings.max_upscale:
                result.findings.append(Finding(p.name, "size", round(factor, 2), None,
                                               f"its target ({tw}x{th}) is upscaled {factor:.1f} times per side to "
                                               f"reach the training area {settings.area} (limit "
                                               f"{settings.max_upscale:g})", severity=0.3))
    if settings.area and pairs:
        buckets = {p.name: bucket_for(p.measures.target_size, settings.area) for p in pairs}
        fill = Counter(buckets.values())
        result.stats["buckets"] = {f"{w}x{h}": n for (w, h), n in fill.most_common()}
        result.notes.append("buckets: " + ", ".join(f"{w}x{h}: {n}" for (w, h), n in fill.most_common(8))
                            + (" ..." if len(fill) > 8 else ""))
        if settings.batch_size > 1:
            for name, bucket in buckets.items():
                if fill[bucket] < settings.batch_size:
                    result.findings.append(Finding(name, "size", fill[bucket], None,
                                                   f"its bucket {bucket[0]}x{bucket[1]} holds {fill[bucket]} pair(s), "
                                                   f"fewer than a batch of {settings.batch_size}", severity=0.2))
    return result
