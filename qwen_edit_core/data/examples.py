"""The dataset's public values: one validated edit pair (`EditExample`), a problem with one file (`Problem`), the
result of loading a folder (`DatasetReport`) and the errors that list every problem (`DatasetError`).
`data/dataset.py` discovers and validates folders into these and re-exports them.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence


@dataclass(frozen=True)
class EditExample:
    """One validated edit pair: the target, its control image(s) (in control order) and the caption."""
    name: str
    target: Path
    controls: tuple[Path, ...]
    caption: str
    target_size: tuple[int, int]  # (w, h) as displayed (EXIF orientation applied)
    control_sizes: tuple[tuple[int, int], ...]
    mask: Optional[Path] = None  # the edited region (white) for a region-weighted loss, if the pair has one


@dataclass(frozen=True)
class Problem:
    """Something wrong (or, in `DatasetReport.notes`, worth knowing) about one file."""
    path: Path
    message: str

    def __str__(self) -> str:
        return f"{self.path}: {self.message}"


@dataclass(frozen=True)
class DatasetReport:
    """The valid examples, the problems skipped (`skip_invalid`), the layout ("folders" or "flat") and
    informational notes (EXIF orientation applied, modes converted, caption precedence)."""
    examples: tuple[EditExample, ...]
    skipped: tuple[Problem, ...]
    layout: str
    notes: tuple[Problem, ...] = ()


class DatasetError(ValueError):
    """Every problem of a dataset folder: the count (or a header) first, then one problem per line."""

    def __init__(self, problems: Sequence[Problem], header: str = ""):
        self.problems = list(problems)
        lines = [header or f"{len(self.problems)} problem(s) in the dataset:"] + [f"  {p}" for p in self.problems]
        super().__init__("\n".join(lines))


class DatasetNotFoundError(DatasetError, FileNotFoundError):
    """The dataset folder does not exist (catchable as DatasetError or FileNotFoundError)."""
