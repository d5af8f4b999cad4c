"""Captions: captions that differ from others only by a generator's trailing noise (a seed, a number, a hash),
captions naming a reference the pair does not have ("image 3" with two controls), captions far longer than the
dataset's usual one, and captions with no instruction for the template's slot (nothing but numbers, seeds or
punctuation: the dataset reader refuses only blank ones). Given the text encoder's tokenizer (`count_tokens`), each
caption's tokens are counted against the encoder's limit (`templates.MAX_SEQUENCE_LENGTH`); without one, a note says
the lengths were not checked.
"""

from __future__ import annotations

import re
from collections import Counter

import numpy as np

from typing import Callable, Optional

from qwen_edit_core.data.doctor.findings import CheckResult, DoctorSettings, Finding, Measured
from qwen_edit_core.families.templates import MAX_SEQUENCE_LENGTH

_TRAILING_NOISE = re.compile(r"(?:[\s,;:|#()\[\]._-]*(?:seed\s*[:=]?\s*\d+|\d+|[0-9a-f]{8,}))+[\s.,;:]*$",
                             re.IGNORECASE)
_NAMED_IMAGE = re.compile(r"\b(?:image|picture|reference|ref|img|pic)\s*#?\s*(\d+)\b", re.IGNORECASE)
#: a caption with more words than this many times the dataset's median (and over LONG_WORDS) is flagged
LONG_FACTOR, LONG_WORDS = 5, 60
#: a letter of any script: an instruction holds at least one
_LETTER = re.compile(r"[^\W\d_]")
NO_TOKENIZER = ("caption token lengths not checked: no tokenizer was available (give the model directory or the "
                "training config to read it from; nothing is downloaded)")


def core(caption: str) -> str:
    """The caption without a trailing run of numbers, seeds or hashes."""
    return _TRAILING_NOISE.sub("", caption).strip()


def _tokens(pairs: list[Measured], count_tokens: Optional[Callable[[str], int]], result: CheckResult) -> dict:
    """{pair name: its caption's tokens} (empty without `count_tokens`: a note says so); a finding for each caption
    over the text encoder's limit, the lengths' median and maximum in the stats."""
    if count_tokens is None:
        result.notes.append(NO_TOKENIZER)
        return {}
    tokens = {p.name: count_tokens(p.example.caption) for p in pairs}
    values = list(tokens.values())
    result.stats["caption_tokens"] = {"median": float(np.median(values)) if values else 0.0,
                                      "max": max(values, default=0), "limit": MAX_SEQUENCE_LENGTH}
    for name, n in tokens.items():
        if n > MAX_SEQUENCE_LENGTH:
            result.findings.append(Finding(name, "caption", n, f"shorten it to at most {MAX_SEQUENCE_LENGTH} tokens",
                                           f"its caption is {n} tokens, over the text encoder's {MAX_SEQUENCE_LENGTH}: "
                                           "it cannot be encoded", severity=0.8))
    return tokens


def check(pairs: list[Measured], settings: DoctorSettings,
          count_tokens: Optional[Callable[[str], int]] = None) -> CheckResult:
    """The caption findings of `pairs`; `count_tokens`: the text encoder's tokenizer (None: lengths not checked)."""
    result = CheckResult()
    pairs = [p for p in pairs if p.example.caption]  # a pair with none is the vision-language check's (`vlm`)
    captions = {p.name: p.example.caption for p in pairs}
    cores = Counter(core(c) for c in captions.values())
    words = [len(c.split()) for c in captions.values()]
    median = float(np.median(words)) if words else 0.0
    result.stats["caption_words"] = {"median": median, "max": max(words, default=0)}
    tokens = _tokens(pairs, count_tokens, result)
    for p in pairs:
        caption = captions[p.name]
        base = core(caption)
        if not _LETTER.search(base) or tokens.get(p.name) == 0:
            result.findings.append(Finding(p.name, "caption", caption, "write the edit instruction",
                                           f"its caption {caption!r} holds no instruction (no word once a "
                                           "generator's trailing numbers are taken off): the template's "
                                           "instruction slot would be empty", severity=0.7))
        noise = caption[len(base):].strip(" \t,;:|#-_.")
        if base != caption and base and cores[base] > 1:
            result.findings.append(Finding(p.name, "caption", noise, f"caption: {base!r}",
                                           f"its caption differs from {cores[base] - 1} other(s) only by the "
                                           f"trailing {noise!r}", severity=0.3))
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
