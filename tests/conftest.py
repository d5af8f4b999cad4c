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
