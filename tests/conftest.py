"""Shared fixtures: the tiny models are built once per test session, offline."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def tiny_edit_dir(tmp_path_factory):
    from qwen_edit_core.tiny import build_tiny
    return build_tiny(tmp_path_factory.mktemp("tiny") / "edit", variant="edit", seed=0)


@pytest.fixture(scope="session")
def tiny_plus_dir(tmp_path_factory):
    from qwen_edit_core.tiny import build_tiny
    return build_tiny(tmp_path_factory.mktemp("tiny") / "edit-plus", variant="edit-plus", seed=1)


def make_pairs(folder, n=4, size=(64, 64), seed=0, caption="invert the colors"):
    """A flat-layout dataset of `n` pairs: target = inverted control."""
    import numpy as np
    from PIL import Image
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    for i in range(n):
        control = rng.integers(0, 255, (size[1], size[0], 3), dtype=np.uint8)
        Image.fromarray(control).save(folder / f"p{i}_control.png")
        Image.fromarray(255 - control).save(folder / f"p{i}.png")
        (folder / f"p{i}.txt").write_text(f"{caption} {i}" if i % 2 else caption, encoding="utf-8")
    return folder


@pytest.fixture(scope="session")
def pairs_dir(tmp_path_factory):
    return make_pairs(tmp_path_factory.mktemp("data") / "pairs")


def train_config(model_dir, data_dir, out_dir, cache_dir=None, **sections):
    """A small, fast training config on the tiny model (overrides by section)."""
    from qwen_edit_core import load_config
    base = {"model": {"pretrained_model_name_or_path": str(model_dir),
                      "lora": {"rank": 4, "alpha": 4.0, "targets": "all"}},
            "data": {"folder": str(data_dir), "vae_area": 64 * 64, "batch_size": 2},
            "cache": {"dir": str(cache_dir or out_dir / "cache")},
            "train": {"output_dir": str(out_dir), "max_steps": 4, "seed": 3},
            "optimizer": {"lr": 1e-3}}
    for section, values in sections.items():
        base[section] = {**base.get(section, {}), **values}
    return load_config(overrides=base)
