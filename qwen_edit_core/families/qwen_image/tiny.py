"""The tiny random 2025 Qwen-Image model directory (`model.tiny.build_tiny` calls this family's `write`)."""

from __future__ import annotations

from qwen_edit_core.model.tiny import SCHEDULER_CONFIG  # noqa: F401 - the tiny models' scheduler
from qwen_edit_core.model.tiny import write_directory as write  # noqa: F401 - write(dir, variant, seed, size, ...)
