"""Loss logging: a CSV row per step, TensorBoard when installed and asked for, and a loss plot PNG.

The plot is drawn with Pillow (no plotting library needed): raw loss in grey, a moving average in blue.
"""

from __future__ import annotations

import csv
import logging
from pathlib import Path

from PIL import Image, ImageDraw

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
        with open(self.path, "a", newline="") as fh:
            csv.writer(fh).writerow([step, f"{loss:.8g}"])
        if self._tb is not None:
            self._tb.add_scalar("loss", loss, step)
            self._tb.add_scalar("lr", lr, step)

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()


def plot_loss(history: list[tuple[int, float]], path: Path, size: tuple[int, int] = (640, 360)) -> Image.Image:
    """Draw the loss curve; writes `path` and returns the image."""
    width, height = size
    image = Image.new("RGB", size, "white")
    draw = ImageDraw.Draw(image)
    margin = 40
    draw.rectangle([margin, 10, width - 10, height - margin], outline="black")
    if history:
        steps = [s for s, _ in history]
        losses = [v for _, v in history]
        lo, hi = min(losses), max(losses)
        span_s = max(steps[-1] - steps[0], 1)
        span_l = max(hi - lo, 1e-12)

        def xy(step, value):
            x = margin + (step - steps[0]) / span_s * (width - 10 - margin)
            y = height - margin - (value - lo) / span_l * (height - margin - 10)
            return x, y

        draw.line([xy(s, v) for s, v in history], fill=(170, 170, 170), width=1)
        window = max(1, len(history) // 20)
        smooth = [sum(losses[max(0, i - window + 1): i + 1]) / len(losses[max(0, i - window + 1): i + 1])
                  for i in range(len(losses))]
        draw.line([xy(s, v) for s, v in zip(steps, smooth)], fill=(30, 90, 200), width=2)
        draw.text((margin + 4, 12), f"loss {hi:.4g}", fill="black")
        draw.text((margin + 4, height - margin - 14), f"{lo:.4g}", fill="black")
        draw.text((margin, height - margin + 6), f"step {steps[0]}", fill="black")
        draw.text((width - 90, height - margin + 6), f"step {steps[-1]}", fill="black")
    path.parent.mkdir(parents=True, exist_ok=True)
    image.save(path)
    return image
