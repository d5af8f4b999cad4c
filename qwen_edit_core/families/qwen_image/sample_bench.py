"""The 2025 Qwen-Image family's sampling bench: bench/sample.py's tables (`qwen-edit bench sample`)."""

from __future__ import annotations

from qwen_edit_core.bench.sample import run_packed as run  # noqa: F401 - this family's `run`
