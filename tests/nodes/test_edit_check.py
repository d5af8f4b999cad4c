"""The real-ComfyUI check that the training workflows' pictures show the learned edit (tools/comfy_test/
edit_check.py) tells an inverted picture from a kept one, in validation grids and saved images."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

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
