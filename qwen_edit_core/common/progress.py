"""Progress and cancellation between the core and whoever drives it (CLI, ComfyUI nodes, tests).

The core reports through a plain callable and checks a `CancelToken` between steps; it never imports a UI.
`SignalStop` turns SIGINT and SIGTERM (what `docker stop`, `timeout`, Slurm and systemd send) into a cancel
for a command-line run.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import threading
from pathlib import Path
from dataclasses import dataclass
from typing import Callable, Optional

import torch

log = logging.getLogger(__name__)


class Cancelled(RuntimeError):
    """Raised between steps when the caller asked to stop."""


@dataclass(frozen=True)
class Progress:
    """One step of a stage ("sample", "cache", "train"); `preview` is the current latent for previews. A training
    run also reports each file it wrote: stage "checkpoint" (`path`: the checkpoint directory of `step`) and
    "validation" (`path`: the validation latents of `step`; its PNG, once decoded, is beside it); stage "device"
    when it is about to use its device (a step or a validation starts, and once its steps are over), and with each
    "train" step a reader of the storages it holds there (`device_storages()`: speed.device_use.run_storages, a
    walk over every parameter and optimizer state that only a consumer keeping a ledger calls, during the event;
    it holds them weakly and reads {} once the run let them go)."""

    stage: str
    step: int
    total: int
    loss: Optional[float] = None
    preview: Optional[torch.Tensor] = None
    path: Optional[Path] = None
    device_storages: Optional[Callable[[], dict]] = None


ProgressFn = Callable[[Progress], None]


class CancelToken:
    """A thread-safe stop flag; `check()` raises `Cancelled` once `cancel()` was called. `shielded()` marks a
    block that an interrupt must not cut in half (`SignalStop` holds a second signal until the block ends)."""

    def __init__(self) -> None:
        self._event = threading.Event()
        self._shields = 0
        self._held: int | None = None  # a signal that arrived inside a shielded block

    @contextlib.contextmanager
    def shielded(self):
        """Run the block whole: an interrupt `hold` took inside it is raised (`Interrupted`) when it ends."""
        self._shields += 1
        try:
            yield
        finally:
            self._shields -= 1
        if not self._shields and self._held is not None:
            signum, self._held = self._held, None
            raise Interrupted(signum)

    def hold(self, signum: int) -> bool:
        """Inside a shielded block: keep `signum` for its end (True); outside: False (the caller raises now)."""
        if not self._shields:
            return False
        self._held = int(signum)
        return True

    def cancel(self) -> None:
        self._event.set()

    @property
    def cancelled(self) -> bool:
        return self._event.is_set()

    def check(self) -> None:
        if self._event.is_set():
            raise Cancelled("cancelled by request")


class Interrupted(KeyboardInterrupt):
    """A run stopped by signal `signum`; a command exits with 128 + signum (130 for SIGINT, 143 for SIGTERM).
    `saved` says what the run kept (a training run's checkpoint), empty when it stopped before keeping any."""

    def __init__(self, signum: int = signal.SIGINT, saved: str = ""):
        super().__init__(signal.Signals(signum).name)
        self.signum, self.saved = int(signum), saved


class SignalStop:
    """Context manager: SIGINT and SIGTERM stop a run with a checkpoint instead of killing it.

    Before the training loop runs (loading, caching) a signal raises `Interrupted` at once: nothing is lost.
    Once `progress` has seen a "train" event, the first signal only cancels `token`: the loop stops at its next
    step boundary and saves a checkpoint there, so no signal lands inside an optimizer step or a checkpoint
    write (resume is exact). A second signal raises `Interrupted` at once, or, inside a block the token
    shields (an optimizer step), when that block ends: the state left is a step boundary's. `received` is the
    first signal's number (None if none came). The previous handlers are restored on exit; signal handlers can
    only be set in the main thread, so elsewhere this does nothing."""

    def __init__(self, token: CancelToken, signals=(signal.SIGINT, signal.SIGTERM)):
        self.token, self.signals = token, tuple(signals)
        self.received: int | None = None
        self.training = False
        self._previous: dict = {}

    def __enter__(self) -> "SignalStop":
        if threading.current_thread() is threading.main_thread():
            self._previous = {signum: signal.signal(signum, self._handle) for signum in self.signals}
        return self

    def __exit__(self, *exc) -> None:
        for signum, previous in self._previous.items():
            signal.signal(signum, previous)
        self._previous = {}

    def progress(self, forward: ProgressFn | None = None) -> ProgressFn:
        """A progress function that notes when training started, then calls `forward`."""
        def update(event: Progress) -> None:
            if event.stage == "train":
                self.training = True
            if forward is not None:
                forward(event)
        return update

    def _handle(self, signum, frame) -> None:
        first = self.received is None
        if first:
            self.received = int(signum)
        if first and self.training:
            log.warning("%s received: stopping after this step with a checkpoint (send it again to stop at once)",
                        signal.Signals(signum).name)
            self.token.cancel()
            return
        if self.token.hold(signum):
            return
        raise Interrupted(signum)
