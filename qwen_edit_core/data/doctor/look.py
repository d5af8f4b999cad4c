"""The report: the worst pairs side by side (the edited control, the target, their difference, the finding), as one
picture (report.png, which the node shows) and as a page (report.html, the findings in full, to open in a browser)."""

from __future__ import annotations

import base64
import html
import io
import textwrap
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw, ImageOps

from qwen_edit_core.common.files import save_png, write_bytes
from qwen_edit_core.data.doctor.findings import DoctorReport
from qwen_edit_core.data.doctor.pictures import full_rgb

CELL = 160
TEXT_WIDTH = 360
#: the difference is amplified so a faint change shows (clipped at white)
DIFFERENCE_GAIN = 2
#: the pairs the report page shows (each read again at full size, embedded as a small picture)
PAGE_LIMIT = 50


def _cell(image: Image.Image) -> Image.Image:
    return ImageOps.pad(image, (CELL - 4, CELL - 4), color=(128, 128, 128))


def _difference(control: Image.Image, target: Image.Image) -> Image.Image:
    control = control.resize(target.size, Image.BILINEAR) if control.size != target.size else control
    diff = np.abs(np.asarray(target, dtype=np.int16) - np.asarray(control, dtype=np.int16)).mean(axis=2)
    return Image.fromarray(np.clip(diff * DIFFERENCE_GAIN, 0, 255).astype(np.uint8)).convert("RGB")


def worst_pairs(report: DoctorReport, limit: int) -> list[str]:
    """The first `limit` flagged pairs, worst first."""
    return report.flagged[:limit]


def _rows(report: DoctorReport, limit: int) -> list[tuple[str, Image.Image, Image.Image, Image.Image]]:
    """(pair name, control, target, difference) of the `limit` worst flagged pairs: only these few pairs are read
    again, at full size."""
    rows = []
    for name in worst_pairs(report, limit):
        example, measures = report.pairs_measured[name]
        control, target = full_rgb(example.controls[measures.source]), full_rgb(example.target)
        rows.append((name, control, target, _difference(control, target)))
    return rows


def _findings_text(report: DoctorReport, name: str) -> list[str]:
    return [f"{f.kind}: {f.why}" for f in report.findings if f.pair == name]


def _sheet(report: DoctorReport, rows) -> Image.Image:
    """One row per pair of `rows`: control, target, |difference|, the pair's findings."""
    sheet = Image.new("RGB", (3 * CELL + TEXT_WIDTH, CELL * len(rows)), (255, 255, 255))
    draw = ImageDraw.Draw(sheet)
    for row, (name, *images) in enumerate(rows):
        for column, image in enumerate(images):
            sheet.paste(_cell(image), (column * CELL + 2, row * CELL + 2))
        lines = [name] + [line for text in _findings_text(report, name) for line in textwrap.wrap(text, 58)]
        draw.multiline_text((3 * CELL + 8, row * CELL + 6), "\n".join(lines[:11]), fill=(0, 0, 0), spacing=2)
    return sheet


def _data_uri(image: Image.Image) -> str:
    """A PNG data URI of `image` fitted to a cell: the page is one file that opens anywhere."""
    buffer = io.BytesIO()
    _cell(image).save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode("ascii")


_PAGE = """<!DOCTYPE html>
<html><head><meta charset="utf-8"><title>Dataset doctor</title><style>
body {{font-family: sans-serif; margin: 1em}} table {{border-collapse: collapse}}
td, th {{border: 1px solid #ccc; padding: 4px; vertical-align: top; text-align: left}}
pre {{white-space: pre-wrap}}
</style></head><body>
<h1>Dataset doctor</h1>
<pre>{head}</pre>
<table>
<tr><th>pair</th><th>control</th><th>target</th><th>difference (x{gain})</th><th>findings</th></tr>
{rows}
</table></body></html>
"""


def _page(report: DoctorReport, rows) -> str:
    """The report page: the summary's head and notes, then a table row per pair of `rows` (its name, control,
    target and difference as embedded pictures, each finding with its fix)."""
    lines = []
    for name, *images in rows:
        pictures = "".join(f'<td><img src="{_data_uri(image)}" alt="{column}"></td>'
                           for column, image in zip(("control", "target", "difference"), images))
        findings = "".join(f"<li><b>{html.escape(f.kind)}</b>: {html.escape(f.why)}"
                           + (f" <i>(fix: {html.escape(f.fix)})</i>" if f.fix else "") + "</li>"
                           for f in report.findings if f.pair == name)
        escaped = html.escape(name)
        lines.append(f'<tr id="{escaped}"><td>{escaped}</td>{pictures}<td><ul>{findings}</ul></td></tr>')
    head = [line for line in report.summary(limit=0).splitlines() if not line.startswith("  ...")]
    head += report.statistics()
    return _PAGE.format(head=html.escape("\n".join(head)), gain=DIFFERENCE_GAIN, rows="\n".join(lines))


def write_report(report: DoctorReport, folder, limit: int = 12, page_limit: int = PAGE_LIMIT) -> Path | None:
    """Write `report.txt` (the summary), `report.png` (the `limit` worst pairs, as the node shows them) and
    `report.html` beside it (the `page_limit` worst, with their findings in full) into `folder`; returns the
    picture's path (None when nothing is flagged: then only the summary is written)."""
    folder = Path(folder)
    text = "\n".join([report.summary(limit=len(report.findings)), *report.statistics()]) + "\n"
    write_bytes(folder / "report.txt", text.encode("utf-8"))
    rows = _rows(report, max(limit, page_limit))
    if not rows:
        return None
    save_png(_sheet(report, rows[:limit]), folder / "report.png")
    write_bytes(html_path(folder / "report.png"), _page(report, rows).encode("utf-8"))
    return folder / "report.png"


def html_path(picture: Path) -> Path:
    """The report page written beside the report picture `picture`."""
    return Path(picture).with_suffix(".html")
