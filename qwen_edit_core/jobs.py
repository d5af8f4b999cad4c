"""Background training jobs that live beside the caller (ComfyUI's single worker thread) and outlive it.

A `TrainingJob` runs `QwenImageEditTrainer.fit` in a daemon thread and exposes its name, state, step, loss
history, latest validation image and last checkpoint; `stop()` makes the run save a checkpoint and exit
cleanly. A finished job hands its LoRA to the registry's delivery function (ComfyUI: copy into
`models/loras`) whether or not anybody waits for it.

`JobRegistry` keeps every job of the process by name (default: the LoRA name). Starting a job whose name
already runs with the same config returns the running job (attach); with another config, or on a device that
runs another job, it refuses with a message saying what to do. Listeners get an event on every step and on
state changes (the ComfyUI nodes turn them into websocket messages). `shutdown.install_shutdown_checkpoints`
makes SIGINT, SIGTERM and interpreter exit stop every running job with a checkpoint first.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

from qwen_edit_core.config import Config
from qwen_edit_core.common.names import check_file_name
from qwen_edit_core.common.progress import CancelToken, Progress
from qwen_edit_core.job_hooks import TRAINER_PREFLIGHT, Preflight, fit_with_trainer, resumed_checkpoint

log = logging.getLogger(__name__)

STATES = ("starting", "caching", "training", "done", "cancelled", "failed")
FINISHED = ("done", "cancelled", "failed")


class JobBusyError(RuntimeError):
    """A device already runs a training job, or a job of that name runs with other settings."""


class JobNotFoundError(LookupError):
    """No job of that name in this process."""


@dataclass(frozen=True)
class JobStatus:
    """A snapshot of one job (what the status node, the job list and the live view show)."""

    name: str
    state: str
    step: int
    total: int
    loss: float | None
    lora_path: Path | None
    loss_plot: Path | None
    validation_images: tuple[Path, ...]
    last_checkpoint: Path | None
    error: str | None
    output_dir: Path | None = None
    delivered: Path | None = None
    latest_validation: Path | None = None
    device: str = ""
    #: the held-out pairs' errors per validation step (validation/metrics.csv rows as dicts)
    validation_metrics: tuple = ()

    @property
    def finished(self) -> bool:
        return self.state in FINISHED

    def to_dict(self) -> dict:
        """JSON-ready (paths as strings, a non-finite loss as None)."""
        data = {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(self).items()}
        data["validation_images"] = [str(p) for p in self.validation_images]
        loss = self.loss
        data["loss"] = loss if loss is not None and loss == loss and abs(loss) != float("inf") else None
        data["finished"] = self.finished
        return data


#: listener(job, event): event is "progress" (a step or stage change) or "finished".
Listener = Callable[["TrainingJob", str], None]


def storages_of(value, device: str) -> dict[int, int]:
    """{storage data pointer: bytes} of the weights `value` holds (a module, or what `weight_keys` follows) that
    live on `device`, each storage once."""
    import torch
    from qwen_edit_core.speed.device_use import storages_on
    target = torch.device(device_key(device))
    return storages_on((t for module in _modules(value) for t in (*module.parameters(), *module.buffers())), target)


def _modules(value):
    """The torch modules `value` is or holds under its `WEIGHT_HOLDERS` attributes."""
    import torch
    if isinstance(value, torch.nn.Module):
        yield value
    elif value is not None:
        for name in WEIGHT_HOLDERS:
            yield from _modules(getattr(value, name, None))


JOIN_SLICE = 0.1  #: seconds of one join slice in `TrainingJob.wait`: how late a waiting main thread's handler runs


class TrainingJob:
    """One training run in a background thread."""

    def __init__(self, config: Config, *, name: str | None = None, resume=None,
                 deliver: Callable[[Path], Path] | None = None, listeners: tuple[Listener, ...] = (),
                 on_finish: Callable[["TrainingJob"], None] | None = None, fit=fit_with_trainer,
                 preflight=TRAINER_PREFLIGHT, model=None, overwrite: bool = False):
        """`preflight`: a job_hooks.Preflight (a plain callable: its check alone); `model`: loaded components
        (model.components.Components) the job trains on instead of loading its own; while it runs, `uses` names
        their modules (the ComfyUI sampler refuses to run on them); `overwrite`: another run's files in the
        output folder are moved aside instead of refusing the job (train.run_folder; job_hooks says how the
        hooks are told)."""
        self.config = config
        # only a job asked to overwrite passes the keyword, so hooks that never overwrite keep their signature
        self._overwrite = {"overwrite": True} if overwrite else {}
        self.model = model
        self.name = name or config.train.lora_name
        self.device = config.train.device
        self.output_dir = Path(config.train.output_dir)
        self._resume, self._deliver, self._listeners = resume, deliver, listeners
        self._lender: tuple[int | None, dict[int, int]] = (None, {})  # `_lender_storages`' last walk
        self._cancel = CancelToken()
        self._lock = threading.Lock()
        self._state, self._step, self._loss, self._error = "starting", 0, None, None
        self._history: list[tuple[int, float]] = []
        # The files this run wrote, as it reports them (the folder may hold an earlier run's of the same name).
        self._checkpoint: Path | None = None
        self._validations: list[Path] = []
        self._metrics: tuple[tuple, tuple] = ((), ())  # (metrics.csv's mtime and size, its rows): read once per write
        self._result, self._delivered = None, None
        self._on_finish, self._fit, self._preflight = on_finish, fit, Preflight.of(preflight)
        self._thread = threading.Thread(target=self._run, name=f"qwen-edit-train-{self.name}", daemon=True)
        from qwen_edit_core.speed.device_use import DeviceUse
        self.memory = DeviceUse(device_key(self.device))

    def start(self) -> "TrainingJob":
        """Run the preflight's checks (they write nothing), then take the output directory's lock (it creates
        the folder) and run the preflight's probe, so a bad setting or a busy directory is refused at once,
        before any weight loads and, but for the probe's, before any file is written; then train in the
        background thread."""
        from qwen_edit_core.common.files import OutputLock
        self._preflight.check(self.config, self._resume, **self._overwrite)
        self._output_lock = OutputLock(self.config.train.output_dir, purpose="background training").acquire()
        try:
            if self._preflight.probe is not None:
                self._preflight.probe(self.config, self._resume)
            self._checkpoint = resumed_checkpoint(self.output_dir, self._resume)
            self._thread.start()
        except BaseException:
            self._output_lock.release()
            raise
        return self

    def _notify(self, event: str) -> None:
        for listener in self._listeners:
            try:
                listener(self, event)
            except Exception:  # noqa: BLE001 - a broken listener must never break a run
                log.exception("job listener %r failed on %s", listener, event)

    def _progress(self, event: Progress) -> None:
        if event.stage == "device":  # not news for the listeners
            self.memory.release()
            return
        with self._lock:
            if event.stage == "train":
                # in the job's thread, at the end of its step: its own bytes, and the next step's held back
                run = event.device_storages() if event.device_storages is not None else None
                self.memory.step_ended(self._lender_storages(), run)
                self._state, self._step = "training", event.step
                if event.loss is not None:  # the loss is read every `logging.every` steps
                    self._loss = event.loss
                    self._history.append((event.step, event.loss))
            elif event.stage == "cache":
                self._state = "caching"
            elif event.stage == "checkpoint":
                self._checkpoint = event.path
            elif event.stage == "validation":
                self._validations.append(event.path)
        self._notify("progress")

    def _lender_storages(self) -> dict[int, int]:
        """The lender's weights on the device (`storages_of`), walked again only at the run's first step (its
        setup parked or offloaded what its levers replace) and when a loan moved lent tensors since
        (speed.lending.moves): between those its storages stay as they were, so a step does not walk them."""
        from qwen_edit_core.speed import lending
        seen = lending.moves()
        if seen != self._lender[0]:
            self._lender = (seen, storages_of(self.model, self.device))
        return self._lender[1]

    def _run(self) -> None:
        from qwen_edit_core.common.threads import torch_threads
        try:
            # pinned in this thread: two threads per operation on a small or busy machine ran each step several
            # times slower (BENCHMARKS.md, "The demo under load"); the caller's own threads keep their count
            self._lender = (None, storages_of(self.model, self.device))  # (lending.moves() when walked, storages)
            self.memory.started(self._lender[1])
            with torch_threads(self.config.train.cpu_threads):
                result = self._fit(self.config, resume=self._resume, progress=self._progress,
                                   cancel=self._cancel, lock=self._output_lock, model=self.model, **self._overwrite)
            delivered = self._deliver(result.lora_path) if self._deliver and result.lora_path else None
            with self._lock:
                self._result, self._delivered = result, delivered
                self._state, self._step = result.state, result.step
        except Exception as err:  # noqa: BLE001 - the job reports any failure through its status
            log.exception("training job %r failed", self.name)
            with self._lock:
                self._state, self._error = "failed", f"{type(err).__name__}: {err}"
        finally:
            self.memory.release()
            self.model = None  # the registry keeps finished jobs: it must not keep the caller's model alive
            self._output_lock.release()
            if self._on_finish is not None:
                self._on_finish(self)
            self._notify("finished")

    def stop(self) -> None:
        """Ask the run to save a checkpoint and stop after the current step."""
        self._cancel.cancel()

    def wait(self, timeout: float | None = None) -> JobStatus:
        """Block until the run (and its LoRA delivery) is over, or `timeout` seconds passed. Joins in slices: a
        Ctrl-C the kernel hands to another thread runs its handler only when the main thread next runs bytecode."""
        end = time.monotonic() + (float("inf") if timeout is None else timeout)
        while self._thread.ident is not None and self._thread.is_alive() and time.monotonic() < end:
            self._thread.join(min(JOIN_SLICE, end - time.monotonic()))
        return self.status()

    @property
    def finished(self) -> bool:
        with self._lock:
            return self._state in FINISHED

    def uses(self, module) -> bool:
        """Whether this job, still running, trains on (or encodes with) any weight of `module` (a module, or a
        wrapper of one such as the text encoder's): compared tensor by tensor, so the module inside a wrapper
        of the job's model, or another module over the same storage, counts as the job's."""
        shared = self.model
        if shared is None or module is None or self.finished:
            return False
        return not weight_keys(module).isdisjoint(weight_keys(shared))

    def device_bytes(self) -> int:
        """Bytes this job holds on its device while it runs, its own only (speed.device_use.DeviceUse): its
        lender's weights still there and the run's tensors (LoRA, optimizer state, fp8 and offload buffers) as of
        its last step, each storage once, plus a step's working bytes; 0 once it finished."""
        shared = self.model
        if shared is None or self.finished:
            return 0
        return self.memory.held()

    @property
    def history(self) -> list[tuple[int, float]]:
        with self._lock:
            return list(self._history)

    def _heldout_metrics(self) -> tuple:
        """The rows of validation/metrics.csv, read again only when the file changed (status runs every step)."""
        from qwen_edit_core.train.heldout import read_metrics
        path = self.output_dir / "validation" / "metrics.csv"
        stat = path.stat() if path.is_file() else None
        seen = (stat.st_mtime_ns, stat.st_size) if stat else ()
        if seen != self._metrics[0]:
            self._metrics = (seen, tuple(read_metrics(path)))
        return self._metrics[1]

    def status(self) -> JobStatus:
        """A snapshot; cheap enough for every step's event (no folder is listed, no checkpoint read): the last
        checkpoint and validation image are the ones this run reported writing (a resumed run starts from the
        checkpoint it resumed), never an earlier run's files in the same folder."""
        with self._lock:
            result, checkpoint, latents = self._result, self._checkpoint, list(self._validations)
        pngs = list(result.validation_images) if result else []
        latest = pngs[-1] if pngs else next((p.with_suffix(".png") for p in reversed(latents)
                                             if p.with_suffix(".png").is_file()), None)
        metrics = self._heldout_metrics()
        with self._lock:
            return JobStatus(name=self.name, state=self._state, step=self._step,
                             total=self.config.train.max_steps, loss=self._loss,
                             lora_path=result.lora_path if result else None,
                             loss_plot=result.loss_plot if result else None,
                             validation_images=tuple(result.validation_images) if result else (),
                             last_checkpoint=checkpoint, error=self._error,
                             output_dir=self.output_dir, delivered=self._delivered,
                             latest_validation=latest, device=self.device, validation_metrics=metrics)


#: the attributes `weight_keys` follows from an object that is not a module: Components' parts, TextEncoder.model
WEIGHT_HOLDERS = ("transformer", "vae", "text_encoder", "model")


def weight_keys(value) -> set:
    """The identities of the weights `value` holds (a torch module; else the modules under its `WEIGHT_HOLDERS`
    attributes, e.g. Components or a TextEncoder): each tensor object, and each non-empty storage on a real
    device (two tensor objects may view one storage). Compare sets taken at the same time: ids are reused once
    an object is gone."""
    import torch
    if value is None:
        return set()
    if not isinstance(value, torch.nn.Module):
        return set().union(*(weight_keys(getattr(value, name, None)) for name in WEIGHT_HOLDERS))
    keys = set()
    for tensor in (*value.parameters(), *value.buffers()):
        keys.add(("tensor", id(tensor)))
        if tensor.device.type != "meta" and tensor.numel():
            keys.add(("storage", str(tensor.device), tensor.untyped_storage().data_ptr()))
    return keys


def device_key(name: str) -> str:
    """The registry's name for a device: "cuda" is "cuda:0" (as everywhere in the core), so "cuda" and
    "cuda:0" are one device; other names as torch spells them ("cpu", "cuda:1", "mps")."""
    import torch
    device = torch.device(name)
    if device.type != "cpu" and device.index is None:
        device = torch.device(device.type, 0)
    return str(device)


class JobRegistry:
    """Every job of the process by name; one running job per transformer device ("cuda" and "cuda:0" are the
    same device)."""

    def __init__(self, fit=fit_with_trainer, preflight=TRAINER_PREFLIGHT) -> None:
        """`fit(config, resume=, progress=, cancel=, lock=)` runs one job (default: the trainer); `preflight`
        checks it before the job starts (a job_hooks.Preflight, or a plain callable `(config, resume)` that
        writes nothing; default: the trainer's `check_fit`, split where it starts writing)."""
        self._fit, self._preflight = fit, preflight
        self._lock = threading.Lock()
        self._jobs: dict[str, TrainingJob] = {}
        self._listeners: list[Listener] = []
        self._deliver: Callable[[Path], Path] | None = None

    def set_delivery(self, deliver: Callable[[Path], Path] | None) -> None:
        """`deliver(lora_path) -> delivered_path`, called in the job's thread when a run leaves a LoRA."""
        self._deliver = deliver

    def subscribe(self, listener: Listener) -> None:
        """Call `listener(job, event)` for every job started from now on (idempotent per listener)."""
        with self._lock:
            if listener not in self._listeners:
                self._listeners.append(listener)

    def start(self, config: Config, *, name: str | None = None, resume=None, model=None,
              overwrite: bool = False) -> TrainingJob:
        """Start a job named `name` (default: the LoRA name), or return the job of that name when it runs,
        or finished training, with this very config (re-queuing the graph that started it attaches). `model`:
        loaded components the job trains on; `overwrite`: another run's files in the output folder are moved
        aside first (TrainingJob), and only a running job of that name is attached to."""
        name = check_file_name(name or config.train.lora_name, "job name")  # it is part of the job's URL
        with self._lock:
            same = self._jobs.get(name)
            attach = same is not None and not (overwrite and same.finished)  # overwrite: a finished run is redone
            if attach and same.config == config and same.status().state not in ("cancelled", "failed"):
                log.info("attaching to training job %r (%s)", name, same.status().state)
                return same
            if same is not None and not same.finished:
                raise JobBusyError(f"training job {name!r} already runs with other settings (output "
                                   f"{same.output_dir}); stop it (Stop Training node) or give this run "
                                   "another lora_name")
            device = device_key(config.train.device)
            busy = next((j for j in self._jobs.values() if device_key(j.device) == device and not j.finished),
                        None)
            if busy is not None:
                status = busy.status()
                raise JobBusyError(f"a training job already runs on {busy.device} ({busy.name!r}, step "
                                   f"{status.step}/{status.total}, output {busy.output_dir}); stop it or wait "
                                   "for it, or train on another device")
            job = TrainingJob(config, name=name, resume=resume, deliver=self._deliver,
                              listeners=tuple(self._listeners), fit=self._fit, preflight=self._preflight,
                              model=model, overwrite=overwrite)
            self._jobs[name] = job
        try:
            return job.start()
        except BaseException:
            with self._lock:
                if self._jobs.get(name) is job:
                    del self._jobs[name]
            raise

    def get(self, name: str) -> TrainingJob:
        """The job called `name` (running or finished in this process)."""
        with self._lock:
            job = self._jobs.get(name.strip().removesuffix(".safetensors"))
            known = sorted(self._jobs)
        if job is None:
            raise JobNotFoundError(f"no training job named {name!r} in this server; known jobs: "
                                   f"{known or 'none'} (a job's name is its lora_name unless set)")
        return job

    def jobs(self) -> list[TrainingJob]:
        with self._lock:
            return list(self._jobs.values())

    def check_free(self, module, use: str = "sample") -> None:
        """Raise JobBusyError naming the job when a running job trains on `module` (one copy of the weights:
        `use` must wait until the job is done)."""
        job = next((j for j in self.jobs() if j.uses(module)), None)
        if job is not None:
            status = job.status()
            raise JobBusyError(f"training job {job.name!r} trains on this model (step {status.step}/{status.total}, "
                               f"output {job.output_dir}); cannot {use} with it until the job is done: wait for "
                               "it (Training Status) or stop it (Stop Training), or load a second copy for this "
                               "(a second Load Model node with another `instance` number: a loader with the same "
                               "settings gives back the same model; the copy takes the model's memory again)")

    def running(self) -> list[TrainingJob]:
        return [job for job in self.jobs() if not job.finished]

    def statuses(self) -> list[JobStatus]:
        return [job.status() for job in self.jobs()]

    def stop(self, name: str, *, wait: bool = True) -> JobStatus:
        """Stop the job called `name` with a checkpoint (waits for it unless `wait` is False)."""
        job = self.get(name)
        job.stop()
        return job.wait() if wait else job.status()

    def checkpoint_all(self, timeout: float | None = None) -> list[JobStatus]:
        """Stop every running job and wait until each has saved its checkpoint (server shutdown), for at most
        `timeout` seconds in all (None: no limit); a job still running then is named in the log."""
        running = self.running()
        for job in running:
            log.warning("stopping training job %r with a checkpoint (shutdown)", job.name)
            job.stop()
        deadline = None if timeout is None else time.monotonic() + timeout
        statuses = [job.wait(None if deadline is None else max(0.0, deadline - time.monotonic()))
                    for job in running]
        for status in statuses:
            if not status.finished:
                log.error("training job %r did not finish its checkpoint within %.0f s; its last checkpoint is "
                          "%s (resume from it)", status.name, timeout, status.last_checkpoint or "none")
        return statuses


#: The process-wide registry the ComfyUI nodes use.
REGISTRY = JobRegistry()

def wait_for(job: TrainingJob, *, poll: float = 0.2, on_tick=None, until=None) -> JobStatus:
    """Block until `job` finishes, calling `on_tick(status)` every `poll` seconds (it may raise to stop
    waiting, e.g. on a ComfyUI interrupt, after calling job.stop()). `until()` returning True ends the wait
    early (the job carries on); the status then is the running job's."""
    while True:
        status = job.status()
        if on_tick is not None:
            on_tick(status)
        if status.finished:
            return job.wait()
        if until is not None and until():
            return status
        time.sleep(poll)
