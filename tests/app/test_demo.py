"""The demo on the pretrained toy model: a new edit learned as a LoRA, visibly and measurably."""

from __future__ import annotations

import json

from PIL import Image

from qwen_edit_core.demo import COLUMNS, N_HELD_OUT, SIZE, run_demo


def test_demo_halves_the_pixel_error_and_writes_its_pictures(tmp_path):
    metrics = run_demo(tmp_path, steps=100)
    saved = json.loads((tmp_path / "metrics.json").read_text())
    for key in ("pixel_mse_before", "pixel_mse_after", "latent_mse_before", "latent_mse_after"):
        assert saved[key] == metrics[key]
    assert metrics["pixel_mse_after"] <= 0.5 * metrics["pixel_mse_before"], metrics
    assert metrics["latent_mse_after"] < metrics["latent_mse_before"], metrics
    grid = Image.open(tmp_path / "before_after.png")
    assert grid.size == (len(COLUMNS) * SIZE, 24 + N_HELD_OUT * SIZE)  # a header row of labels, then the pictures
    assert (tmp_path / "train" / "loss.png").is_file()
