"""The 2025 Qwen-Image family's training batch: train/batch.py's packed layout as it is (each sample's controls
after its target's 2x2-patch tokens, mixed sizes padded into one call)."""

from __future__ import annotations

from qwen_edit_core.train.batch import collate_packed as collate  # noqa: F401 - this family's stage functions
from qwen_edit_core.train.batch import predict_packed as predict  # noqa: F401
