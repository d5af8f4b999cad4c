"""The pack's loaded models beside ComfyUI's: known to its memory manager, on their devices when a node runs
them, and one model per loader node.

ComfyUI caches a node's output until its inputs change, and newer releases (the "RAM pressure" cache) keep an
earlier output even then: a loader whose widgets changed would hold its old model (a whole transformer) beside
the new one. So each loader node keeps one live model: loading another frees the previous one's weights (moved
to the meta device, so every object still pointing at them holds no memory), and the loader's IS_CHANGED makes
ComfyUI run it again when a freed model's settings come back, instead of serving the emptied cached output.
"""

from __future__ import annotations

import logging
import threading
import uuid

import torch

from qwen_edit_core import jobs
from qwen_edit_core.model.components import Components, TextEncoder

from . import comfy_runtime

log = logging.getLogger(__name__)


def busy(module) -> str | None:
    """The name of the running training job that trains on (or encodes with) `module`, else None."""
    return next((job.name for job in jobs.REGISTRY.jobs() if job.uses(module)), None)


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
    """Before a node runs `model`'s components: refuse freed ones with what to do, then ComfyUI's memory manager
    puts them on their devices (it may have offloaded them for another model) and counts them as loaded."""
    modules = modules_of(model)
    if any(freed(m) for m in modules):
        raise RuntimeError("this model was unloaded: its loader node has since loaded another model (each loader "
                           "keeps one). Queue the prompt again (the loader loads it again), or use a second "
                           "loader node for a second model")
    comfy_runtime.load_models(modules, busy)


class LoaderSlots:
    """One live model per loader node (by node class and id). `token` is the loader's IS_CHANGED value: stable
    while the model loaded with those widget values is live, new once it was freed (ComfyUI then runs the
    loader again rather than serving its emptied cached output)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._tokens: dict[tuple, str] = {}
        self._live: dict[tuple, tuple[tuple, list]] = {}

    @staticmethod
    def _key(widgets: dict) -> tuple:
        return tuple(sorted((name, repr(value)) for name, value in widgets.items()))

    def token(self, node: tuple, widgets: dict) -> str:
        with self._lock:
            return self._tokens.setdefault((node, self._key(widgets)), uuid.uuid4().hex)

    def loaded(self, node: tuple, widgets: dict, modules: list) -> None:
        """`node` now holds `modules`, loaded with `widgets`: free what it held before (unless a training job
        uses it, or the new model shares it)."""
        key = self._key(widgets)
        with self._lock:
            previous = self._live.get(node)
            self._live[node] = (key, list(modules))
            if previous is not None and previous[0] != key:
                self._tokens.pop((node, previous[0]), None)
        if previous is None:
            return
        keep = {id(m) for m in modules}
        old = [m for m in previous[1] if id(m) not in keep and not freed(m)]
        for module in old:
            job = busy(module)
            if job:
                log.warning("loader %s loaded another model; the previous one stays loaded while training job %r "
                            "trains on it", node[1], job)
                continue
            comfy_runtime.forget_models([module])
            module.to("meta")
        if old:
            log.info("loader %s: freed the previous model (%d modules) for the new one", node[1], len(old))


SLOTS = LoaderSlots()


class TracksLoads:
    """Mixin of the loader nodes: ComfyUI calls `load_tracked`, which loads, frees the node's previous model
    and registers the new one with ComfyUI's memory manager. Subclasses define `load(**widgets)`."""

    FUNCTION = "load_tracked"

    @classmethod
    def IS_CHANGED(cls, unique_id=None, **widgets):
        return SLOTS.token((cls.__name__, unique_id), widgets)

    def load_tracked(self, unique_id=None, **widgets):
        result = self.load(**widgets)
        modules = modules_of(result[0])
        if unique_id is not None:
            SLOTS.loaded((type(self).__name__, unique_id), widgets, modules)
        comfy_runtime.load_models(modules, busy)
        return result


def hidden_id(inputs: dict) -> dict:
    """A loader's INPUT_TYPES with the hidden node id (not a widget: saved workflows are unaffected)."""
    inputs["hidden"] = {"unique_id": "UNIQUE_ID"}
    return inputs
