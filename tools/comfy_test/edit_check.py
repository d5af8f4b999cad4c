"""Whether the shipped workflows' pictures show the edit the toy model learns ("invert the colors"): the last
validation image of each training run (what the live view and Training Status show), the picture the
train-then-sample workflow saves, and, for contrast, the picture sampled without a LoRA. Each is measured by
its mean absolute difference (0-255) to the control and to the control's colour inversion (the target)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from PIL import Image

#: the demo pairs the Synthetic Demo Dataset writes (its default folder); its example_control is pair000's control
DEMO_CONTROL = Path("input") / "qwen_edit_demo_pairs" / "pair000_control.png"
#: an edited picture must be at least this much closer to the inverted control than to the control
MARGIN = 0.5


def _rgb(path: Path) -> np.ndarray:
    return np.asarray(Image.open(path).convert("RGB")).astype(np.float64)


def _panels(grid: np.ndarray, height: int, width: int) -> list[np.ndarray]:
    """The pictures of a validation grid (side by side, each under a label band of the grid's extra height)."""
    band = grid.shape[0] - height
    return [grid[band:, i * width:(i + 1) * width] for i in range(grid.shape[1] // width)]


def _distances(image: np.ndarray, control: np.ndarray) -> tuple[float, float]:
    """(mean |image - inverted control|, mean |image - control|), in 0-255 units."""
    return float(np.abs(image - (255.0 - control)).mean()), float(np.abs(image - control).mean())


def _edited(what: str, image: np.ndarray, control: np.ndarray) -> str:
    to_inverted, to_control = _distances(image, control)
    line = (f"{what}: mean |difference| to the inverted control {to_inverted:.1f}/255, to the control "
            f"{to_control:.1f}/255")
    assert to_inverted < MARGIN * to_control, f"the edit is not visible: {line}"
    return line


def check_edits(base: Path) -> list[str]:
    """One line per picture found under a ComfyUI base directory; AssertionError when one shows no edit."""
    lines = []
    for control_path in sorted((base / "output" / "qwen_edit_runs").glob("*/validation_input.png")):
        control = _rgb(control_path)
        steps = sorted((control_path.parent / "validation").glob("step-*.png"))
        assert steps, f"{control_path.parent.name}: no validation image written"
        for i, panel in enumerate(_panels(_rgb(steps[-1]), *control.shape[:2])):
            lines.append(_edited(f"{control_path.parent.name} validation {steps[-1].stem} picture {i + 1}", panel,
                                 control))
    if (base / DEMO_CONTROL).is_file():
        control = _rgb(base / DEMO_CONTROL)
        for saved in sorted((base / "output").glob("qwen_edit_after_training_*.png")):
            lines.append(_edited(f"{saved.name} (sampled with the new LoRA)", _rgb(saved), control))
        for saved in sorted((base / "output").glob("qwen_edit_lora_sample_*.png")):
            to_inverted, to_control = _distances(_rgb(saved), control)
            lines.append(f"{saved.name} (no LoRA, the toy model keeps the picture): mean |difference| to the "
                         f"inverted control {to_inverted:.1f}/255, to the control {to_control:.1f}/255")
    return lines
