"""The report picture: the worst pairs side by side (the edited control, the target, their difference, the finding)."""

from __future__ import annotations

import textwrap
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw, ImageOps

from qwen_edit_core.data.doctor.findings import DoctorReport
from qwen_edit_core.data.doctor.pictures import full_rgb

CELL = 160
TEXT_WIDTH = 360
#: the difference is amplified so a faint change shows (clipped at white)
DIFFERENCE_GAIN = 2


def _cell(image: Image.Image) -> Image.Image:
    return ImageOps.pad(image, (CELL - 4, CELL - 4), color=(128, 128, 128))


def _difference(control: Image.Image, target: Image.Image) -> Image.Image:
    control = control.resize(target.size, Image.BILINEAR) if control.size != target.size else control
    diff = np.abs(np.asarray(target, dtype=np.int16) - np.asarray(control, dtype=np.int16)).mean(axis=2)
    return Image.fromarray(np.clip(diff * DIFFERENCE_GAIN, 0, 255).astype(np.uint8)).convert("RGB")


def worst_pairs(report: DoctorReport, limit: int) -> list[str]:
    """The first `limit` flagged pairs, worst first."""
    return report.flagged[:limit]


def report_image(report: DoctorReport, limit: int = 12) -> Image.Image | None:
    """One row per flagged pair (at most `limit`): control, target, |difference|, the pair's findings; None when
    nothing is flagged. Only these few pairs are read again, at full size."""
    names = worst_pairs(report, limit)
    if not names:
        return None
    sheet = Image.new("RGB", (3 * CELL + TEXT_WIDTH, CELL * len(names)), (255, 255, 255))
    # the difference column on mid grey, so that both no change (black) and a large one (white) show
    draw = ImageDraw.Draw(sheet)
    for row, name in enumerate(names):
        example, measures = report.pairs_measured[name]
        control, target = full_rgb(example.controls[measures.source]), full_rgb(example.target)
        for column, image in enumerate((control, target, _difference(control, target))):
            sheet.paste(_cell(image), (column * CELL + 2, row * CELL + 2))
        lines = [name] + [line for f in report.findings if f.pair == name
                          for line in textwrap.wrap(f"{f.kind}: {f.why}", 58)]
        draw.multiline_text((3 * CELL + 8, row * CELL + 6), "\n".join(lines[:11]), fill=(0, 0, 0), spacing=2)
    return sheet


def write_report(report: DoctorReport, folder, limit: int = 12) -> Path | None:
    """Write `report.png` (the worst pairs) and `report.txt` (the summary) into `folder`; returns the picture's path
    (None when nothing is flagged: then only the summary is written)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "report.txt").write_text(report.summary(limit=len(report.findings)) + "\n", encoding="utf-8")
    image = report_image(report, limit)
    if image is None:
        return None
    image.save(folder / "report.png")
    return folder / "report.png"
