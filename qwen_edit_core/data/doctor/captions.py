"""Captions: captions that differ from others only by a generator's trailing noise (a seed, a number, a hash),
captions naming a reference the pair does not have ("image 3" with two controls), and captions far longer than the
dataset's usual one (the dataset reader already refuses empty ones and, given the tokenizer, too long ones)."""

from __future__ import annotations

import re
from collections import Counter

import numpy as np

from qwen_edit_core.data.doctor.findings import CheckResult, DoctorSettings, Finding, Measured

_TRAILING_NOISE = re.compile(r"(?:[\s,;:|#()\[\]._-]*(?:seed\s*[:=]?\s*\d+|\d+|[0-9a-f]{8,}))+[\s.,;:]*$",
                             re.IGNORECASE)
_NAMED_IMAGE = re.compile(r"\b(?:image|picture|reference|ref|img|pic)\s*#?\s*(\d+)\b", re.IGNORECASE)
#: a caption with more words than this many times the dataset's median (and over LONG_WORDS) is flagged
LONG_FACTOR, LONG_WORDS = 5, 60


def core(caption: str) -> str:
    """The caption without a trailing run of numbers, seeds or hashes."""
    return _TRAILING_NOISE.sub("", caption).strip()


def check(pairs: list[Measured], settings: DoctorSettings) -> CheckResult:
    result = CheckResult()
    captions = {p.name: p.example.caption for p in pairs}
    cores = Counter(core(c) for c in captions.values())
    words = [len(c.split()) for c in captions.values()]
    median = float(np.median(words)) if words else 0.0
    result.stats["caption_words"] = {"median": median, "max": max(words, default=0)}
    for p in pairs:
        caption = captions[p.name]
        base = core(caption)
        if base != caption and base and cores[base] > 1:
            result.findings.append(Finding(p.name, "caption", caption[len(base):].strip(), f"caption: {base!r}",
                                           f"its caption differs from {cores[base] - 1} other(s) only by the "
                                           f"trailing {caption[len(base):].strip()!r}", severity=0.3))
        named = [int(n) for n in _NAMED_IMAGE.findall(caption)]
        controls = len(p.example.controls)
        if named and max(named) > controls:
            result.findings.append(Finding(p.name, "caption", max(named), None,
                                           f"its caption names image {max(named)} but the pair has {controls} "
                                           f"control image(s)", severity=0.6))
        n = len(caption.split())
        if n > LONG_WORDS and n > LONG_FACTOR * median:
            result.findings.append(Finding(p.name, "caption", n, None,
                                           f"its caption has {n} words, the dataset's median {median:.0f}",
                                           severity=0.3))
    return result
