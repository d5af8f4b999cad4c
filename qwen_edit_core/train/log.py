"""Loss logging: a CSV row per step, TensorBoard when installed and asked for, and a loss plot PNG.

The plot is drawn with Pillow (no plotting library needed): labelled axes with ticks, raw loss in grey and
an exponential moving average in blue.
"""

from __future__ import annotations

import csv
import logging
import math
from pathlib import Path

from PIL import Image, ImageDraw, ImageFont

from qwen_edit_core.common.files import save_png, writing

log = logging.getLogger(__name__)


class LossLog:
    """Appends (step, loss, lr) to `loss.csv`; keeps the history for the plot and the job's live view."""

    def __init__(self, out_dir: Path, *, tensorboard: bool = False, start_step: int = 0):
        self.path = out_dir / "loss.csv"
        self.history: list[tuple[int, float]] = []
        if self.path.is_file():
            with open(self.path, newline="") as fh:
                # Keep rows up to the resume step: a resumed run rewrites what came after.
                self.history = [(int(r["step"]), float(r["loss"])) for r in csv.DictReader(fh)
                                if int(r["step"]) <= start_step]
        with writing(self.path, "the loss log", key="train.output_dir"):
            out_dir.mkdir(parents=True, exist_ok=True)
            with open(self.path, "w", newline="") as fh:
                writer = csv.writer(fh)
                writer.writerow(["step", "loss"])
                writer.writerows(self.history)
        self._tb = None
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
                self._tb = SummaryWriter(str(out_dir / "tensorboard"))
            except ImportError:
                log.warning("tensorboard is not installed; logging to loss.csv only (pip install tensorboard)")

    def add(self, step: int, loss: float, lr: float) -> None:
        self.history.append((step, loss))
        from qwen_edit_core.train.checkpoint import survivor
        with writing(self.path, f"the loss of step {step}", lambda: survivor(self.path.parent / "checkpoints"),
                     key="train.output_dir"), open(self.path, "a", newline="") as fh:
            csv.writer(fh).writerow([step, f"{loss:.8g}"])
        if self._tb is not None:
            self._tb.add_scalar("loss", loss, step)
            self._tb.add_scalar("lr", lr, step)

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()


def smooth(values: list[float], weight: float = 0.9) -> list[float]:
    """Debiased exponential moving average (TensorBoard's smoothing): each point weighs the past by `weight`."""
    out, avg = [], 0.0
    for i, value in enumerate(values):
        avg = weight * avg + (1 - weight) * value
        out.append(avg / (1 - weight ** (i + 1)))
    return out


def _ticks(lo: float, hi: float, count: int = 5) -> list[float]:
    """About `count` round tick values covering [lo, hi]."""
    span = max(hi - lo, 1e-12)
    raw = span / count
    step = 10 ** math.floor(math.log10(raw))
    step *= next(m for m in (1, 2, 5, 10) if raw <= m * step)
    first = math.ceil(lo / step) * step
    digits = max(0, -math.floor(math.log10(step)))
    return [round(first + i * step, digits) for i in range(int((hi - first) / step + 1e-9) + 1)]


def plot_loss(history: list[tuple[int, float]], path: Path, size: tuple[int, int] = (720, 400),
              title: str = "Training loss", ylabel: str = "loss (velocity MSE, latent units)") -> Image.Image:
    """Draw the loss curve with labelled axes (x: optimizer step, y: flow-matching loss, the mean squared error
    of the predicted velocity in normalized latent units, or `ylabel`), the raw values in grey and a smoothed line
    (`smooth`) in blue; writes `path` (PNG) and returns the image."""
    width, height = size
    image = Image.new("RGB", size, "white")
    draw = ImageDraw.Draw(image)
    font = ImageFont.load_default(size=13)
    left, right, top, bottom = 78, width - 16, 34, height - 52
    draw.text((width // 2, 8), title, fill="black", font=ImageFont.load_default(size=16), anchor="mt")
    draw.text((width // 2, height - 8), "optimizer step", fill="black", font=font, anchor="mb")
    label = Image.new("RGB", (bottom - top, 16), "white")
    ImageDraw.Draw(label).text(((bottom - top) // 2, 8), ylabel, fill="black",
                               font=font, anchor="mm")
    image.paste(label.rotate(90, expand=True), (4, top))
    draw.rectangle([left, top, right, bottom], outline="black")
    if history:
        steps = [s for s, _ in history]
        losses = [v for _, v in history]
        lo, hi = min(losses), max(losses)
        if hi - lo < 1e-12:
            lo, hi = lo - 0.5 * abs(lo or 1), hi + 0.5 * abs(hi or 1)
        s0, s1 = steps[0], max(steps[-1], steps[0] + 1)

        def xy(step, value):
            return (left + (step - s0) / (s1 - s0) * (right - left),
                    bottom - (value - lo) / (hi - lo) * (bottom - top))

        for tick in _ticks(lo, hi):
            y = xy(s0, tick)[1]
            draw.line([left - 4, y, left, y], fill="black")
            draw.line([left + 1, y, right - 1, y], fill=(232, 232, 232))
            draw.text((left - 6, y), f"{tick:.3g}", fill="black", font=font, anchor="rm")
        for tick in _ticks(s0, s1):
            x = xy(tick, lo)[0]
            draw.line([x, bottom, x, bottom + 4], fill="black")
            draw.text((x, bottom + 6), f"{tick:g}", fill="black", font=font, anchor="mt")
        if len(history) > 1:
            draw.line([xy(s, v) for s, v in history], fill=(175, 175, 175), width=1)
            draw.line([xy(s, v) for s, v in zip(steps, smooth(losses))], fill=(30, 90, 200), width=3)
        else:
            x, y = xy(*history[0])
            draw.ellipse([x - 3, y - 3, x + 3, y + 3], fill=(30, 90, 200))
        draw.text((right - 6, top + 6), f"last {smooth(losses)[-1]:.4g} (smoothed)  raw: grey", fill=(30, 90, 200),
                  font=font, anchor="ra")
    with writing(path, "a loss plot", key="train.output_dir"):
        save_png(image, path)
    return image
