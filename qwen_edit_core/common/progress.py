"""Progress and cancellation between the core and whoever drives it (CLI, ComfyUI nodes, tests).

The core reports through a plain callable and checks a `CancelToken` between steps; it never imports a UI.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Callable, Optional

import torch


class Cancelled(RuntimeError):
    """Raised between steps when the caller asked to stop."""


@dataclass(frozen=True)
class Progress:
    """One step of a stage ("sample", "cache", "train"); `preview` is the current latent for previews."""

    stage: str
    step: int
    total: int
    loss: Optional[float] = None
    preview: Optional[torch.Tensor] = None


ProgressFn = Callable[[Progress], None]


class CancelToken:
    """A thread-safe stop flag; `check()` raises `Cancelled` once `cancel()` was called."""

    def __init__(self) -> None:
        self._event = threading.Event()

    def cancel(self) -> None:
        self._event.set()

    @property
    def cancelled(self) -> bool:
        return self._event.is_set()

    def check(self) -> None:
        if self._event.is_set():
            raise Cancelled("cancelled by request")
