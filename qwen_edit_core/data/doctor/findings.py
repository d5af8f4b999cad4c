"""What the doctor reports: one `Finding` per problem with a pair, and the `DoctorReport` of a dataset."""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass, field
from typing import Optional

#: every kind of finding, in the order the summary lists them
KINDS = ("swapped", "misaligned", "reference-order", "no-change", "duplicate", "leak", "mask", "caption", "size")

#: how a caption finding's fix starts when it is the text encoder's caption for a pair that has none (`--fix` writes
#: the rest as the pair's caption file)
PROPOSED_CAPTION = "write the machine-proposed caption: "

#: what each of the report's statistics is, for a reader
STATISTICS = {"direction": "edit direction strength R (0: none, 1: every pair alike)", "shift_px": "shifts (px)",
              "zoom_pct": "zooms (%)", "edited_slot": "edited picture's slot", "caption_words": "caption words",
              "caption_tokens": "caption tokens",
              "buckets": "pairs per bucket"}


@dataclass(frozen=True)
class Finding:
    """One problem with one pair: `pair` (its file stem), `kind` (one of KINDS), `figure` (the measured value),
    `fix` (the proposed fix, None when there is none), `why` (a sentence with the figure and what it is compared
    against) and `severity` (0 to 1, for ordering: the worst first)."""
    pair: str
    kind: str
    figure: object
    fix: Optional[str]
    why: str
    severity: float = 0.5

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"finding kind {self.kind!r} is not one of {', '.join(KINDS)}")

    def as_json(self) -> dict:
        """The JSON object `qwen-edit doctor --json` prints for it."""
        return {"pair": self.pair, "kind": self.kind, "figure": self.figure, "fix": self.fix, "why": self.why}


@dataclass(frozen=True)
class DoctorReport:
    """The doctor's verdict on a dataset: its findings (worst first), how many pairs and held-out pairs it read,
    notes that are not about one pair (no common edit direction, the buckets' fill) and the measured statistics."""
    findings: tuple[Finding, ...]
    pairs: int
    held_out: int = 0
    notes: tuple[str, ...] = ()
    stats: dict = field(default_factory=dict)
    #: pair name -> (its EditExample, its measure.Measures), for the fixes and the report picture
    pairs_measured: dict = field(default_factory=dict, repr=False, compare=False)

    @property
    def flagged(self) -> list[str]:
        """The names of the pairs with at least one finding, in order of their worst finding."""
        return list(dict.fromkeys(f.pair for f in self.findings))

    def of_kind(self, kind: str) -> list[Finding]:
        return [f for f in self.findings if f.kind == kind]

    def summary(self, limit: int = 10) -> str:
        """A few lines for a log: the counts by kind, the notes, then the worst `limit` findings."""
        counts = Counter(f.kind for f in self.findings)
        held = f" and {self.held_out} held-out pair(s)" if self.held_out else ""
        head = (f"dataset doctor: {self.pairs} pair(s){held}, {len(self.flagged)} flagged"
                + (": " + ", ".join(f"{counts[k]} {k}" for k in KINDS if counts[k]) if counts else ""))
        lines = [head, *(f"  note: {n}" for n in self.notes)]
        lines += [f"  {f.pair}: {f.kind}: {f.why}" + (f" (fix: {f.fix})" if f.fix else "")
                  for f in self.findings[:limit]]
        if len(self.findings) > limit:
            lines.append(f"  ... and {len(self.findings) - limit} more (qwen-edit doctor DATASET lists them all)")
        return "\n".join(lines)

    def statistics(self, items: int = 12) -> list[str]:
        """The dataset's measured distributions, a line each (the shifts' and zooms' histograms, the edit
        direction's strength, the edited picture's slot, the caption lengths, the buckets' fill), at most `items`
        entries per line."""
        lines = []
        for key, value in self.stats.items():
            label = STATISTICS.get(key, key)
            if isinstance(value, dict):
                entries = [f"{k}: {v}" for k, v in value.items()]
                value = ", ".join(entries[:items]) + (", ..." if len(entries) > items else "")
            lines.append(f"{label}: {value}")
        return lines

    def json_lines(self) -> str:
        """One JSON object per finding, one per line."""
        return "\n".join(json.dumps(f.as_json()) for f in self.findings)


@dataclass(frozen=True)
class DoctorSettings:
    """How the doctor judges a dataset. `area`: the training pixel area (data.vae_area), for the upscale and bucket
    checks (None: not checked); `pixel_aligned`: the edit keeps every pixel in place (data.control_size: target),
    so --fix realigns shifted and zoomed targets; `batch_size`: buckets of one pair are flagged when above 1."""
    area: Optional[int] = None
    pixel_aligned: bool = False
    batch_size: int = 1
    #: a target moved by more than this fraction of its side against its control (beyond the dataset's median) is
    #: misaligned; zoomed by more than `zoom_tolerance` likewise
    shift_tolerance: float = 0.015
    zoom_tolerance: float = 0.02
    #: a picture upscaled by more than this factor (per side) to reach `area` is flagged
    max_upscale: float = 2.0
    #: two pairs whose target and control perceptual hashes differ in at most this many of 128 bits are duplicates
    duplicate_bits: int = 12
    #: ... and whose pictures' levels (colour means, luma quantiles and grid) agree within this many 8-bit levels
    duplicate_levels: float = 5.0


@dataclass(frozen=True)
class Measured:
    """A pair with its measurements (`measure.Measures`), as the checks see it."""
    name: str
    example: object  # data.examples.EditExample
    measures: object  # measure.Measures


@dataclass
class CheckResult:
    """What one check family found: findings, notes about the whole dataset and statistics for the report."""
    findings: list[Finding] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    stats: dict = field(default_factory=dict)
