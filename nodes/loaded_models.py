"""The pack's loaded models beside ComfyUI's: known to its memory manager, on their devices when a node runs
them, one model per loader node of a workflow, and never taken from a training job.

ComfyUI caches a node's output until its inputs change, and newer releases (the "RAM pressure" cache) keep an
earlier output even then: a loader whose widgets changed would hold its old model (a whole transformer) beside
the new one. So each loader node keeps one live model per workflow: loading another frees the previous one's
weights (moved to the meta device, so every object still pointing at them holds no memory), and the loader's
IS_CHANGED makes ComfyUI run it again when a freed model's settings come back, instead of serving the emptied
cached output. A model a running training job uses (any of its tensors) is never freed; the slots hold their
models weakly, so ComfyUI's node cache reset frees the pack's models as it frees its own, and ComfyUI's unload of
a loader's model with nowhere to offload it (the CPU) frees its weights (`comfy_runtime.PatcherMethods.detach`;
IS_CHANGED then loads it again).
"""

from __future__ import annotations

import hashlib
import logging
import threading
import uuid
import weakref

import torch

from qwen_edit_core import jobs, speed
from qwen_edit_core.model.components import Components, TextEncoder
from qwen_edit_core.sample import workers

from . import comfy_runtime

log = logging.getLogger(__name__)


def busy(module) -> str | None:
    """The name of the running training job that trains on (or encodes with) `module`, else None."""
    return next((job.name for job in jobs.REGISTRY.jobs() if job.uses(module)), None)


def owned(module) -> bool:
    """Whether a loader node holds `module` (its IS_CHANGED loads it again once it was freed)."""
    return SLOTS.holds(module)


def modules_of(value) -> list[torch.nn.Module]:
    """The weight-holding modules of a loader's output or a node's model input: a ModelHandle, Components, a
    TextEncoder, a module, or the component loaders' tuples."""
    if hasattr(value, "components"):
        value = value.components
    if isinstance(value, Components):
        return [m for m in (value.transformer, value.vae, value.text_encoder and value.text_encoder.model)
                if m is not None]
    if isinstance(value, TextEncoder):
        return [value.model]
    if isinstance(value, torch.nn.Module):
        return [value]
    if isinstance(value, tuple):
        return [m for item in value for m in modules_of(item)]
    return []


def freed(module: torch.nn.Module) -> bool:
    """Whether a module's weights were freed (`LoaderSlots.loaded` moved them to the meta device)."""
    first = next(module.parameters(), None)
    return first is not None and first.device.type == "meta"


def use(model) -> None:
    """Before a node runs `model`'s components: refuse freed ones with what to do; the weights a Sampling Speed
    fp8 copy parked come back for its input, or are parked again for the copy (never those of a module a
    running job uses); then ComfyUI's memory manager puts them on their devices (it may have offloaded them for
    another model) and counts them as loaded."""
    modules = modules_of(model)
    if any(freed(m) for m in modules):
        raise RuntimeError("this model was unloaded: its loader node has since loaded another model (each loader "
                           "keeps one), or ComfyUI unloaded it (Unload models, Free model and node cache). Queue "
                           "the prompt again (the loader loads it again), or use a second loader node for a "
                           "second model")
    # A Sampling Speed fp8 copy and its input take turns holding the block weights; a module a running job uses
    # is left as it is: parking would empty the block weights the job's lent copy shares (the node's own
    # check_free then refuses it, naming the job), as `comfy_runtime.load_models` leaves it where it is.
    for module in [m for m in modules if not busy(m)]:
        speed.unpark(module)
        speed.repark(module)
    comfy_runtime.load_models(modules, busy, owned)


def workflow_key(prompt, extra_pnginfo) -> str:
    """Which workflow a loader runs in: the frontend's workflow id (sent with every prompt it queues), else the
    prompt's shape (its node ids and classes; a prompt queued through the API). Node ids alone repeat across
    workflows: every shipped workflow's Load Model is node 1."""
    workflow = extra_pnginfo.get("workflow") if isinstance(extra_pnginfo, dict) else None
    workflow_id = workflow.get("id") if isinstance(workflow, dict) else None
    if workflow_id:
        return f"workflow {workflow_id}"
    nodes = prompt if isinstance(prompt, dict) else {}
    shape = sorted((str(node_id), str(node.get("class_type")) if isinstance(node, dict) else "")
                   for node_id, node in nodes.items())
    return "prompt " + hashlib.sha256(repr(shape).encode()).hexdigest()[:16]


def _alive(refs) -> list[torch.nn.Module]:
    return [m for m in (ref() for ref in refs) if m is not None]


class LoaderSlots:
    """One live model per loader node of each workflow (`slot`: node class, node id, `workflow_key`), held weakly:
    when ComfyUI drops the loader's output (its node cache freed, or another prompt ran) and unloads the model,
    its memory goes. `token` is the loader's IS_CHANGED value, by ComfyUI's cache identity (node class, id and
    widget values): stable while the model loaded with those values is live, new once it was freed (ComfyUI then
    runs the loader again rather than serving its emptied cached output)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._tokens: dict[tuple, str] = {}
        self._live: dict[tuple, tuple[tuple, list]] = {}

    @staticmethod
    def _key(widgets: dict) -> tuple:
        return tuple(sorted((name, repr(value)) for name, value in widgets.items()))

    def token(self, node: tuple, widgets: dict) -> str:
        key = self._key(widgets)
        with self._lock:
            emptied = [slot for slot, (held, refs) in self._live.items()
                       if slot[:2] == node and held == key and any(freed(m) for m in _alive(refs))]
            if emptied:  # ComfyUI unloaded the model loaded with these values: a new token loads it again
                self._tokens.pop((node, key), None)
                for slot in emptied:
                    del self._live[slot]
            return self._tokens.setdefault((node, key), uuid.uuid4().hex)

    def holds(self, module: torch.nn.Module) -> bool:
        """Whether any slot holds `module`."""
        with self._lock:
            refs = [ref for _, held in self._live.values() for ref in held]
        return any(m is module for m in _alive(refs))

    def held(self, slot: tuple) -> list[torch.nn.Module]:
        """The modules `slot` holds that are still alive."""
        with self._lock:
            entry = self._live.get(slot)
        return _alive(entry[1]) if entry else []

    def loaded(self, slot: tuple, widgets: dict, modules: list) -> None:
        """`slot` (node class, node id, workflow) now holds `modules`, loaded with `widgets`: free what it held
        before, unless a training job uses it, the new model shares it or another slot holds it."""
        key, node = self._key(widgets), slot[:2]
        with self._lock:
            previous = self._live.get(slot)
            self._live = {s: entry for s, entry in self._live.items() if _alive(entry[1])}
            self._live[slot] = (key, [weakref.ref(m) for m in modules])
            if previous is None:
                return
            keep = {id(m) for entry in self._live.values() for m in _alive(entry[1])}
            old = [m for m in _alive(previous[1]) if id(m) not in keep and not freed(m)]
        kept = [(m, job) for m, job in ((m, busy(m)) for m in old) if job]
        for module, job in kept:
            log.warning("loader %s loaded another model; the previous one stays loaded while training job %r "
                        "trains on it", node[1], job)
        gone = [m for m in old if all(m is not k for k, _ in kept)]
        for module in gone:
            comfy_runtime.forget_models([module])
            workers.close_pool_of(module)  # the parallel workers' copies of it
            module.to("meta")
        if gone and previous[0] != key:
            with self._lock:
                self._tokens.pop((node, previous[0]), None)
            log.info("loader %s: freed the previous model (%d modules) for the new one", node[1], len(gone))


SLOTS = LoaderSlots()


#: what torch's allocators raise when a device is full: CUDA (ROCm, XPU) torch.OutOfMemoryError; the CPU a
#: RuntimeError "DefaultCPUAllocator: can't allocate memory" (older releases: "not enough memory"); MPS "MPS backend
#: out of memory"; Python's own allocations MemoryError
OUT_OF_MEMORY = ("out of memory", "not enough memory", "can't allocate memory")


def out_of_memory(err: BaseException) -> bool:
    """Whether `err` says a device (GPU or CPU) had no room for an allocation."""
    if isinstance(err, (torch.OutOfMemoryError, MemoryError)):
        return True
    return isinstance(err, RuntimeError) and any(words in str(err) for words in OUT_OF_MEMORY)


def refuse_for_jobs(err: BaseException) -> None:
    """A load ran out of memory: while training jobs hold their models, raise JobBusyError naming them (their
    models are never taken for another load) with what to do; else return (the caller re-raises `err`)."""
    running = jobs.REGISTRY.running()
    if not running:
        return
    names = ", ".join(f"{job.name!r} on {job.device}" for job in running)
    raise jobs.JobBusyError(f"not enough memory for this model while training job {names} keeps its model "
                            "loaded (a job's model is never unloaded for another workflow): wait for the job "
                            "(Training Status), stop it (Stop Training), or load this model on another device "
                            f"({type(err).__name__}: {err})") from err


class TracksLoads:
    """Mixin of the loader nodes: ComfyUI calls `load_tracked`, which loads, frees the node's previous model
    and registers the new one with ComfyUI's memory manager. Subclasses define `load(**widgets)`."""

    FUNCTION = "load_tracked"

    @classmethod
    def IS_CHANGED(cls, unique_id=None, prompt=None, extra_pnginfo=None, **widgets):
        return SLOTS.token((cls.__name__, unique_id), widgets)

    def load_tracked(self, unique_id=None, prompt=None, extra_pnginfo=None, **widgets):
        try:
            result = self.load(**widgets)
            modules = modules_of(result[0])
            if unique_id is not None:
                SLOTS.loaded((type(self).__name__, unique_id, workflow_key(prompt, extra_pnginfo)), widgets, modules)
            # ComfyUI's load_models_gpu puts the model on its device, where a running job's model leaves no room
            comfy_runtime.load_models(modules, busy, owned)
        except (RuntimeError, MemoryError) as err:  # torch.OutOfMemoryError is a RuntimeError
            if out_of_memory(err):
                refuse_for_jobs(err)
            raise
        return result


def hidden_id(inputs: dict) -> dict:
    """A loader's INPUT_TYPES with the hidden node id, prompt and workflow (`workflow_key`; not widgets: saved
    workflows are unaffected)."""
    inputs["hidden"] = {"unique_id": "UNIQUE_ID", "prompt": "PROMPT", "extra_pnginfo": "EXTRA_PNGINFO"}
    return inputs
