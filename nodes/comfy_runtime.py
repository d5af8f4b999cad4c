"""The one module that touches ComfyUI (comfy.*, folder_paths, server). Imported lazily; outside ComfyUI
(tests, scripts) every function falls back to a plain, documented behaviour."""

from __future__ import annotations

import logging
import os
import weakref
from pathlib import Path

log = logging.getLogger(__name__)

QWEN_EDIT_FOLDER = "qwen_edit"


def in_comfy() -> bool:
    try:
        import folder_paths  # noqa: F401
        return True
    except ImportError:
        return False


def register_folders() -> None:
    """Register `models/qwen_edit` for diffusers-layout model directories (idempotent)."""
    if not in_comfy():
        return
    import folder_paths
    if QWEN_EDIT_FOLDER not in folder_paths.folder_names_and_paths:
        folder_paths.add_model_folder_path(QWEN_EDIT_FOLDER, os.path.join(folder_paths.models_dir, QWEN_EDIT_FOLDER))


def model_dirs() -> list[str]:
    """Diffusers-layout model directories under every registered `qwen_edit` folder."""
    if not in_comfy():
        return []
    import folder_paths
    register_folders()
    found = []
    for root in folder_paths.get_folder_paths(QWEN_EDIT_FOLDER):
        if os.path.isdir(root):
            found += sorted(d for d in os.listdir(root) if os.path.isfile(os.path.join(root, d, "model_index.json")))
    return found


def model_dir_path(name: str) -> Path | None:
    if not in_comfy():
        return None
    import folder_paths
    for root in folder_paths.get_folder_paths(QWEN_EDIT_FOLDER):
        if os.path.isfile(os.path.join(root, name, "model_index.json")):
            return Path(root) / name
    return None


def default_model_root() -> Path:
    """Where the built-in tiny model is built: models/qwen_edit in ComfyUI, else ~/.cache/qwen-edit."""
    if in_comfy():
        import folder_paths
        return Path(folder_paths.models_dir) / QWEN_EDIT_FOLDER
    return Path(os.environ.get("QWEN_EDIT_HOME", Path.home() / ".cache" / "qwen-edit"))


def folder_files(kind: str, suffix: str = "") -> list[str]:
    """Files of a ComfyUI model folder ("diffusion_models", "vae", "loras"...), optionally by suffix."""
    if not in_comfy():
        return []
    import folder_paths
    return [f for f in folder_paths.get_filename_list(kind) if f.endswith(suffix)]


def folder_file_path(kind: str, name: str) -> Path:
    """Full path of a file of a ComfyUI model folder (or `name` itself outside ComfyUI)."""
    if not in_comfy():
        return Path(name)
    import folder_paths
    return Path(folder_paths.get_full_path_or_raise(kind, name))


def comfyui_dir() -> Path | None:
    """The running ComfyUI's installation (the folder holding its `comfy` package, where it keeps its bundled
    tokenizers, comfy/text_encoders/qwen25_tokenizer/); None outside ComfyUI."""
    if not in_comfy():
        return None
    import comfy
    return Path(list(comfy.__path__)[0]).resolve().parent


def loras_dir() -> Path:
    if not in_comfy():
        return Path(os.environ.get("QWEN_EDIT_LORAS", Path.cwd() / "loras"))
    import folder_paths
    return Path(folder_paths.get_folder_paths("loras")[0])


def output_dir() -> Path:
    if not in_comfy():
        return Path(os.environ.get("QWEN_EDIT_OUTPUT", Path.cwd() / "output"))
    import folder_paths
    return Path(folder_paths.get_output_directory())


def input_dir() -> Path:
    if not in_comfy():
        return Path.cwd()
    import folder_paths
    return Path(folder_paths.get_input_directory())


class _NoBar:
    def update_absolute(self, value, total=None, preview=None):
        pass


def progress_bar(total: int, node_id=None):
    """ComfyUI's ProgressBar (it also raises on a user interrupt) or a no-op."""
    if not in_comfy():
        return _NoBar()
    import comfy.utils
    return comfy.utils.ProgressBar(total, node_id=node_id)


def nothing():
    """An output that makes ComfyUI skip the nodes it feeds, silently (`ExecutionBlocker(None)`, e.g. a Preview
    Image with no picture to show yet); None outside ComfyUI."""
    if not in_comfy():
        return None
    from comfy_execution.graph import ExecutionBlocker  # 0.3.64 and current ComfyUI both export it here
    return ExecutionBlocker(None)


def interrupt_requested() -> bool:
    if not in_comfy():
        return False
    import comfy.model_management
    return comfy.model_management.processing_interrupted()


def raise_if_interrupted() -> None:
    if in_comfy():
        import comfy.model_management
        comfy.model_management.throw_exception_if_processing_interrupted()


def free_device_memory(device: str, keep=(), busy=lambda module: None, owned=lambda module: False) -> bool:
    """Ask ComfyUI to unload every model it loaded on `device` (a torch device name; "cuda" is "cuda:0") and
    empty the CUDA cache, before a training job needs the memory: `comfy.model_management.free_memory` with
    more bytes than any device has (what its own `unload_all_models` does for its default device), then
    `soft_empty_cache`. Our modules in `keep` (the job's) stay loaded. Returns whether ComfyUI was asked (not
    outside ComfyUI, not for the CPU)."""
    import torch
    target = torch.device(device)
    if not in_comfy() or target.type == "cpu":
        return False
    if target.index is None:
        target = torch.device(target.type, 0)
    import comfy.model_management
    patchers = [p for p in (managed_patcher(m, busy, owned) for m in keep) if p is not None]
    kept = [comfy.model_management.LoadedModel(p) for p in patchers]
    unloaded = comfy.model_management.free_memory(1e30, target, keep_loaded=kept)
    comfy.model_management.soft_empty_cache()
    log.info("asked ComfyUI to free %s: %d of its models unloaded", target, len(unloaded or ()))
    return True


def prompt_server():
    """The running ComfyUI server (`server.PromptServer.instance`), or None outside one."""
    if not in_comfy():
        return None
    try:
        from server import PromptServer
    except ImportError:
        return None
    return getattr(PromptServer, "instance", None)


def send_event(event: str, data: dict, *, broadcast: bool = False) -> None:
    """A custom websocket event to the ComfyUI frontend: to the client that queued the running prompt, or to
    every connected client with `broadcast` (jobs outlive the prompt that started them); no-op outside."""
    server = prompt_server()
    if server is None:
        return
    try:
        server.send_sync(event, data, None if broadcast else server.client_id)
    except Exception:  # noqa: BLE001 - progress events must never break a run
        log.debug("could not send %s", event, exc_info=True)


def other_prompts_queued() -> bool:
    """True when ComfyUI's queue holds a prompt besides the running one (a waiting node should let it run)."""
    server = prompt_server()
    if server is None:
        return False
    return server.prompt_queue.get_tasks_remaining() > 1


# -- the pack's models in ComfyUI's memory manager --------------------------------------------------------------
# ComfyUI (comfy/model_management.py) keeps `current_loaded_models`, a list of `LoadedModel`s, each holding a weak
# reference to a ModelPatcher; `load_models_gpu([patcher])` puts a model on its device and into that list (after
# `free_memory` made room by offloading others), and `free_memory` offloads listed models when another one needs
# the room (`LoadedModel.model_unload`: `patcher.partially_unload`, else `patcher.detach`). A pack whose models are
# not ModelPatchers registers them with a ModelPatcher subclass whose load and detach move the whole module, as
# nunchaku's and other wrapper packs do. Ours is `_patcher_class()`.

#: the pack's patcher of each of our modules, beside the module rather than on it: a module is pickled whole
#: (the Sampler's `parallel` workers receive the transformer that way) and must carry nothing of ComfyUI's
_PATCHERS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _nbytes(module, device=None) -> int:
    """Bytes of a module's parameters and buffers (those on `device` only, when given)."""
    import torch
    seen = {id(t): t for t in (*module.parameters(), *module.buffers())}
    return sum(t.numel() * t.element_size() for t in seen.values()
               if device is None or t.device == torch.device(device))


class _Anchor:
    """What the patcher's `model` is: a stand-in that refers to our module weakly, so that the patcher keeps
    nothing alive: dropping the module frees it at once, and ComfyUI's finalizer on the anchor then removes the
    entry from its list."""

    def __init__(self, module):
        self.target = weakref.ref(module)  # ComfyUI's ModelPatcher also sets a few plain attributes here

    @property
    def device(self):
        module = self.target()
        first = next(module.parameters(), None) if module is not None else None
        return first.device if first is not None else None

    @device.setter
    def device(self, value):
        pass  # the device is wherever the module's weights are


class PatcherMethods:
    """What the pack's `comfy.model_patcher.ModelPatcher` subclass changes (mixed in before ComfyUI's class by
    `_patcher_class`: ComfyUI is imported only inside ComfyUI). Loading moves the whole module to its device,
    offloading moves it to the CPU; while `busy(module)` names a running training job, ComfyUI cannot offload it
    (detach keeps it); with nowhere to offload it, its weights are freed only while `owned(module)` (a loader
    node holds it, whose IS_CHANGED then loads it again)."""

    def __init__(self, module, load_device, busy, owned):
        import torch
        super().__init__(_Anchor(module), load_device=load_device, offload_device=torch.device("cpu"),
                         size=max(1, _nbytes(module)))
        self.busy, self.owned = busy, owned

    @property
    def module(self):
        return self.model.target()

    def loaded_size(self):
        module = self.module
        return 0 if module is None else _nbytes(module, self.load_device)

    def current_loaded_device(self):
        return self.model.device

    def model_dtype(self):
        import torch
        module = self.module
        first = next((p for p in module.parameters() if p.is_floating_point()), None) if module else None
        return first.dtype if first is not None else torch.float32

    def model_patches_to(self, device):
        pass

    def lowvram_patch_counter(self):
        return 0

    def partially_load(self, device_to, extra_memory=0, force_patch_weights=False):
        module, before = self.module, self.loaded_size()
        # a training job's levers move its weights themselves (offloaded blocks, parked fp8 originals)
        if module is not None and before < _nbytes(module) and not self.busy(module):
            module.to(device_to)
        return self.loaded_size() - before

    def partially_unload(self, device_to, memory_to_free=0, *args, **kwargs):
        return 0  # whole modules only: ComfyUI then calls detach

    def detach(self, unpatch_all=True):
        from qwen_edit_core.sample import workers

        module = self.module
        if module is not None and (unpatch_all or self.offload_device != self.load_device):
            # The Sampler's `parallel` workers hold copies of the module ComfyUI does not see (one per GPU, or a
            # mapping of its shared CPU weights): an unload or offload frees those too, a patcher dropped (its
            # __del__ detaches with unpatch_all False, the model staying) keeps them. The next parallel sample
            # starts them again.
            workers.close_pool_of(module)
        job = self.busy(module) if module is not None else None
        if job:
            log.warning("ComfyUI asked to offload a model that training job %r trains on: it stays", job)
        elif module is not None and self.offload_device != self.load_device:
            module.to(self.offload_device)
            log.info("ComfyUI offloaded %s to %s", type(module).__name__, self.offload_device)
        elif module is not None and unpatch_all and self.owned(module):
            # An unload of a model with nowhere to go (on the CPU: "Unload models", "Free model and node cache")
            # frees its weights: ComfyUI's node cache may hold the loader's output long after (POST /free sets
            # its two flags one after the other, and the prompt worker can wake for the first and reset the node
            # cache only after the next prompt). The loader's IS_CHANGED then makes ComfyUI load it again.
            # (unpatch_all is False when ComfyUI only drops a patcher: its __del__, a clone replacing it.) A module
            # no loader holds (a Sampling Speed copy) stays: nothing would load it again, and ComfyUI would keep
            # serving the emptied copy from its node cache.
            module.to("meta")
            log.info("ComfyUI unloaded %s from %s: its weights are freed, its loader loads it again on the next "
                     "run", type(module).__name__, self.load_device)
        return self.model


def _patcher_class():
    """PatcherMethods over the running ComfyUI's `comfy.model_patcher.ModelPatcher` (made once)."""
    global _patcher_type
    if _patcher_type is None:
        import comfy.model_patcher
        _patcher_type = type("PackModelPatcher", (PatcherMethods, comfy.model_patcher.ModelPatcher),
                             {"__module__": __name__})
    return _patcher_type


_patcher_type = None


def patcher_of(module):
    """The patcher `managed_patcher` made for `module`, or None."""
    return _PATCHERS.get(module) if module is not None else None


def managed_patcher(module, busy, owned):
    """The ComfyUI patcher of one of our modules (made once per module, kept beside it), or None outside
    ComfyUI."""
    if not in_comfy() or module is None:
        return None
    patcher = _PATCHERS.get(module)
    if patcher is None:
        first = next(module.parameters(), None)
        if first is None:
            return None
        patcher = _patcher_class()(module, first.device, busy, owned)
        _PATCHERS[module] = patcher
    return patcher


def load_models(modules, busy, owned) -> list:
    """Make our modules known to ComfyUI's memory manager and put them on their devices (ComfyUI may have
    offloaded them to the CPU for another model): `comfy.model_management.load_models_gpu`, which first frees
    room by offloading ComfyUI's least needed models. A running job's modules are left out: its entry
    (`count_job`) counts them; the entry of a job that is over leaves the list once any of its modules is listed
    again under its own (`drop_finished_jobs`). Returns the patchers (none outside ComfyUI)."""
    patchers = [p for p in (managed_patcher(m, busy, owned) for m in modules if not busy(m)) if p is not None]
    if patchers:
        import comfy.model_management
        drop_finished_jobs([p.module for p in patchers])
        comfy.model_management.load_models_gpu(patchers)
    return patchers


def forget_models(modules) -> None:
    """Take our modules out of ComfyUI's list of loaded models (they are being freed)."""
    if not in_comfy():
        return
    import comfy.model_management
    patchers = {id(p) for p in map(patcher_of, modules) if p is not None}
    loaded = comfy.model_management.current_loaded_models
    loaded[:] = [entry for entry in loaded if id(entry.model) not in patchers]


# -- a running training job in ComfyUI's ledger -----------------------------------------------------------------
# ComfyUI's `free_memory` drops from `current_loaded_models` every entry whose `LoadedModel.model_unload` returns
# True, and `model_unload` returns True once the patcher's `detach` ran, whether or not detach freed anything
# (0.3.64 and current ComfyUI: docs/COMFYUI.md, "Current ComfyUI"). A busy module's patcher that keeps its
# weights would still leave the list, and ComfyUI would stop counting them. So while a job runs, one stand-in
# entry (`count_job`) stands for all it holds on its device, as the job measures it (`device_bytes`: weights,
# optimizer state, offload buffers, a step's activations); its `model_unload` declines (returns False: ComfyUI
# keeps it listed and looks for room elsewhere). The job's modules leave the list while it counts them; when the
# job is over the entry unloads like theirs would (moves the modules to the CPU) and ComfyUI drops it, unless a
# node lists those modules again first (`drop_finished_jobs` then takes the entry out).

#: the stand-in patcher of each running job ComfyUI counts (an entry holds its patcher weakly)
_JOB_PATCHERS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


class _JobAnchor:
    """The stand-in patcher's `model`: the job (its name appears in ComfyUI's log lines through this class's
    name), the modules it trained on (weakly) and its device."""

    def __init__(self, job, modules, device):
        self.job, self.device = job, device
        self.targets = [weakref.ref(m) for m in modules]

    def modules(self) -> list:
        return [m for m in (ref() for ref in self.targets) if m is not None]


class JobPatcherMethods:
    """The stand-in patcher of a running training job (mixed in before ComfyUI's ModelPatcher by
    `_job_classes`): its size is the job's `device_bytes()` while it runs, then its modules' bytes on the device;
    loading does nothing (the job placed its weights), offloading moves the modules to the CPU once the job is
    over and never before."""

    def __init__(self, job, modules, device):
        import torch
        super().__init__(_JobAnchor(job, modules, device), load_device=device, offload_device=torch.device("cpu"),
                         size=1)

    def running(self) -> bool:
        return not self.model.job.finished

    def model_size(self):
        anchor = self.model
        if not anchor.job.finished:
            return max(1, anchor.job.device_bytes())
        return max(1, sum(_nbytes(m, anchor.device) for m in anchor.modules()))

    def loaded_size(self):
        return self.model_size()

    def current_loaded_device(self):
        return self.model.device

    def model_dtype(self):
        import torch
        return torch.float32

    def model_patches_to(self, device):
        pass

    def lowvram_patch_counter(self):
        return 0

    def partially_load(self, device_to, extra_memory=0, force_patch_weights=False):
        return 0

    def partially_unload(self, device_to, memory_to_free=0, *args, **kwargs):
        return 0

    def detach(self, unpatch_all=True):
        if not self.running():
            for module in self.model.modules():
                module.to(self.offload_device)
        return self.model


class JobEntryMethods:
    """The ledger entry of a running job (mixed in before ComfyUI's LoadedModel): listed as loaded from the
    start, it declines every unload while the job runs."""

    def __init__(self, patcher):
        import comfy.model_management
        super().__init__(patcher)
        anchor = patcher.model
        self.real_model = weakref.ref(anchor)
        self.model_finalizer = weakref.finalize(anchor, comfy.model_management.cleanup_models)
        self.declined = 0

    def model_unload(self, memory_to_free=None, unpatch_weights=True):
        patcher = self.model
        if patcher is not None and patcher.running():
            if not self.declined:
                log.warning("ComfyUI asked for the memory of training job %r (%.2f GiB on %s): it keeps it",
                            patcher.model.job.name, patcher.model_size() / 2**30, patcher.load_device)
            self.declined += 1
            return False
        return super().model_unload(memory_to_free, unpatch_weights)


def _job_classes():
    """(patcher class, entry class) over the running ComfyUI's ModelPatcher and LoadedModel (made once)."""
    global _job_types
    if _job_types is None:
        import comfy.model_management
        import comfy.model_patcher
        _job_types = (type("PackJobPatcher", (JobPatcherMethods, comfy.model_patcher.ModelPatcher),
                           {"__module__": __name__}),
                      type("PackJobEntry", (JobEntryMethods, comfy.model_management.LoadedModel),
                           {"__module__": __name__}))
    return _job_types


_job_types = None


def drop_finished_jobs(modules) -> None:
    """Take out of ComfyUI's list the stand-in entries of jobs that are over and trained on any of `modules`,
    which are about to be listed under their own entries: counted twice otherwise, and ComfyUI evicting the
    stand-in later would move them to the CPU under an entry it still counts as loaded. Call from ComfyUI's
    worker thread (the list is ComfyUI's)."""
    import comfy.model_management
    ids = {id(m) for m in modules}
    loaded = comfy.model_management.current_loaded_models
    stale = [entry for entry in loaded if isinstance(entry.model, JobPatcherMethods) and not entry.model.running()
             and any(id(m) in ids for m in entry.model.model.modules())]
    for entry in stale:
        log.info("training job %r is over: its models are counted under their own entries again",
                 entry.model.model.job.name)
        entry.model_finalizer.detach()
        _JOB_PATCHERS.pop(entry.model.model.job, None)
    loaded[:] = [entry for entry in loaded if all(entry is not s for s in stale)]


def count_job(job, modules, device) -> bool:
    """Put a running training job into ComfyUI's list of loaded models as one stand-in entry on `device` (a
    torch device) that reports the job's `device_bytes()` and declines to unload until the job is over; our
    `modules` the job trains on leave the list meanwhile (the entry counts them). Call from ComfyUI's worker
    thread (the list is ComfyUI's). Returns whether an entry was added (not outside ComfyUI, nor twice)."""
    if not in_comfy() or job in _JOB_PATCHERS:
        return False
    import comfy.model_management
    forget_models(modules)
    patcher_type, entry_type = _job_classes()
    patcher = _JOB_PATCHERS[job] = patcher_type(job, modules, device)
    comfy.model_management.current_loaded_models.insert(0, entry_type(patcher))
    log.info("ComfyUI counts training job %r on %s", job.name, device)
    return True
