"""Files written whole or not at all: a unique temporary name in the target folder, fsync, then rename."""

from __future__ import annotations

import os
import uuid
from pathlib import Path
from typing import Mapping

import torch


def temporary_name(path: Path) -> Path:
    """A hidden name beside `path`, unique per process and call (concurrent writers never share one)."""
    return path.parent / f".{path.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp"


def save_safetensors(tensors: Mapping[str, torch.Tensor], path, metadata: dict[str, str] | None = None) -> Path:
    """Write a safetensors file atomically, readable like any other file (safetensors creates 0600)."""
    from safetensors.torch import save_file

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = temporary_name(path)
    try:
        save_file({k: v.detach().to("cpu").contiguous() for k, v in tensors.items()}, tmp, metadata=metadata)
        os.chmod(tmp, 0o644)
        with open(tmp, "rb") as fh:
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path
