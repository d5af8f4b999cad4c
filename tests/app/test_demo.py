"""The demo on the pretrained toy model: a new edit learned as a LoRA, visibly and measurably."""

from __future__ import annotations

import json
import logging

import numpy as np
import pytest
from PIL import Image

from qwen_edit_core.demo import COLUMNS, N_HELD_OUT, SIZE, edge_similarity, run_demo
from qwen_edit_core.data import synthetic

from conftest import KEEPS_THE_SHAPES


def test_demo_learns_the_edit_and_keeps_the_shapes(tmp_path, caplog):
    """The demo as `make demo` runs it: the held-out pictures after the LoRA are much closer to the inverted
    targets, and each keeps the shapes of its control (edge similarity), as the README's picture shows. It says
    what it is doing as it goes: each phase logged when it starts, every cache and training step reported."""
    events = []
    with caplog.at_level(logging.INFO, logger="qwen_edit_core.demo"):
        metrics = run_demo(tmp_path, progress=events.append)
    phases = [r.getMessage() for r in caplog.records if r.name == "qwen_edit_core.demo"]
    assert [m.split(" ", 2)[1] for m in phases[:5]] == ["toy", "sampling", "encoding", "training", "sampling"]
    assert [e.step for e in events if e.stage == "train"] == list(range(1, metrics["train_steps"] + 1))
    assert any(e.stage == "cache" for e in events)
    saved = json.loads((tmp_path / "metrics.json").read_text())
    for key in ("pixel_mse_before", "pixel_mse_after", "latent_mse_before", "latent_mse_after",
                "edge_similarity_before", "edge_similarity_after"):
        assert saved[key] == metrics[key]
    assert metrics["pixel_mse_after"] <= 0.1 * metrics["pixel_mse_before"], metrics
    assert metrics["latent_mse_after"] < 0.5 * metrics["latent_mse_before"], metrics
    grid = Image.open(tmp_path / "before_after.png")
    assert grid.size == (len(COLUMNS) * SIZE, 24 + N_HELD_OUT * SIZE)  # a header row of labels, then the pictures
    pictures = np.asarray(grid.convert("RGB"), dtype=np.float64) / 255.0
    for row in range(N_HELD_OUT):
        cells = pictures[24 + row * SIZE:24 + (row + 1) * SIZE].reshape(SIZE, len(COLUMNS), SIZE, 3)
        target, after = cells[:, COLUMNS.index("target")], cells[:, COLUMNS.index("after LoRA")]
        assert edge_similarity(after, target) >= KEEPS_THE_SHAPES, f"held-out pair {row}: the shapes are lost"
    assert (tmp_path / "train" / "loss.png").is_file()


def test_edge_similarity_sees_shapes_not_colours():
    """An inverted picture has its control's edges exactly (1.0); noise and a blocky copy score low."""
    control = np.asarray(synthetic.picture(np.random.default_rng(3), SIZE), dtype=np.float64) / 255.0
    assert edge_similarity(1.0 - control, control) > 0.999
    noise = np.random.default_rng(4).random(control.shape)
    assert abs(edge_similarity(noise, control)) < 0.1
    blocks = control.reshape(8, 16, 8, 16, 3).mean(axis=(1, 3)).repeat(16, axis=0).repeat(16, axis=1)
    assert edge_similarity(blocks, control) < KEEPS_THE_SHAPES


@pytest.mark.slow
def test_demo_on_the_toy_2_1_learns_the_edit(tmp_path):
    """A short demo run on the toy Qwen-Image-2.1 (the control as reference 1): after 100 LoRA steps every
    held-out picture is closer to its inverted target than before training, and on average much closer, in
    pixels and in latents."""
    metrics = run_demo(tmp_path, steps=100, variant="image-2.1")
    assert metrics["pixel_mse_after"] <= 0.35 * metrics["pixel_mse_before"], metrics
    assert metrics["latent_mse_after"] <= 0.4 * metrics["latent_mse_before"], metrics
    # the LoRA trained on the base keeps its edit at 2.1-Turbo's 8-step sigma list (run unshifted, as on Turbo)
    assert metrics["fewstep_pixel_mse_after"] <= 0.5 * metrics["fewstep_pixel_mse_before"], metrics
    pictures = np.asarray(Image.open(tmp_path / "before_after.png").convert("RGB"), dtype=np.float64) / 255.0
    for row in range(N_HELD_OUT):
        cells = pictures[24 + row * SIZE:24 + (row + 1) * SIZE].reshape(SIZE, len(COLUMNS), SIZE, 3)
        target = cells[:, COLUMNS.index("target")]
        before, after = (np.mean((cells[:, COLUMNS.index(c)] - target) ** 2) for c in ("before LoRA", "after LoRA"))
        assert after < 0.5 * before, f"held-out pair {row}: pixel MSE to the target {before:.4f} -> {after:.4f}"
