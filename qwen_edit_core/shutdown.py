"""Running training jobs checkpointed before the process goes away: on SIGINT, SIGTERM and interpreter exit
every running job of a `jobs.JobRegistry` is stopped with a checkpoint, waiting a bounded time; a second signal
quits at once (the first one puts the previous handlers back)."""

from __future__ import annotations

import atexit
import logging
import os
import signal
import threading

from qwen_edit_core.jobs import REGISTRY, JobRegistry

log = logging.getLogger(__name__)

#: How long a shutdown (signal or interpreter exit) waits for running jobs to save their checkpoints: the
#: current step, its validation (if due) and the checkpoint write; a second signal ends the wait at once.
SHUTDOWN_WAIT_S = 300.0

_installed: set[int] = set()


def install_shutdown_checkpoints(registry: JobRegistry = REGISTRY, signals=(signal.SIGINT, signal.SIGTERM),
                                 wait: float = SHUTDOWN_WAIT_S) -> None:
    """Checkpoint every running job of `registry` before the process goes away: on interpreter exit
    (atexit) and on `signals`, waiting at most `wait` seconds; then the previous handlers run (a default one
    is re-raised). The first signal puts the previous handlers back, so a second signal (a second Ctrl-C)
    does at once what it did before the pack loaded. Signal handlers can only be set from the main thread;
    elsewhere only the exit hook is installed."""
    if id(registry) in _installed:
        return
    _installed.add(id(registry))
    atexit.register(_at_exit, registry, wait)
    try:
        previous = {signum: signal.getsignal(signum) for signum in signals}
        for signum in signals:
            signal.signal(signum, _chained(registry, signum, previous[signum], wait=wait, restore=previous))
    except ValueError:
        log.warning("not in the main thread: %s will not checkpoint running training jobs", signals)


#: set by the first shutdown signal: the exit that follows does not wait for the jobs a second time
_signalled = threading.Event()


def _at_exit(registry: JobRegistry, wait: float) -> None:
    """Interpreter exit: checkpoint running jobs, unless a shutdown signal already did (or the user sent a
    second one to quit now)."""
    if not _signalled.is_set():
        registry.checkpoint_all(wait)


def _chained(registry: JobRegistry, signum: int, previous, *, wait: float = SHUTDOWN_WAIT_S,
             restore: dict | None = None):
    """The handler for `signum`: put the `restore` handlers back (a second signal falls through to them, even
    while this one waits), checkpoint running jobs for at most `wait` seconds, then run `previous`."""
    def handler(sig, frame):
        _signalled.set()
        for number, old in (restore or {}).items():
            signal.signal(number, old)
        if registry.running():
            log.warning("%s: waiting up to %.0f s for running training jobs to save a checkpoint; send it again "
                        "(Ctrl-C) to quit now", signal.Signals(sig).name, wait)
            registry.checkpoint_all(wait)
        if callable(previous):
            previous(sig, frame)
        elif previous == signal.SIG_DFL:
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
    return handler
