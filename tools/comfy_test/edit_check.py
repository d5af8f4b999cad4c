"""Whether the shipped workflows' pictures show the edit the toy model learns ("invert the colors"): the last
validation image of each training run (what the live view and Training Status show), the picture the
train-then-sample workflow saves, and, for contrast, the picture sampled without a LoRA. Each is measured by
its mean absolute difference (0-255) to the control and to the control's colour inversion (the target).

The Qwen-Image-2.1 training workflow's edit is its own pair's (Save Pair To Dataset's folder): the picture it samples
with the new LoRA must be closer to the pair's target than to its first reference (what the toy 2.1 model copies
without a LoRA) where the two differ, the right half, and keep the shapes of each half: the 2025 demo's edge
similarity (`demo.edge_similarity`) of each half to the target's (`half_edge_similarity`) reaches KEEPS_THE_SHAPES.
The 2.1 sample workflow's grey picture keeps its control's light and dark: its luminance correlation to the control's
grayscale reaches KEEPS_THE_LUMINANCE (a grey picture's edges are faint: tests/toys/test_toy21.py)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from PIL import Image

#: the demo pairs the Synthetic Demo Dataset writes (its default folder); its example_control is pair000's control
DEMO_CONTROL = Path("input") / "qwen_edit_demo_pairs" / "pair000_control.png"
#: an edited picture must be at least this much closer to the inverted control than to the control
MARGIN = 0.5
#: the 2025 demo's bar for kept shapes (tests/conftest.py's KEEPS_THE_SHAPES, where it is measured)
KEEPS_THE_SHAPES = 0.45
#: the sample workflows' bar for a grey picture's light and dark (tests/conftest.py's KEEPS_THE_LUMINANCE)
KEEPS_THE_LUMINANCE = 0.6
#: the 2.1 workflows' demo picture (their Synthetic Demo Dataset's folder)
DEMO_CONTROL_21 = Path("input") / "qwen_image21_demo_pairs" / "pair000_control.png"
#: the 2.1 training workflow's pair (its Save Pair To Dataset folder and the first name it writes)
PAIR_21 = Path("input") / "qwen_image21_pairs" / "pair_00001"


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


def half_edge_similarity(image: np.ndarray, target: np.ndarray) -> tuple[float, float]:
    """(left, right): `demo.edge_similarity` of each half of `image` to the same half of `target` (RGB arrays of one
    size, any scale). Measured per half because the pasted edit's seam is an edge a mosaic of the two halves'
    colours also has: over the whole picture the toy 2.1's mosaics score 0.59-0.74, as if they kept the shapes."""
    from qwen_edit_core.demo import edge_similarity
    half = target.shape[1] // 2
    return (edge_similarity(image[:, :half] / 255.0, target[:, :half] / 255.0),
            edge_similarity(image[:, half:] / 255.0, target[:, half:] / 255.0))


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
    lines += _check_21(base) + _check_21_grey(base)
    return lines


def _check_21_grey(base: Path) -> list[str]:
    """The 2.1 sample workflow's grey picture against its control's grayscale."""
    from qwen_edit_core.data.synthetic import EDITS
    from qwen_edit_core.demo import luminance_correlation

    lines, saved_pictures = [], sorted((base / "output").glob("qwen_image21_sample_*.png"))
    if not saved_pictures:
        return lines
    grey = EDITS["make it grayscale"](Image.open(base / DEMO_CONTROL_21).convert("RGB"))
    target = np.asarray(grey.convert("RGB"), dtype=np.float64) / 255.0
    for saved in saved_pictures:
        score = luminance_correlation(_rgb(saved) / 255.0, target)
        line = f"{saved.name} (make it grayscale): luminance correlation to the control's grayscale {score:.2f}"
        assert score >= KEEPS_THE_LUMINANCE, f"the light and dark are lost: {line}"
        lines.append(line)
    return lines


def _check_21(base: Path) -> list[str]:
    """The 2.1 training workflow's sampled picture against its pair's target and first reference (right half)."""
    target_path = base / PAIR_21.with_suffix(".png")
    if not target_path.is_file():
        return []
    target = _rgb(target_path)
    reference = _rgb(base / PAIR_21.parent / f"{PAIR_21.name}_control_1.png")
    half = target.shape[1] // 2
    lines = []
    for saved in sorted((base / "output").glob("qwen_image21_after_training_*.png")):
        picture = _rgb(saved)
        image = picture[:, half:]
        to_target = float(np.abs(image - target[:, half:]).mean())
        to_reference = float(np.abs(image - reference[:, half:]).mean())
        left, right = half_edge_similarity(picture, target)
        line = (f"{saved.name} (sampled with the new LoRA), right half: mean |difference| to the pair's target "
                f"{to_target:.1f}/255, to its first reference {to_reference:.1f}/255; edge similarity to the "
                f"target per half {left:.2f}, {right:.2f}")
        assert to_target < MARGIN * to_reference, f"the edit is not visible: {line}"
        assert min(left, right) >= KEEPS_THE_SHAPES, f"the shapes are lost: {line}"
        lines.append(line)
    return lines
