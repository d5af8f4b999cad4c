"""Folders of edit pairs: discovery, validation, aspect buckets and a resumable bucketed batch sampler.

Accepted layouts (images: .png, .jpg/.jpeg, .webp, any letter case; captions: UTF-8 .txt, BOM tolerated,
surrounding whitespace stripped):

- folders: ``images/`` holds the targets; ``control/`` (= control 1) or ``control_1/``, ``control_2/``,
  ``control_3/``, ... hold the control images, matched to the target by file stem (the extensions may differ).
- flat: one folder with ``NAME.png`` (target), ``NAME_control.png`` (= control 1) or ``NAME_control_1.png``,
  ``NAME_control_2.png``, ... and ``NAME.txt``.

A pair may have a mask of the edited region (white; black elsewhere) for a region-weighted loss:
``NAME_mask.png`` beside the target (``images/NAME_mask.png`` in the folders layout) or ``masks/NAME.png`` in
the dataset folder (both layouts); masks are validated with everything else (see ``data.masks``).

The caption of target ``NAME`` is ``NAME.txt`` beside the target image (``images/NAME.txt`` in the folders
layout); if there is none, ``captions/NAME.txt`` in the dataset folder (both layouts). When both exist the one
beside the image wins and a note says so. Hidden files (``.NAME``, e.g. macOS ``._NAME.png``) are ignored;
other image formats (gif, bmp, tiff, ...) are reported rather than silently ignored.

Everything is validated before any work and every problem is reported at once, each naming its file and what
would be accepted: unpaired images, missing/empty/non-UTF-8 captions, captions holding control characters (NUL,
...) or too long for the text encoder (data.captions), images that do not decode (truncated or
damaged), modes other than RGB, images too small or too large, invalid masks, and files that are links to
files outside the dataset folder. Pairs may have different
numbers of controls (Edit Plus batches mix them); in the folders layout a pair with k controls has them in
the first k control folders. Layout
problems that make pairing impossible (``control/`` beside ``control_1/``, a gap in the control numbering)
stop discovery at once, as there is nothing sensible to validate.

Decisions:
- Non-RGB modes (RGBA, LA, L, P, CMYK, I;16, ...) are problems by default: silently flattening transparency
  or squashing 16 bits changes what the model learns. ``convert_modes=True`` accepts them; ``load_rgb`` then
  converts (transparency composited on white, 16-bit scaled to 8-bit) and validation logs a warning per file.
- A non-identity EXIF orientation is applied on load (``ImageOps.exif_transpose``) and is only a note: viewers,
  ComfyUI's LoadImage and the sampler all see the image as displayed, so that is the image to train on;
  ``EditExample.target_size`` / ``control_sizes`` are the displayed sizes.
"""

from __future__ import annotations

import logging
import re
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional, Sequence

from qwen_edit_core.data.images import (_ALPHA_MODES, _ROTATED_ORIENTATIONS, ACCEPTED_IMAGES, ImageCheck,  # noqa: F401
                                        _mode_name, check_image, inspect_image,
                                        load_rgb)
from qwen_edit_core.data.buckets import BucketBatchSampler  # noqa: F401  (re-exported)
from qwen_edit_core.data.captions import (CAPTION_EXTENSION, CAPTIONS_DIR, EMPTY_CAPTION,  # noqa: F401
                                          caption_length_problem, read_caption)
from qwen_edit_core.data.examples import (DatasetError, DatasetNotFoundError, DatasetReport,  # noqa: F401
                                          EditExample, Problem)  # (re-exported: the dataset's public values)
from qwen_edit_core.data.masks import MASKS_DIR, inspect_mask, split_mask_stems
from qwen_edit_core.model.geometry import (MAX_PIXELS, MIN_SIDE, bucket_for,  # noqa: F401 (re-exported)
                                           calculate_dimensions)

log = logging.getLogger(__name__)

IMAGE_EXTENSIONS = (".png", ".jpg", ".jpeg", ".webp")
#: image formats people drop into dataset folders that we do not accept: reported, never silently ignored
OTHER_IMAGE_EXTENSIONS = (".gif", ".bmp", ".tif", ".tiff", ".heic", ".heif", ".avif", ".jxl", ".jp2", ".psd",
                          ".exr", ".ico", ".tga")
LAYOUTS = ("images/ + control/ (or control_1/, control_2/, ...) matched by file name, captions as "
           "images/NAME.txt or captions/NAME.txt",
           "one folder with NAME.png, NAME_control.png (or NAME_control_1.png, NAME_control_2.png, ...) and "
           "NAME.txt")

_CONTROL_DIR = re.compile(r"^control(?:_(?P<index>\d+))?$")
_FLAT_CONTROL = re.compile(r"^(?P<base>.+)_control(?:_(?P<index>\d+))?$", re.IGNORECASE)


# -- discovery -------------------------------------------------------------------------------------------------

# An issue is a problem tagged with the sample it disqualifies (None: a stray file, no sample to skip).
_Issue = tuple[Optional[str], Problem]


@dataclass(frozen=True)
class _Candidate:
    """A discovered, not yet validated sample."""
    name: str
    target: Path
    controls: tuple[Path, ...]
    captions: tuple[Path, ...]  # existing caption files in order of precedence (may be empty)
    default_caption: Path       # where the caption is expected, for the "missing" message
    mask: Optional[Path] = None


@dataclass
class _Discovery:
    layout: str
    candidates: list[_Candidate] = field(default_factory=list)
    issues: list[_Issue] = field(default_factory=list)


@dataclass
class _Listing:
    """The images and captions of one folder, by stem. Stems shared by several images are `ambiguous`."""
    images: dict[str, Path] = field(default_factory=dict)
    captions: dict[str, Path] = field(default_factory=dict)
    ambiguous: set[str] = field(default_factory=set)


def _list_folder(folder: Path, issues: list[_Issue], name_of=lambda stem: stem) -> _Listing:
    """Images and captions of `folder` by stem; duplicates and unaccepted formats become issues.
    `name_of(stem)` is the sample a file belongs to (flat controls belong to their target)."""
    listing = _Listing()
    if not folder.is_dir():
        return listing
    for path in sorted(folder.iterdir()):
        if path.name.startswith(".") or not path.is_file():
            continue
        suffix = path.suffix.lower()
        if suffix in IMAGE_EXTENSIONS:
            other = listing.images.setdefault(path.stem, path)
            if other != path:
                listing.ambiguous.add(path.stem)
                issues.append((name_of(path.stem), Problem(path, f"has the same name as {other.name}; keep one "
                                                                 "image per name")))
        elif suffix == CAPTION_EXTENSION:
            listing.captions.setdefault(path.stem, path)  # same stem, other letter case: the first wins
        elif suffix in OTHER_IMAGE_EXTENSIONS:
            issues.append((None, Problem(path, f"{suffix} images are not accepted; convert it to "
                                               f"{ACCEPTED_IMAGES}")))
    return listing


def _captions_of(stem: str, beside: _Listing, captions_dir: _Listing) -> tuple[Path, ...]:
    return tuple(p for p in (beside.captions.get(stem), captions_dir.captions.get(stem)) if p is not None)


def _control_dirs(folder: Path) -> list[Path]:
    """The control folders in control order; raises DatasetError when their numbering is ambiguous."""
    found: dict[int, Path] = {}
    problems = []
    for path in sorted(p for p in folder.iterdir() if p.is_dir()):
        match = _CONTROL_DIR.match(path.name)
        if not match:
            continue
        index = int(match["index"]) if match["index"] else 1  # control/ is control 1
        if index in found:
            problems.append(Problem(path, f"is control {index}, like {found[index].name}/ (control/ counts as "
                                          "control_1/); keep one of them"))
        else:
            found[index] = path
    if not found:
        problems.append(Problem(folder, "has images/ but no control/ (or control_1/, control_2/, ...) folder"))
    elif sorted(found) != list(range(1, len(found) + 1)):
        problems.append(Problem(folder, f"control folders are numbered {sorted(found)}; accepted: control/ or "
                                        f"control_1/ up to control_{len(found)}/ without gaps"))
    if problems:
        raise DatasetError(problems, header=f"{len(problems)} layout problem(s) in dataset {str(folder)!r}:")
    return [found[i] for i in sorted(found)]


def _discover_folders(folder: Path) -> _Discovery:
    """Layout (a): images/ + control folders, matched by stem."""
    found = _Discovery("folders")
    control_dirs = _control_dirs(folder)
    targets = _list_folder(folder / "images", found.issues)
    controls = [_list_folder(d, found.issues) for d in control_dirs]
    captions = _list_folder(folder / CAPTIONS_DIR, found.issues)
    masks = _masks(folder, targets, found.issues)
    for directory, listing in zip(control_dirs, controls):
        for stem in sorted(set(listing.images) - set(targets.images) - targets.ambiguous):
            found.issues.append((None, Problem(listing.images[stem], f"control image has no target "
                                                                     f"images/{stem}.png/.jpg/.webp")))
    for stem, target in targets.images.items():
        paths = [listing.images.get(stem) for listing in controls]
        count = len(paths) - next((k for k, p in enumerate(reversed(paths)) if p is not None), len(paths))
        # A pair may have fewer controls than there are folders (1 to 3 for Edit Plus), but no gaps.
        missing = [d.name for d, p in zip(control_dirs[:max(count, 1)], paths) if p is None]
        if missing:
            found.issues.append((stem, Problem(target, f"has no control image named {stem}.png/.jpg/.webp in "
                                                       f"{', '.join(m + '/' for m in missing)}")))
            continue
        found.candidates.append(_Candidate(stem, target, tuple(paths[:count]), _captions_of(stem, targets, captions),
                                           target.with_suffix(CAPTION_EXTENSION), masks.get(stem)))
    return found


def _split_flat(listing: _Listing, issues: list[_Issue]) -> tuple[dict[str, Path], dict[str, dict[int, Path]]]:
    """Flat file stems -> targets by name, and controls by target name and control number."""
    targets: dict[str, Path] = {}
    controls: dict[str, dict[int, Path]] = {}
    for stem, path in listing.images.items():
        match = _FLAT_CONTROL.match(stem)
        if not match:
            targets[stem] = path
            continue
        base, index = match["base"], int(match["index"]) if match["index"] else 1  # NAME_control is control 1
        other = controls.setdefault(base, {}).setdefault(index, path)
        if other != path:
            issues.append((base, Problem(path, f"is control {index} of {base}, like {other.name} ({base}_control "
                                               f"counts as {base}_control_1); keep one of them")))
    return targets, controls


def _flat_sample_name(stem: str) -> str:
    """The sample a flat-layout file belongs to: NAME for NAME and for NAME_control[_N]."""
    match = _FLAT_CONTROL.match(stem)
    return match["base"] if match else stem


def _discover_flat(folder: Path) -> _Discovery:
    """Layout (b): NAME.png, NAME_control[_N].png and NAME.txt in one folder."""
    found = _Discovery("flat")
    listing = _list_folder(folder, found.issues, name_of=_flat_sample_name)
    captions = _list_folder(folder / CAPTIONS_DIR, found.issues)
    masks = _masks(folder, listing, found.issues)
    targets, controls = _split_flat(listing, found.issues)
    for stem in sorted((set(masks) & set(listing.images)) - set(targets)):
        found.issues.append((None, Problem(masks[stem], f"mask has no target {stem}.png/.jpg/.webp")))
    for base in sorted(set(controls) - set(targets) - listing.ambiguous):
        for path in controls[base].values():
            found.issues.append((None, Problem(path, f"control image has no target {base}.png/.jpg/.webp")))
    for stem, target in targets.items():
        numbered = controls.get(stem, {})
        order = sorted(numbered)
        if not numbered:
            found.issues.append((stem, Problem(target, f"has no control image {stem}_control.png/.jpg/.webp "
                                                       f"(or {stem}_control_1, {stem}_control_2, ...)")))
        elif order != list(range(1, len(order) + 1)):
            found.issues.append((stem, Problem(target, f"control images are numbered {order}; accepted: "
                                                       f"{stem}_control or {stem}_control_1 up to "
                                                       f"{stem}_control_{len(order)} without gaps")))
        else:
            found.candidates.append(_Candidate(stem, target, tuple(numbered[i] for i in order),
                                               _captions_of(stem, listing, captions),
                                               target.with_suffix(CAPTION_EXTENSION), masks.get(stem)))
    return found


def _masks(folder: Path, listing: _Listing, issues: list[_Issue]) -> dict[str, Path]:
    """{sample name: mask}: `NAME_mask` images are taken out of `listing` (when NAME is there too), and
    `masks/NAME` images are added; two masks for one sample, or a mask without its sample, are issues."""
    listing.images, beside = split_mask_stems(listing.images)
    in_dir = _list_folder(folder / MASKS_DIR, issues).images
    for stem in sorted(set(beside) & set(in_dir)):
        issues.append((stem, Problem(in_dir[stem], f"is a second mask of {stem}, like {beside[stem].name}; keep one")))
    for stem in sorted(set(in_dir) - set(listing.images)):
        issues.append((None, Problem(in_dir[stem], f"mask has no target {stem}.png/.jpg/.webp")))
    return {**in_dir, **beside}


def _discover(folder: Path) -> _Discovery:
    if (folder / "images").is_dir():
        return _discover_folders(folder)
    strays = [p for p in sorted(folder.iterdir()) if p.is_dir() and _CONTROL_DIR.match(p.name)]
    if strays:
        raise DatasetError([Problem(folder, f"has {strays[0].name}/ but no images/ folder for the targets")],
                           header=f"1 layout problem in dataset {str(folder)!r}; accepted layouts: "
                                  + "; ".join(LAYOUTS))
    return _discover_flat(folder)


def _image_notes(path: Path, check: ImageCheck) -> list[Problem]:
    """Informational notes about a valid image (logged, kept in DatasetReport.notes)."""
    notes = []
    if check.orientation != 1:
        notes.append(Problem(path, f"EXIF orientation {check.orientation} applied on load: used as displayed, "
                                   f"{check.size[0]}x{check.size[1]}"))
        log.info("%s", notes[-1])
    if check.mode != "RGB":
        how = " (transparency composited on white)" if check.mode in _ALPHA_MODES else ""
        notes.append(Problem(path, f"image mode {_mode_name(check.mode)} converted to RGB on load{how}"))
        log.warning("%s", notes[-1])
    return notes


@dataclass(frozen=True)
class _Limits:
    min_side: int
    max_pixels: int
    convert_modes: bool
    root: Path  # the dataset folder, links resolved: no file of a pair may lie outside it
    count_tokens: Optional[Callable[[str], int]] = None  # the text encoder's tokenizer (None: not counted)
    #: called with each valid pair and its files' ImageChecks (sha256 and decoded picture) by path
    on_pair: Optional[Callable[[EditExample, dict[Path, ImageCheck]], None]] = None
    #: keep pairs whose caption is missing or empty, with caption "" (the dataset doctor proposes one); training
    #: never sets it
    captionless: bool = False
    #: each folder's resolved path, resolved once (`_resolved`)
    folders: dict = field(default_factory=dict, compare=False)


def _resolved(path: Path, folders: dict) -> Path:
    """`path.resolve()`, its folder resolved once for all its files (`folders` keeps them): only a file that is
    itself a link is resolved on its own (a dataset of 10,000 pairs: 40,000 files, a few folders)."""
    if path.is_symlink():
        return path.resolve()
    if path.parent not in folders:
        folders[path.parent] = path.parent.resolve()
    return folders[path.parent] / path.name


def _outside(path: Path, root: Path, folders: dict) -> Problem | None:
    """A problem when `path` is (or lies in a folder that is) a link to a file outside the dataset folder
    `root`: a dataset is what its folder holds, and a link to /etc/passwd must not become a caption."""
    target = _resolved(path, folders)
    if target == root or root in target.parents:
        return None
    return Problem(path, f"is a link to {str(target)!r}, outside the dataset folder {str(root)!r}; copy the file "
                         "into the dataset folder instead of linking it")


def _validate(candidate: _Candidate, limits: _Limits) -> tuple[EditExample | None, list[Problem], list[Problem]]:
    """(the example or None, its problems, its notes): every image decoded, the caption read."""
    problems, notes, sizes, checks = [], [], [], {}
    files = (candidate.target, *candidate.controls, *candidate.captions[:1],
             *([candidate.mask] if candidate.mask is not None else []))
    problems = [p for p in (_outside(path, limits.root, limits.folders) for path in files) if p]
    if problems:
        return None, problems, notes
    for path in (candidate.target, *candidate.controls):
        check = inspect_image(path, min_side=limits.min_side, max_pixels=limits.max_pixels,
                              convert_modes=limits.convert_modes)
        if check.problem:
            problems.append(Problem(path, check.problem))
            continue
        sizes.append(check.size)
        checks[path] = check
        notes += _image_notes(path, check)
    if candidate.mask is not None and sizes and not problems:
        checks[candidate.mask] = inspect_mask(candidate.mask, sizes[0], limits.max_pixels)
        if checks[candidate.mask].problem:
            problems.append(Problem(candidate.mask, checks[candidate.mask].problem))
    caption, caption_problem = read_caption(candidate.captions, candidate.default_caption)
    if limits.captionless and caption_problem and (not candidate.captions or caption_problem.message == EMPTY_CAPTION):
        caption, caption_problem = "", None  # kept for the doctor to caption; the length check has nothing to count
    elif caption is not None:
        caption_problem = caption_length_problem(candidate.captions[0], caption, limits.count_tokens)
    if caption_problem:
        problems.append(caption_problem)
    if len(candidate.captions) > 1:
        notes.append(Problem(candidate.captions[1], f"ignored: {candidate.captions[0]} is the caption used"))
    if problems:
        return None, problems, notes
    example = EditExample(candidate.name, candidate.target, candidate.controls, caption, sizes[0], tuple(sizes[1:]),
                          candidate.mask)
    if limits.on_pair is not None:
        limits.on_pair(example, checks)
    return example, problems, notes


# -- loading ---------------------------------------------------------------------------------------------------

def _require_folder(folder: Path) -> None:
    if not folder.is_dir():
        what = "is not a folder" if folder.exists() else "does not exist"
        raise DatasetNotFoundError([Problem(folder, f"dataset folder {what}")],
                                   header=f"dataset folder {str(folder)!r} {what}; accepted layouts: "
                                          + "; ".join(LAYOUTS))


def _report_skipped(folder: Path, problems: Sequence[Problem], kept: int, dropped: int) -> None:
    for problem in problems:
        log.warning("skipping: %s", problem)
    log.warning("dataset %s: skipped %d sample(s) over %d problem(s); %d sample(s) remain", folder, dropped,
                len(problems), kept)


def load_dataset(folder, *, skip_invalid: bool = False, min_side: int = MIN_SIDE, max_pixels: int = MAX_PIXELS,
                 convert_modes: bool = False, count_tokens: Callable[[str], int] | None = None,
                 on_pair: Callable[[EditExample, dict[Path, ImageCheck]], None] | None = None,
                 keep_captionless: bool = False) -> DatasetReport:
    """Discover and validate a folder of edit pairs (see the module docstring for the layouts).

    Every image is read once, hashed and decoded, and every caption read (and, given the text encoder's tokenizer
    as `count_tokens`, its tokens counted) before anything is returned; `on_pair(example, checks)` sees each valid
    pair with its files' ImageChecks by path (their sha256 and decoded pictures: the dataset doctor measures them
    from this one decode). `keep_captionless` (the dataset doctor's, never training's) keeps the pairs whose caption
    is missing or empty, with caption "". Raises DatasetError listing
    every problem, unless `skip_invalid`, which drops the samples with a problem (logged, and the problems
    kept in `skipped`); an empty result is an error either way.
    """
    folder = Path(folder).expanduser()
    _require_folder(folder)
    found = _discover(folder)
    if not found.candidates and not found.issues:
        raise DatasetError([Problem(folder, "no images found")],
                           header=f"no edit pairs in {str(folder)!r}; accepted layouts: " + "; ".join(LAYOUTS))
    limits = _Limits(min_side, max_pixels, convert_modes, folder.resolve(), count_tokens, on_pair, keep_captionless)
    issues = list(found.issues)
    notes, checked = [], []
    for candidate in found.candidates:
        example, problems, own_notes = _validate(candidate, limits)
        issues += [(candidate.name, p) for p in problems]
        notes += own_notes
        if example is not None:
            checked.append(example)
    disqualified = {name for name, _ in issues if name is not None}
    examples = tuple(e for e in checked if e.name not in disqualified)
    problems = sorted((p for _, p in issues), key=lambda p: (str(p.path), p.message))
    if problems and not skip_invalid:
        raise DatasetError(problems, header=f"{len(problems)} problem(s) in dataset {str(folder)!r} (fix them, or "
                                            "set skip_invalid (data.skip_invalid) to skip those samples):")
    if problems:
        _report_skipped(folder, problems, len(examples), len(disqualified))
    if not examples:
        raise DatasetError(problems, header=f"{len(problems)} problem(s) and no valid edit pairs left in "
                                            f"{str(folder)!r} after skipping; accepted layouts: "
                                            + "; ".join(LAYOUTS))
    counts = Counter(len(e.controls) for e in examples)
    log.info("dataset %s: %d pair(s), %s layout, control images per pair: %s", folder, len(examples), found.layout,
             ", ".join(f"{n} ({counts[n]} pairs)" for n in sorted(counts)))
    return DatasetReport(examples, tuple(problems), found.layout, tuple(notes))
