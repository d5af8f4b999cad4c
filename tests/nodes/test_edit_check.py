"""The real-ComfyUI check that the training workflows' pictures show the learned edit (tools/comfy_test/
edit_check.py) tells an inverted picture from a kept one, in validation grids and saved images."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools" / "comfy_test"))
from edit_check import DEMO_CONTROL, check_edits  # noqa: E402

from qwen_edit_core.data.synthetic import invert, picture  # noqa: E402
from qwen_edit_core.train.validation import labelled_grid  # noqa: E402


def _base(tmp_path, shown):
    """A base directory with one training run whose validation grid shows `shown(control)` twice."""
    control = picture(np.random.default_rng(0), 128)
    run = tmp_path / "output" / "qwen_edit_runs" / "demo"
    (run / "validation").mkdir(parents=True)
    control.save(run / "validation_input.png")
    panel = np.asarray(shown(control))
    labelled_grid([panel, panel], ["a", "b"]).save(run / "validation" / "step-0000150.png")
    (tmp_path / DEMO_CONTROL).parent.mkdir(parents=True)
    control.save(tmp_path / DEMO_CONTROL)
    shown(control).save(tmp_path / "output" / "qwen_edit_after_training_00001_.png")
    return tmp_path


def test_an_inverted_picture_passes_and_a_kept_one_fails(tmp_path):
    lines = check_edits(_base(tmp_path / "inverted", invert))
    assert len(lines) == 3 and all("to the inverted control 0.0/255" in line for line in lines)
    assert lines[0].startswith("demo validation step-0000150 picture 1")
    with pytest.raises(AssertionError, match="the edit is not visible: demo validation step-0000150 picture 1"):
        check_edits(_base(tmp_path / "kept", lambda image: image.copy()))
    assert check_edits(tmp_path / "nothing") == []


def test_the_pasted_halves_shapes_are_measured_per_half():
    """The 2.1 training workflow's target has a seam down its middle that a mosaic of its 16 px cells' colours keeps:
    over the whole picture such a mosaic reaches the 2025 demo's edge-similarity threshold, per half it does not;
    the target itself scores 1 in each half."""
    from edit_check import half_edge_similarity

    from qwen_edit_core.demo import edge_similarity

    before = picture(np.random.default_rng(0), 128)
    target = before.copy()
    target.paste(invert(before).crop((0, 0, 64, 128)), (64, 0))
    pixels = np.asarray(target, dtype=np.float64)
    cells = pixels.reshape(8, 16, 8, 16, 3).mean(axis=(1, 3))
    mosaic = np.repeat(np.repeat(cells, 16, axis=0), 16, axis=1)
    assert edge_similarity(mosaic / 255, pixels / 255) >= 0.45
    assert max(half_edge_similarity(mosaic, pixels)) < 0.45
    assert half_edge_similarity(pixels, pixels) == pytest.approx((1.0, 1.0))


def test_the_shape_bar_is_the_demos():
    import edit_check
    from conftest import KEEPS_THE_LUMINANCE, KEEPS_THE_SHAPES

    assert edit_check.KEEPS_THE_SHAPES == KEEPS_THE_SHAPES
    assert edit_check.KEEPS_THE_LUMINANCE == KEEPS_THE_LUMINANCE


def test_the_21_sample_workflows_grey_picture_passes_and_a_blank_fails(tmp_path):
    from qwen_edit_core.data.synthetic import EDITS

    from edit_check import DEMO_CONTROL_21

    control = picture(np.random.default_rng(3), 128)
    for case, saved in (("grey", EDITS["make it grayscale"](control)), ("blank", Image.new("RGB", (128, 128), "grey"))):
        (tmp_path / case / DEMO_CONTROL_21).parent.mkdir(parents=True)
        (tmp_path / case / "output").mkdir()
        control.save(tmp_path / case / DEMO_CONTROL_21)
        noise = np.random.default_rng(0).integers(0, 4, (128, 128, 3))  # a blank's correlation is undefined
        Image.fromarray((np.asarray(saved.convert("RGB")) + noise).clip(0, 255).astype(np.uint8)).save(
            tmp_path / case / "output" / "qwen_image21_sample_00001_.png")
    (line,) = check_edits(tmp_path / "grey")
    assert "luminance correlation to the control's grayscale 1.00" in line
    with pytest.raises(AssertionError, match="the light and dark are lost"):
        check_edits(tmp_path / "blank")


def test_the_21_training_pictures_mosaic_fails_and_its_target_passes(tmp_path):
    """The 2.1 training workflow's sampled picture: the pair's target itself passes; a mosaic of the target's 16 px
    cells, which has the right colours per half but no shapes, fails as lost shapes."""
    from edit_check import PAIR_21

    before = picture(np.random.default_rng(3), 128)
    target = before.copy()
    target.paste(invert(before).crop((0, 0, 64, 128)), (64, 0))
    cells = np.asarray(target, dtype=np.float64).reshape(8, 16, 8, 16, 3).mean(axis=(1, 3))
    mosaic = np.repeat(np.repeat(cells, 16, axis=0), 16, axis=1).round().astype(np.uint8)
    for case, sampled in (("target", target), ("mosaic", Image.fromarray(mosaic))):
        base = tmp_path / case
        (base / PAIR_21.parent).mkdir(parents=True)
        (base / "output").mkdir()
        target.save(base / PAIR_21.with_suffix(".png"))
        before.save(base / PAIR_21.parent / f"{PAIR_21.name}_control_1.png")
        sampled.save(base / "output" / "qwen_image21_after_training_00001_.png")
    (line,) = check_edits(tmp_path / "target")
    assert "edge similarity to the target per half 1.00, 1.00" in line
    with pytest.raises(AssertionError, match="the shapes are lost"):
        check_edits(tmp_path / "mosaic")
