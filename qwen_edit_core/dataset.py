"""Folders of edit pairs: discovery, validation, aspect buckets and a resumable bucketed batch sampler.

Accepted layouts (file stems match across folders; jpg/jpeg, png, webp; UTF-8 captions):
- folders: `images/` (targets) with `control/` or `control_1/`, `control_2/`, `control_3/`; the caption of
  `images/NAME.png` is `images/NAME.txt` (or `captions/NAME.txt`);
- flat: `NAME.png` (target), `NAME_control.png` or `NAME_control_1.png`, `NAME_control_2.png`..., `NAME.txt`.

Everything is validated before any work and every problem is reported at once, each naming its file.
"""

from __future__ import annotations

import logging
import math
import random
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Hashable, Iterator, Sequence

from PIL import Image, ImageOps, UnidentifiedImageError

log = logging.getLogger(__name__)

IMAGE_EXTENSIONS = (".png", ".jpg", ".jpeg", ".webp")
LAYOUTS = ("images/ + control/ (or control_1/, control_2/, ...) with NAME.txt captions",
           "one folder with NAME.png, NAME_control.png (or NAME_control_1.png, ...) and NAME.txt")
MAX_CONTROLS = 3


@dataclass(frozen=True)
class EditExample:
    name: str
    target: Path
    controls: tuple[Path, ...]
    caption: str
    target_size: tuple[int, int]  # (w, h) as displayed (EXIF orientation applied)
    control_sizes: tuple[tuple[int, int], ...]


@dataclass(frozen=True)
class Problem:
    path: Path
    message: str

    def __str__(self) -> str:
        return f"{self.path}: {self.message}"


@dataclass(frozen=True)
class DatasetReport:
    examples: tuple[EditExample, ...]
    skipped: tuple[Problem, ...]
    layout: str


class DatasetError(ValueError):
    """Every problem of a dataset folder, one per line."""

    def __init__(self, problems: Sequence[Problem], header: str = ""):
        self.problems = list(problems)
        lines = [header or f"{len(self.problems)} problem(s) in the dataset:"] + [f"  {p}" for p in self.problems]
        super().__init__("\n".join(lines))


def _images_in(folder: Path) -> dict[str, Path]:
    return {p.stem: p for p in sorted(folder.iterdir()) if p.is_file() and p.suffix.lower() in IMAGE_EXTENSIONS}


def _read_caption(path: Path, problems: list[Problem]) -> str | None:
    if not path.is_file():
        problems.append(Problem(path, "caption file is missing (a UTF-8 .txt beside the target image)"))
        return None
    try:
        text = path.read_text(encoding="utf-8-sig").strip()
    except UnicodeDecodeError:
        problems.append(Problem(path, "caption is not UTF-8 text"))
        return None
    if not text:
        problems.append(Problem(path, "caption is empty"))
        return None
    return text


def _discover(folder: Path) -> tuple[str, list[tuple[str, Path, list[Path], Path]], list[Problem]]:
    """(layout, [(name, target, controls, caption path)], pairing problems)."""
    problems: list[Problem] = []
    entries = []
    if (folder / "images").is_dir():
        control_dirs = [folder / "control"] if (folder / "control").is_dir() else []
        control_dirs += [folder / f"control_{i}" for i in range(1, MAX_CONTROLS + 1)
                         if (folder / f"control_{i}").is_dir()]
        if not control_dirs:
            raise DatasetError([Problem(folder, "has images/ but no control/ (or control_1/) folder")])
        targets = _images_in(folder / "images")
        controls = [_images_in(d) for d in control_dirs]
        for stem in sorted(set().union(*controls) - set(targets)):
            for c in controls:
                if stem in c:
                    problems.append(Problem(c[stem], "control image has no target in images/ with the same name"))
        for stem, target in targets.items():
            paths = [c.get(stem) for c in controls]
            if any(p is None for p in paths):
                missing = [d.name for d, p in zip(control_dirs, paths) if p is None]
                problems.append(Problem(target, f"no control image with the same name in {', '.join(missing)}/"))
                continue
            caption = target.with_suffix(".txt")
            if not caption.is_file() and (folder / "captions" / f"{stem}.txt").is_file():
                caption = folder / "captions" / f"{stem}.txt"
            entries.append((stem, target, paths, caption))
        return "folders", entries, problems
    images = _images_in(folder)
    controls: dict[str, dict[int, Path]] = {}
    targets = {}
    for stem, path in images.items():
        base, sep, tail = stem.rpartition("_control")
        if sep and (tail == "" or (tail.startswith("_") and tail[1:].isdigit())):
            index = int(tail[1:]) if tail else 1
            controls.setdefault(base, {})[index] = path
        else:
            targets[stem] = path
    for base in sorted(set(controls) - set(targets)):
        for path in controls[base].values():
            problems.append(Problem(path, f"control image has no target {base}.png/.jpg/.webp"))
    for stem, target in targets.items():
        found = controls.get(stem)
        if not found:
            problems.append(Problem(target, f"no control image {stem}_control.png (or {stem}_control_1.png)"))
            continue
        order = sorted(found)
        if order != list(range(1, len(order) + 1)):
            problems.append(Problem(target, f"control images are numbered {order}; expected 1..{len(order)}"))
            continue
        entries.append((stem, target, [found[i] for i in order], target.with_suffix(".txt")))
    return "flat", entries, problems


def check_image(path: Path, *, min_side: int, max_pixels: int, convert_modes: bool) -> tuple[tuple[int, int] | None,
                                                                                          str | None]:
    """((w, h) as displayed, None) for a usable image, else (None, what is wrong and what is accepted)."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            with Image.open(path) as img:
                w, h = img.size
                if w * h > max_pixels:
                    return None, f"{w}x{h} is larger than the {max_pixels} pixel limit (decompression bomb guard)"
                img.load()
                mode = img.mode
                orientation = img.getexif().get(0x0112, 1)
    except (Image.DecompressionBombError, Image.DecompressionBombWarning):
        return None, "image is absurdly large (decompression bomb guard)"
    except UnidentifiedImageError:
        return None, "not a readable image (png, jpg or webp expected)"
    except (OSError, SyntaxError, ValueError) as err:
        return None, f"image is truncated or damaged: {err}"
    if mode != "RGB" and not convert_modes:
        return None, (f"image mode {mode} is not RGB (8-bit, 3 channels); convert it, or set data.convert_modes "
                      "to convert on load")
    if orientation in (5, 6, 7, 8):
        w, h = h, w
    if min(w, h) < min_side:
        return None, f"{w}x{h} is smaller than {min_side} px on a side"
    return (w, h), None


def load_rgb(path, convert_modes: bool = False) -> Image.Image:
    """The one way every stage opens a dataset image: EXIF orientation applied, RGB (converted only when
    `convert_modes`, transparency composited on white)."""
    with Image.open(path) as img:
        img.load()
        img = ImageOps.exif_transpose(img)
    if img.mode == "RGB":
        return img
    if not convert_modes:
        raise ValueError(f"{path}: image mode {img.mode} is not RGB; set data.convert_modes to convert it")
    if img.mode in ("RGBA", "LA", "P", "PA"):
        rgba = img.convert("RGBA")
        background = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(background, rgba).convert("RGB")
    if img.mode.startswith("I;16") or img.mode == "I":
        return img.point(lambda v: v / 256).convert("L").convert("RGB")
    return img.convert("RGB")


def load_dataset(folder, *, skip_invalid: bool = False, min_side: int = 64, max_pixels: int = 64_000_000,
                 convert_modes: bool = False) -> DatasetReport:
    """Discover and validate a folder of edit pairs. Raises DatasetError listing every problem, unless
    `skip_invalid`, which drops bad samples (logged and counted in `skipped`)."""
    folder = Path(folder)
    if not folder.is_dir():
        raise DatasetError([Problem(folder, "dataset folder does not exist")],
                           header=f"dataset folder {str(folder)!r} does not exist; accepted layouts: "
                                  + "; ".join(LAYOUTS))
    layout, entries, problems = _discover(folder)
    bad = {p.path for p in problems}
    examples = []
    for name, target, controls, caption_path in entries:
        own: list[Problem] = []
        sizes = []
        for path in (target, *controls):
            size, message = check_image(path, min_side=min_side, max_pixels=max_pixels, convert_modes=convert_modes)
            if message:
                own.append(Problem(path, message))
            sizes.append(size)
        caption = _read_caption(caption_path, own)
        if own:
            problems += own
            bad.add(target)
            continue
        examples.append(EditExample(name, target, tuple(controls), caption, sizes[0], tuple(sizes[1:])))
    counts = {len(e.controls) for e in examples}
    if len(counts) > 1:
        most = max(counts, key=lambda n: sum(len(e.controls) == n for e in examples))
        for e in [e for e in examples if len(e.controls) != most]:
            problems.append(Problem(e.target, f"has {len(e.controls)} control images; the others have {most}"))
        examples = [e for e in examples if len(e.controls) == most]
    if not examples and not problems:
        raise DatasetError([Problem(folder, "no images found")],
                           header=f"no edit pairs in {str(folder)!r}; accepted layouts: " + "; ".join(LAYOUTS))
    if problems and not skip_invalid:
        raise DatasetError(problems, header=f"{len(problems)} problem(s) in dataset {str(folder)!r} "
                                            "(fix them, or set data.skip_invalid to skip those samples):")
    if problems:
        for p in problems:
            log.warning("skipping: %s", p)
        log.warning("skipped %d problem(s); %d samples remain", len(problems), len(examples))
    if not examples:
        raise DatasetError(problems, header=f"no valid edit pairs left in {str(folder)!r} after skipping:")
    return DatasetReport(tuple(examples), tuple(problems), layout)


def calculate_dimensions(area: int, ratio: float) -> tuple[int, int]:
    """(w, h) at pixel `area` for aspect `ratio`, sides rounded to multiples of 32 (as diffusers)."""
    width = math.sqrt(area * ratio)
    return round(width / 32) * 32, round(width / ratio / 32) * 32


def bucket_for(size_wh: tuple[int, int], area: int) -> tuple[int, int]:
    """The bucket of an image at a fixed pixel area: exactly the size the sampler would use."""
    return calculate_dimensions(area, size_wh[0] / size_wh[1])


class BucketBatchSampler:
    """Batches of indices with equal bucket keys; deterministic per (seed, epoch); resumable.

    `state_dict()` after k batches and `load_state_dict` in a new sampler continue with batch k+1 of the
    same sequence, so a resumed run sees exactly the batches of an uninterrupted one.
    """

    def __init__(self, bucket_keys: Sequence[Hashable], batch_size: int, seed: int, drop_last: bool = False,
                 shuffle: bool = True, sizes: Sequence[int] | None = None):
        """`sizes` (token counts per sample) switches to similar-size grouping: samples are ordered by size
        and cut into batches, so a batch may mix neighbouring sizes (padded by the trainer) instead of
        leaving many part-filled batches of one exact size."""
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if not bucket_keys:
            raise ValueError("no samples to batch")
        self.keys = list(bucket_keys)
        self.sizes = list(sizes) if sizes is not None else None
        self.batch_size, self.seed, self.drop_last, self.shuffle = batch_size, seed, drop_last, shuffle
        self.epoch, self.index = 0, 0

    def epoch_batches(self, epoch: int) -> list[list[int]]:
        rng = random.Random(self.seed * 1_000_003 + epoch)
        if self.sizes is not None:
            return self._similar_batches(rng)
        groups: dict[Hashable, list[int]] = {}
        for i, key in enumerate(self.keys):
            groups.setdefault(key, []).append(i)
        batches = []
        for key in sorted(groups, key=repr):
            members = groups[key]
            if self.shuffle:
                rng.shuffle(members)
            for start in range(0, len(members), self.batch_size):
                chunk = members[start:start + self.batch_size]
                if len(chunk) == self.batch_size or not self.drop_last:
                    batches.append(chunk)
        if self.shuffle:
            rng.shuffle(batches)
        if not batches:
            raise ValueError(f"no full batch of {self.batch_size} in any bucket; lower batch_size or drop_last")
        return batches

    def _similar_batches(self, rng: random.Random) -> list[list[int]]:
        order = list(range(len(self.keys)))
        if self.shuffle:
            rng.shuffle(order)
        # Stable sort by (size, bucket): equal buckets stay together, neighbours in size come next.
        order.sort(key=lambda i: (self.sizes[i], repr(self.keys[i])))
        batches = [order[i:i + self.batch_size] for i in range(0, len(order), self.batch_size)]
        if self.drop_last and batches and len(batches[-1]) < self.batch_size:
            batches.pop()
        if self.shuffle:
            rng.shuffle(batches)
        if not batches:
            raise ValueError(f"fewer than {self.batch_size} samples; lower batch_size")
        return batches

    def __iter__(self) -> Iterator[list[int]]:
        while True:
            batches = self.epoch_batches(self.epoch)
            while self.index < len(batches):
                batch = batches[self.index]
                self.index += 1
                yield batch
            self.epoch, self.index = self.epoch + 1, 0

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "index": self.index}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.index = int(state["epoch"]), int(state["index"])
