"""`ruff check` passes on the whole repository, with the rules pyproject.toml's `[tool.ruff]` selects."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_ruff_check_passes():
    assert importlib.util.find_spec("ruff"), "ruff is missing: it comes with the test extras (pip install -e '.[test]')"
    done = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", str(ROOT)], cwd=ROOT,
                          capture_output=True, text=True)
    assert done.returncode == 0, f"ruff check found problems (`ruff check --fix` fixes some):\n{done.stdout}{done.stderr}"
