"""`--fix`: a copy of the dataset with the safe fixes applied; the original folder is never written.

Applied: swapped pairs swapped back, references reordered, duplicate and unchanged pairs dropped, masks wholly off
the edit inverted, captions' trailing noise removed, the text encoder's captions written for pairs that had
none (`--vlm`), and, for pixel-aligned edits only, shifted or zoomed targets
realigned onto their control (`realign`). Everything else is left for a person to judge."""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

import numpy as np
from PIL import Image

from qwen_edit_core.data.captions import CAPTIONS_DIR
from qwen_edit_core.data.doctor.findings import PROPOSED_CAPTION, DoctorReport, DoctorSettings, Finding
from qwen_edit_core.data.doctor.measure import gradient, register
from qwen_edit_core.data.doctor.pictures import full_rgb
from qwen_edit_core.data.examples import EditExample

log = logging.getLogger(__name__)

#: the phase correlation's subpixel precision when realigning (1/10 px)
UPSAMPLE = 10


def _valid_box(size: tuple[int, int], scale: float, shift_rc: np.ndarray) -> tuple[int, int, int, int]:
    """The control-grid box (left, top, right, bottom) where the realigned target has pixels of its own."""
    w, h = size
    bounds = []
    for extent, shift in ((w, shift_rc[1]), (h, shift_rc[0])):
        centre = extent / 2
        low, high = centre + (shift - centre) / scale, centre + (extent + shift - centre) / scale
        bounds.append((max(0, int(np.ceil(low))), min(extent, int(np.floor(high)))))
    (left, right), (top, bottom) = bounds
    return left, top, right, bottom


def _warp_rgb(image: Image.Image, scale: float, shift_rc: np.ndarray) -> Image.Image:
    """`image` resampled onto the control's grid: pixel p takes the target at scale * (p - centre) + centre - shift."""
    w, h = image.size
    data = (scale, 0.0, w / 2 - scale * w / 2 - shift_rc[1], 0.0, scale, h / 2 - scale * h / 2 - shift_rc[0])
    return image.transform((w, h), Image.AFFINE, data, resample=Image.BICUBIC)


def realign(control: Image.Image, target: Image.Image) -> tuple[Image.Image, Image.Image, tuple[float, float, float]]:
    """(control, target) realigned: the target registered onto the control at full size (subpixel phase
    correlation and zoom), both cropped to where the target has pixels and resampled back to the control's size;
    returns them with the (dx, dy, zoom) taken out."""
    size = control.size
    target = target.resize(size, Image.BICUBIC) if target.size != size else target
    as_array = lambda image: np.asarray(image, dtype=np.float32) / 255.0  # noqa: E731
    shift, scale, _ = register(gradient(as_array(control)), gradient(as_array(target)), upsample=UPSAMPLE, rounds=3)
    box = _valid_box(size, scale, shift)
    if box[2] - box[0] < size[0] // 2 or box[3] - box[1] < size[1] // 2:
        raise ValueError(f"the target overlaps its control by less than half ({box}); not realigned")
    warped = _warp_rgb(target, scale, shift)
    return (control.crop(box).resize(size, Image.LANCZOS), warped.crop(box).resize(size, Image.LANCZOS),
            (float(-shift[1]), float(-shift[0]), scale))


def _moved(path: Path, source: Path, out: Path) -> Path:
    return out / Path(path).relative_to(source)


def _caption_file(example: EditExample, source: Path, out: Path) -> Path | None:
    for path in (example.target.with_suffix(".txt"), source / CAPTIONS_DIR / f"{example.name}.txt"):
        if path.is_file():
            return _moved(path, source, out)
    return None


def _swap_pictures(a: Path, b: Path) -> None:
    """Exchange two pictures' contents, each re-encoded in its own file's format."""
    first, second = full_rgb(a), full_rgb(b)
    second.save(a)
    first.save(b)


def _apply(finding: Finding, example: EditExample, source: Path, out: Path, settings: DoctorSettings,
           measures) -> str | None:
    """Apply one finding's fix in `out`; returns what was done, or None when it is not a safe one."""
    controls = [_moved(p, source, out) for p in example.controls]
    target = _moved(example.target, source, out)
    if finding.kind == "swapped":
        _swap_pictures(controls[measures.source], target)
        return "swapped control and target"
    if finding.kind == "reference-order":
        order = [int(k) - 1 for k in finding.fix.split(":")[1].split(",")]
        moved = [i for i, k in enumerate(order) if i != k]
        _swap_pictures(controls[moved[0]], controls[moved[1]])
        return f"reordered the controls {finding.fix.split(':')[1].strip()}"
    if finding.kind in ("duplicate", "no-change") and finding.fix.startswith("drop the pair"):
        for path in [*controls, target, _caption_file(example, source, out),
                     _moved(example.mask, source, out) if example.mask else None]:
            if path is not None:
                path.unlink(missing_ok=True)
        return "dropped the pair"
    if finding.kind == "mask" and finding.fix == "invert the mask":
        mask = _moved(example.mask, source, out)
        with Image.open(mask) as img:
            Image.fromarray(255 - np.asarray(img.convert("L"))).save(mask)
        return "inverted the mask"
    if finding.kind == "caption" and finding.fix and finding.fix.startswith(PROPOSED_CAPTION):
        caption = _caption_file(example, source, out) or _moved(example.target.with_suffix(".txt"), source, out)
        caption.write_text(finding.fix[len(PROPOSED_CAPTION):] + "\n", encoding="utf-8")
        return f"wrote the machine-proposed caption to {caption.name} (check it)"
    if finding.kind == "caption" and finding.fix and finding.fix.startswith("caption: "):
        caption = _caption_file(example, source, out)
        caption.write_text(finding.fix[len("caption: "):].strip("'\"") + "\n", encoding="utf-8")
        return "removed the caption's trailing noise"
    if finding.kind == "misaligned" and settings.pixel_aligned:
        control, aligned, (dx, dy, zoom) = realign(full_rgb(controls[measures.source]), full_rgb(target))
        control.save(controls[measures.source])
        aligned.save(target)
        return f"realigned the target (took out {dx + 0.0:.1f}, {dy + 0.0:.1f} px, zoom {zoom:.3f})"
    return None


def apply_fixes(report: DoctorReport, source, out, settings: DoctorSettings) -> list[str]:
    """Copy the dataset folder `source` to `out` (a new or empty folder outside it) and apply the report's safe
    fixes there; returns one line per fix applied."""
    source, out = Path(source).resolve(), Path(out).resolve()
    if out == source or source in out.parents:
        raise ValueError(f"--fix folder {str(out)!r} lies in the dataset folder {str(source)!r}; give a folder "
                         "outside it (the original is never changed)")
    if out.exists() and any(out.iterdir()):
        raise FileExistsError(f"--fix folder {str(out)!r} is not empty; give a new folder")
    shutil.copytree(source, out, dirs_exist_ok=True)
    held = {f.pair for f in report.findings if f.kind == "leak"}
    by_name = {name: value for name, value in report.pairs_measured.items() if name not in held}
    done, dropped = [], set()
    for finding in report.findings:
        if finding.pair not in by_name or finding.pair in dropped:
            continue  # held-out pairs live elsewhere; a dropped pair needs nothing more
        example, measure = by_name[finding.pair]
        try:
            what = _apply(finding, example, source, out, settings, measure)
        except ValueError as err:
            what = None
            log.warning("%s: %s not fixed: %s", finding.pair, finding.kind, err)
        if what:
            done.append(f"{finding.pair}: {what}")
            if what == "dropped the pair":
                dropped.add(finding.pair)
    log.info("doctor --fix: %d fix(es) applied in %s", len(done), out)
    return done
