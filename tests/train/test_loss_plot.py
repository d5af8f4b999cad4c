"""The loss plot: a smoothed line over the raw values, labelled axes; the Training Status node shows this file."""

from __future__ import annotations

import numpy as np
from PIL import Image

from qwen_edit_core.train.log import _ticks, plot_loss, smooth


def test_smooth_is_a_debiased_moving_average():
    assert smooth([2.0, 2.0, 2.0]) == [2.0, 2.0, 2.0]  # no pull towards 0 at the start
    values = [1.0, 0.0] * 50
    assert max(smooth(values)[10:]) < 0.6 and min(smooth(values)[10:]) > 0.4


def test_ticks_are_round_and_cover_the_range():
    assert _ticks(0.13, 0.61) == [0.2, 0.3, 0.4, 0.5, 0.6]
    assert _ticks(1, 1500) == [500, 1000, 1500]


def test_plot_draws_both_lines_and_labels(tmp_path):
    history = [(s, 1.0 / s + 0.05 * (s % 3)) for s in range(1, 301)]
    image = plot_loss(history, tmp_path / "loss.png")
    pixels = np.asarray(Image.open(tmp_path / "loss.png").convert("RGB"))
    assert pixels.shape == (image.height, image.width, 3)
    blue = (pixels[..., 2] > 150) & (pixels[..., 0] < 80)
    grey = (pixels == 175).all(axis=-1)
    assert blue.sum() > 500 and grey.sum() > 100
    left_band = pixels[:, :30]  # the rotated y-axis label
    assert (left_band < 100).all(axis=-1).sum() > 100
    assert plot_loss([], tmp_path / "empty.png").size == image.size
