"""Whose output folder it is: a run never writes over another run's LoRA or checkpoints.

Each run has an id, recorded in every checkpoint it writes (state.json `run_id`; a resumed run keeps its
checkpoint's). A new run into a folder that holds another run's LoRA or checkpoints is refused, naming
`--resume` and a new `--output-dir`, unless asked to `overwrite`: the old run's files are then moved aside to a
sibling folder first (the embedding cache stays: its entries are content-addressed and serve any run).
"""

from __future__ import annotations

import datetime
import logging
import os
import uuid
from pathlib import Path

from qwen_edit_core.common.files import LOCK_NAME, writing
from qwen_edit_core.train import checkpoint as ckpt

log = logging.getLogger(__name__)

#: entries of an output folder that belong to no run: the shared embedding cache and the run's lock file
SHARED_ENTRIES = ("cache", LOCK_NAME)


class OutputDirTakenError(ValueError):
    """The output folder holds another run's files; continuing it, another folder or --overwrite is the choice."""


def new_run_id() -> str:
    """A fresh run's id (random: two runs never share one)."""
    return uuid.uuid4().hex[:12]


def run_id_of(checkpoint: Path) -> str | None:
    """The id of the run that wrote `checkpoint` (None for checkpoints written before runs had ids)."""
    return ckpt.read_state(checkpoint).get("run_id")


def previous_run(out_dir: Path) -> str | None:
    """What of an earlier run `out_dir` holds (its LoRA files, its checkpoints), in words; None if nothing."""
    out_dir = Path(out_dir)
    if not out_dir.is_dir():
        return None
    loras = sorted(p.name for p in out_dir.glob("*.safetensors") if p.is_file())
    found = ckpt.list_checkpoints(out_dir / "checkpoints")
    parts = []
    if loras:
        parts.append("the LoRA " + ", ".join(loras[:3]) + (" ..." if len(loras) > 3 else ""))
    if found:
        parts.append(f"{len(found)} checkpoint(s) up to step {found[-1].step}")
    return " and ".join(parts) or None


def check_free(out_dir: Path, resume: Path | None, overwrite: bool) -> Path | None:
    """Refuse (OutputDirTakenError) a run that would write over another run's files in `out_dir`: a new run
    when the folder holds a LoRA or checkpoints, a resumed one when its checkpoints are another run's. Writes
    nothing; with `overwrite` nothing is refused (`claim` moves the old files aside). Returns `resume`."""
    out_dir = Path(out_dir)
    if overwrite:
        return resume
    if resume is not None:
        own = run_id_of(resume)
        others = {c.state.get("run_id") for c in ckpt.list_checkpoints(out_dir / "checkpoints")} - {own}
        if not others:
            return resume
        what = f"checkpoints of another run (not the one {str(resume)!r} belongs to)"
    else:
        what = previous_run(out_dir)
        if what is None:
            return None
    raise OutputDirTakenError(
        f"output directory {str(out_dir)!r} (train.output_dir) holds another run: {what}. Continue it with "
        "--resume, choose a new --output-dir, or pass --overwrite to move the old run aside first")


def aside_name(out_dir: Path, now: datetime.datetime | None = None) -> Path:
    """The sibling folder an overwritten run moves to: `<folder>.replaced-<UTC time>` (made unique)."""
    now = now or datetime.datetime.now(datetime.timezone.utc)
    base = out_dir.with_name(f"{out_dir.name}.replaced-{now:%Y%m%d-%H%M%S}")
    target, n = base, 1
    while target.exists():
        n += 1
        target = base.with_name(f"{base.name}-{n}")
    return target


def move_aside(out_dir: Path, keep: tuple[Path, ...] = ()) -> Path | None:
    """Move every entry of `out_dir` but the shared ones (and those in `keep`: a cache.dir inside it) to
    `aside_name(out_dir)`; returns that folder, or None when there was nothing to move."""
    out_dir = Path(out_dir)
    keep_names = set(SHARED_ENTRIES) | {p.name for p in keep if Path(p).parent == out_dir}
    entries = [p for p in sorted(out_dir.iterdir()) if p.name not in keep_names] if out_dir.is_dir() else []
    if not entries:
        return None
    target = aside_name(out_dir)
    with writing(target, "the earlier run (moved aside by --overwrite)", key="train.output_dir"):
        target.mkdir()
        for entry in entries:
            os.replace(entry, target / entry.name)
    log.warning("--overwrite: the earlier run in %s moved to %s", out_dir, target)
    return target


def claim(out_dir: Path, resume: Path | None, overwrite: bool, cache_dir: Path | None = None) -> str | None:
    """Make `out_dir` this run's: checked again (`check_free`), the old run moved aside when `overwrite` and it
    holds one, and the run's id returned (the resumed checkpoint's, else a new one)."""
    check_free(out_dir, resume, overwrite)
    inside = resume is not None and Path(out_dir).resolve() in Path(resume).resolve().parents
    if overwrite and not inside and previous_run(out_dir) is not None:
        move_aside(out_dir, keep=(Path(cache_dir),) if cache_dir else ())
    return run_id_of(resume) if resume is not None else new_run_id()
