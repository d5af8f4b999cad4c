"""Fixtures of the node tests."""

from __future__ import annotations

import pytest


@pytest.fixture
def env(tmp_path, monkeypatch):
    """The pack's folders (home, loras, output) and the working directory under the test's own tmp_path."""
    for name in ("QWEN_EDIT_HOME", "QWEN_EDIT_LORAS", "QWEN_EDIT_OUTPUT"):
        monkeypatch.setenv(name, str(tmp_path / name.lower()))
    monkeypatch.chdir(tmp_path)
    return tmp_path
