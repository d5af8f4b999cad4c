"""Background training jobs: train without blocking the caller (ComfyUI's single worker thread).

A `TrainingJob` runs `QwenImageEditTrainer.fit` in a daemon thread and exposes its state, step, loss
history, last checkpoint and a stop event; `stop()` makes the run save a checkpoint and exit cleanly.
`JobRegistry` allows one running job per transformer device and refuses a second with a clear message.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from qwen_edit_core.config import Config
from qwen_edit_core.common.progress import CancelToken, Progress

log = logging.getLogger(__name__)

STATES = ("starting", "caching", "training", "done", "cancelled", "failed")


class JobBusyError(RuntimeError):
    """A device already runs a training job."""


@dataclass(frozen=True)
class JobStatus:
    state: str
    step: int
    total: int
    loss: float | None
    lora_path: Path | None
    loss_plot: Path | None
    validation_images: tuple[Path, ...]
    last_checkpoint: Path | None
    error: str | None

    @property
    def finished(self) -> bool:
        return self.state in ("done", "cancelled", "failed")


class TrainingJob:
    """One training run in a background thread."""

    def __init__(self, config: Config, *, resume=None, on_finish=None):
        self.config = config
        self.device = config.train.device
        self._resume = resume
        self._cancel = CancelToken()
        self._lock = threading.Lock()
        self._state, self._step, self._loss, self._error = "starting", 0, None, None
        self._history: list[tuple[int, float]] = []
        self._result = None
        self._on_finish = on_finish
        self._thread = threading.Thread(target=self._run, name=f"qwen-edit-train-{self.device}", daemon=True)

    def start(self) -> "TrainingJob":
        """Take the output directory's lock and run the preflight here, so a busy directory or a bad setting
        is refused at once (before any weight loads), then train in the background thread."""
        from qwen_edit_core.api import QwenImageEditTrainer
        from qwen_edit_core.common.files import OutputLock
        self._output_lock = OutputLock(self.config.train.output_dir, purpose="background training").acquire()
        try:
            QwenImageEditTrainer(self.config).check_fit(resume=self._resume)
            self._thread.start()
        except BaseException:
            self._output_lock.release()
            raise
        return self

    def _progress(self, event: Progress) -> None:
        with self._lock:
            if event.stage == "train":
                self._state, self._step = "training", event.step
                if event.loss is not None:  # the loss is read every `logging.every` steps
                    self._loss = event.loss
                    self._history.append((event.step, event.loss))
            elif event.stage == "cache":
                self._state = "caching"

    def _run(self) -> None:
        import torch

        from qwen_edit_core.api import QwenImageEditTrainer
        try:
            # A new thread starts outside inference mode; say so anyway, training needs autograd.
            with torch.inference_mode(False):
                result = QwenImageEditTrainer(self.config).fit(resume=self._resume, progress=self._progress,
                                                               cancel=self._cancel, lock=self._output_lock)
            with self._lock:
                self._result, self._state, self._step = result, result.state, result.step
        except Exception as err:  # noqa: BLE001 - the job reports any failure through its status
            log.exception("training job failed")
            with self._lock:
                self._state, self._error = "failed", f"{type(err).__name__}: {err}"
        finally:
            self._output_lock.release()
            if self._on_finish is not None:
                self._on_finish(self)

    def stop(self) -> None:
        """Ask the run to save a checkpoint and stop after the current step."""
        self._cancel.cancel()

    def wait(self, timeout: float | None = None) -> JobStatus:
        self._thread.join(timeout)
        return self.status()

    @property
    def history(self) -> list[tuple[int, float]]:
        with self._lock:
            return list(self._history)

    def status(self) -> JobStatus:
        from qwen_edit_core.train.checkpoint import latest_checkpoint
        with self._lock:
            result = self._result
            found = latest_checkpoint(Path(self.config.train.output_dir) / "checkpoints")
            return JobStatus(state=self._state, step=self._step, total=self.config.train.max_steps, loss=self._loss,
                             lora_path=result.lora_path if result else None,
                             loss_plot=result.loss_plot if result else None,
                             validation_images=tuple(result.validation_images) if result else (),
                             last_checkpoint=found.path if found else None, error=self._error)


def device_key(name: str) -> str:
    """The registry's name for a device: "cuda" is "cuda:0" (as everywhere in the core), so "cuda" and
    "cuda:0" are one device; other names as torch spells them ("cpu", "cuda:1", "mps")."""
    import torch
    device = torch.device(name)
    if device.type != "cpu" and device.index is None:
        device = torch.device(device.type, 0)
    return str(device)


class JobRegistry:
    """One running job per transformer device ("cuda" and "cuda:0" are the same device)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._running: dict[str, TrainingJob] = {}

    def start(self, config: Config, *, resume=None) -> TrainingJob:
        device = device_key(config.train.device)
        with self._lock:
            busy = self._running.get(device)
            if busy is not None:
                status = busy.status()
                raise JobBusyError(f"a training job already runs on {device} (step {status.step}/{status.total}, "
                                   f"output {busy.config.train.output_dir}); stop it or wait for it, or train "
                                   "on another device")
            job = TrainingJob(config, resume=resume, on_finish=self._finished)
            self._running[device] = job
        try:
            return job.start()
        except BaseException:
            self._finished(job)
            raise

    def _finished(self, job: TrainingJob) -> None:
        with self._lock:
            key = device_key(job.device)
            if self._running.get(key) is job:
                del self._running[key]

    def running(self) -> list[TrainingJob]:
        with self._lock:
            return list(self._running.values())


#: The process-wide registry the ComfyUI nodes use.
REGISTRY = JobRegistry()


def wait_for(job: TrainingJob, *, poll: float = 0.2, on_tick=None) -> JobStatus:
    """Block until `job` finishes, calling `on_tick(status)` every `poll` seconds (it may raise to stop
    waiting, e.g. on a ComfyUI interrupt, after calling job.stop())."""
    while True:
        status = job.status()
        if on_tick is not None:
            on_tick(status)
        if status.finished:
            return job.wait()
        time.sleep(poll)
