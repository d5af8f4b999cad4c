"""Adding edit pairs to a dataset folder in the layout `data.dataset` reads, so a dataset (with region masks)
can be built one pair at a time, e.g. from images and masks in ComfyUI.

Where the files go (NAME is ``PREFIX_00001``, the next number free in the folder):

- a folder with ``images/`` (the folders layout): ``images/NAME.png`` (the target), ``control/NAME.png`` (or
  ``control_1/NAME.png`` when that folder exists; ``control_2/``, ``control_3/`` for more controls),
  ``images/NAME.txt`` (the caption) and ``images/NAME_mask.png``;
- any other folder (new, empty or flat): ``NAME.png``, ``NAME_control.png`` (``NAME_control_1.png``,
  ``NAME_control_2.png``, ... with several controls), ``NAME.txt`` and ``NAME_mask.png``.

A mask is a float array (H, W) in [0, 1], 1 marking the edited region (ComfyUI's MASK convention: the part
painted in the mask editor); it is written as an 8-bit greyscale PNG at its own size, white = edited, which
is what `data.masks` reads. Its aspect must be the target's (the target's size or a scaled copy).

Every pair is checked before anything is written and every problem is reported at once: at most
`MAX_CONTROLS` controls (10, the most any variant takes), the image limits, the caption by the dataset reader's
own rule (data/captions.py: not empty, no control characters but line breaks and tabs), the mask. Each file is written
atomically (`common.files.write_bytes`), the target last; if a write fails, the pair's files written so far
are removed, so a failed write never leaves half a pair.
"""

from __future__ import annotations

import io
import logging
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

import numpy as np
from PIL import Image

from qwen_edit_core.common.files import write_bytes, writing
from qwen_edit_core.common.names import check_file_name
from qwen_edit_core.data.captions import caption_text_problem
from qwen_edit_core.data.dataset import DatasetError, DatasetReport, Problem, load_dataset
from qwen_edit_core.data.masks import ASPECT_TOLERANCE
from qwen_edit_core.families import variants
from qwen_edit_core.model.geometry import MAX_PIXELS, MIN_SIDE

log = logging.getLogger(__name__)

#: digits of the running number in PREFIX_00001
NUMBER_DIGITS = 5
#: the most control images a trainable variant takes (Qwen-Image-2.1: 10 references; Edit Plus: 3); training
#: refuses a pair with more than its model takes (train.run.load_examples)
MAX_CONTROLS = max(v.max_controls or 1 for v in variants.VARIANTS.values())


@dataclass(frozen=True)
class NewPair:
    """One pair to write: its control image(s) (before), the target (after), the caption (the edit
    instruction) and an optional mask, float (H, W) in [0, 1] with 1 = the edited region."""
    controls: tuple[Image.Image, ...]
    target: Image.Image
    caption: str
    mask: Optional[np.ndarray] = None


@dataclass(frozen=True)
class WrittenPair:
    """The files of a written pair, in the order they were written (the target last)."""
    name: str
    files: tuple[Path, ...]
    mask: Optional[Path] = None


def _size_problem(what: str, image: Image.Image) -> str | None:
    w, h = image.size
    if min(w, h) < MIN_SIDE:
        return f"{what} is {w}x{h}, too small; accepted: at least {MIN_SIDE} px on each side"
    if w * h > MAX_PIXELS:
        return f"{what} is {w}x{h}, too large; accepted: at most {MAX_PIXELS} pixels"
    return None


def mask_problem(mask: np.ndarray, target_size: tuple[int, int]) -> str | None:
    """What is wrong with a float mask (H, W) for a target of `target_size` (w, h), or None."""
    if mask.ndim != 2:
        return f"mask must be one (height, width) array per pair, got shape {tuple(mask.shape)}"
    (h, w), (tw, th) = mask.shape, target_size
    if not np.isfinite(mask).all() or mask.min(initial=0) < 0 or mask.max(initial=0) > 1:
        return "mask values must lie in [0, 1] (1 = the edited region)"
    if abs((w / h) / (tw / th) - 1) > ASPECT_TOLERANCE:
        return (f"mask is {w}x{h} but the target (after) image is {tw}x{th}; give a mask of the target's size "
                "(or a scaled copy). A 64x64 mask from Load Image means the image had no transparency: paint "
                "the edited region in the mask editor")
    if np.round(mask * 255).max(initial=0) <= 0:
        return ("mask is empty (nothing marked as edited; Load Image's mask is empty for a picture without "
                "transparency); paint the edited region in the mask editor, or leave the mask out")
    return None


def pair_problems(pair: NewPair) -> list[str]:
    """Everything wrong with a pair before it is written (empty: fine)."""
    problems = [] if pair.controls else ["a pair needs at least one control (before) image"]
    if len(pair.controls) > MAX_CONTROLS:
        problems.append(f"a pair takes at most {MAX_CONTROLS} control (before) images (Qwen-Image-2.1), got "
                        f"{len(pair.controls)}")
    named = [(f"control image {i + 1}" if len(pair.controls) > 1 else "control (before) image", image)
             for i, image in enumerate(pair.controls)]
    problems += [p for p in (_size_problem(what, image) for what, image in named + [("target (after) image",
                                                                                       pair.target)]) if p]
    caption_problem = caption_text_problem(pair.caption.strip())
    if caption_problem:
        problems.append(caption_problem + ("; e.g. 'invert the colors'" if not pair.caption.strip() else ""))
    if pair.mask is not None:
        problem = mask_problem(np.asarray(pair.mask, dtype=np.float32), pair.target.size)
        if problem:
            problems.append(problem)
    return problems


def check_prefix(prefix: str) -> str:
    """The stripped name prefix, or ValueError when files named by it would not read back as a target."""
    prefix = check_file_name(prefix.strip(), "name prefix")
    if re.search(r"_(control|mask)$", prefix, re.IGNORECASE):
        raise ValueError(f"name prefix {prefix!r} ends like a control or mask file name; choose another")
    return prefix


def _listed_names(folder: Path) -> list[str]:
    """File names in the folder and its layout subfolders (targets, controls, captions, masks)."""
    if not folder.is_dir():
        return []
    dirs = [folder] + [d for d in folder.iterdir() if d.is_dir()]
    return [p.name for d in dirs for p in d.iterdir() if p.is_file()]


def next_number(folder: Path, prefix: str) -> int:
    """1 + the highest number N of any file named PREFIX_N... in the folder or its subfolders (1 if none)."""
    pattern = re.compile(rf"^{re.escape(prefix)}_(\d+)(?:[._]|$)", re.IGNORECASE)
    found = [int(m[1]) for m in map(pattern.match, _listed_names(folder)) if m]
    return max(found, default=0) + 1


def pair_paths(folder: Path, name: str, n_controls: int) -> dict[str, object]:
    """{"controls": [paths], "caption", "mask", "target"} of pair `name` in the folder's layout."""
    if (folder / "images").is_dir():
        first = "control_1" if (folder / "control_1").is_dir() else "control"
        dirs = [first] + [f"control_{k}" for k in range(2, n_controls + 1)]
        images = folder / "images"
        return {"controls": [folder / d / f"{name}.png" for d in dirs], "caption": images / f"{name}.txt",
                "mask": images / f"{name}_mask.png", "target": images / f"{name}.png"}
    suffixes = ["_control"] if n_controls == 1 else [f"_control_{k}" for k in range(1, n_controls + 1)]
    return {"controls": [folder / f"{name}{s}.png" for s in suffixes], "caption": folder / f"{name}.txt",
            "mask": folder / f"{name}_mask.png", "target": folder / f"{name}.png"}


def _png(image: Image.Image) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


def mask_png(mask: np.ndarray) -> Image.Image:
    """A float mask (H, W) in [0, 1] as the 8-bit greyscale image the dataset reads (white = edited)."""
    return Image.fromarray(np.round(np.clip(mask, 0, 1) * 255).astype(np.uint8), mode="L")


def write_pair(folder: Path, pair: NewPair, name: str) -> WrittenPair:
    """Write one checked pair as `name` (the target last); on a failure remove what was written and re-raise."""
    paths = pair_paths(folder, name, len(pair.controls))
    contents = [(p, _png(image.convert("RGB"))) for p, image in zip(paths["controls"], pair.controls)]
    contents.append((paths["caption"], pair.caption.strip().encode("utf-8") + b"\n"))
    if pair.mask is not None:
        contents.append((paths["mask"], _png(mask_png(np.asarray(pair.mask, dtype=np.float32)))))
    contents.append((paths["target"], _png(pair.target.convert("RGB"))))
    taken = [p for p, _ in contents if p.exists()]
    if taken:
        raise FileExistsError(f"pair {name!r}: {taken[0]} already exists; nothing was written")
    written: list[Path] = []
    try:
        with writing(folder, f"pair {name!r}", "Nothing of that pair is kept; the folder's other pairs are unchanged."):
            for path, data in contents:
                written.append(write_bytes(path, data))
    except BaseException:
        for path in written:
            path.unlink(missing_ok=True)
        raise
    return WrittenPair(name, tuple(written), paths["mask"] if pair.mask is not None else None)


def add_pairs(folder, pairs: Sequence[NewPair], prefix: str = "pair") -> tuple[list[WrittenPair], DatasetReport]:
    """Check every pair (all problems at once, nothing written on any), write them as PREFIX_00001, ... (the
    next numbers free in `folder`), then load the whole folder with `load_dataset` (other pairs' problems are
    skipped and listed in the report; a problem with a pair written here raises DatasetError)."""
    folder = Path(folder).expanduser()
    prefix = check_prefix(prefix)
    if not pairs:
        raise ValueError("no pairs to write")
    label = (lambda i: f"pair {i + 1}: ") if len(pairs) > 1 else (lambda i: "")
    problems = [label(i) + p for i, pair in enumerate(pairs) for p in pair_problems(pair)]
    if problems:
        raise ValueError(f"{len(problems)} problem(s), nothing written to {str(folder)!r}:\n  "
                         + "\n  ".join(problems))
    if folder.exists() and not folder.is_dir():
        raise NotADirectoryError(f"dataset folder {str(folder)!r} is a file; give a folder")
    first = next_number(folder, prefix)
    written = [write_pair(folder, pair, f"{prefix}_{first + i:0{NUMBER_DIGITS}d}") for i, pair in enumerate(pairs)]
    log.info("wrote %d pair(s) to %s: %s", len(written), folder, ", ".join(w.name for w in written))
    report = load_dataset(folder, skip_invalid=True)
    loaded = {e.name for e in report.examples}
    ours = {p for w in written for p in w.files}
    bad = [p for p in report.skipped if p.path in ours]
    missing = [w.name for w in written if w.name not in loaded]
    if bad or missing:
        raise DatasetError(bad or [Problem(folder, f"pairs {missing} were written but do not load")],
                           header=f"the pair(s) written to {str(folder)!r} do not load:")
    return written, report

