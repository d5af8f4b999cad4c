"""The pack's models in ComfyUI's memory manager, against a fake `comfy.model_management` that follows ComfyUI's
own (comfy/model_management.py: `LoadedModel`, `current_loaded_models`, `load_models_gpu`, `free_memory`): the
loaders register their components, ComfyUI can offload them (not while a training job uses them), and a loader
node keeps one model: loading another frees the previous one, and IS_CHANGED makes ComfyUI load it again."""

from __future__ import annotations

import sys
import threading
import types
import weakref

import pytest
import torch

import nodes
from nodes import comfy_runtime, loaded_models
from nodes.common import TINY_MODEL
from qwen_edit_core import jobs
from qwen_edit_core.train.loop import TrainResult


class ModelPatcher:
    """What the pack's patcher takes from comfy.model_patcher.ModelPatcher (ComfyUI 0.3.64)."""

    def __init__(self, model, load_device, offload_device, size=0, weight_inplace_update=False):
        self.model, self.load_device, self.offload_device, self.size, self.parent = (
            model, load_device, offload_device, size, None)
        if not hasattr(model, "device") or model.device is None:
            model.device = offload_device

    def model_size(self):
        return self.size

    def is_clone(self, other):
        return hasattr(other, "model") and self.model is other.model

    def model_patches_models(self):
        return []


class LoadedModel:
    """comfy.model_management.LoadedModel (0.3.64, unchanged in current ComfyUI): a weak reference to the patcher;
    load and unload through it. `model_unload` returns True once the patcher's detach ran, whatever detach did."""

    def __init__(self, model):
        self._model = weakref.ref(model)
        self.device = model.load_device
        self.real_model, self.model_finalizer, self.currently_used = None, None, True

    @property
    def model(self):
        return self._model()

    def model_memory(self):
        return self.model.model_size()

    def model_offloaded_memory(self):
        return self.model.model_size() - self.model.loaded_size()

    def model_load(self):
        self.model.model_patches_to(self.device)
        self.model.partially_load(self.device, 1e32)
        self.real_model = weakref.ref(self.model.model)
        self.model_finalizer = weakref.finalize(self.model.model, _cleanup)

    def model_unload(self, memory_to_free=None, unpatch_weights=True):
        if memory_to_free is not None and memory_to_free < self.model.loaded_size():
            if self.model.partially_unload(self.model.offload_device, memory_to_free) >= memory_to_free:
                return False
        self.model.detach(unpatch_weights)
        self.model_finalizer.detach()
        self.model_finalizer = self.real_model = None
        return True

    def is_dead(self):
        return self.real_model is not None and self.real_model() is not None and self.model is None

    def __eq__(self, other):
        return self.model is other.model


def _cleanup():
    """comfy.model_management.cleanup_models: drop the entries whose model is gone."""
    loaded = sys.modules["comfy.model_management"].current_loaded_models
    loaded[:] = [entry for entry in loaded if entry.real_model is None or entry.real_model() is not None]


def _management():
    """comfy.model_management as the pack meets it: `free_memory` unloads the device's entries, most offloaded
    first, until `get_free_memory` (here `free_bytes[device]`, set by a test) exceeds what is asked, and drops
    from the list each entry whose `model_unload` returned True."""
    mm = types.ModuleType("comfy.model_management")
    mm.LoadedModel, mm.current_loaded_models, mm.cleanup_models, mm.free_bytes = LoadedModel, [], _cleanup, {}
    mm.get_free_memory = lambda dev=None, torch_free_too=False: mm.free_bytes.get(str(dev), 0)

    def load_models_gpu(models, memory_required=0):
        for patcher in models:
            entry = LoadedModel(patcher)
            if entry in mm.current_loaded_models:
                entry = mm.current_loaded_models.pop(mm.current_loaded_models.index(entry))
            entry.model_load()
            mm.current_loaded_models.insert(0, entry)

    def free_memory(memory_required, device, keep_loaded=()):
        candidates = sorted((-entry.model_offloaded_memory(), entry.model_memory(), i)
                            for i, entry in enumerate(mm.current_loaded_models)
                            if entry.device == device and entry not in keep_loaded and not entry.is_dead())
        unloaded = []
        for *_, i in candidates:
            free = mm.get_free_memory(device)
            if free > memory_required:
                break
            if mm.current_loaded_models[i].model_unload(memory_required - free):
                unloaded.append(i)
        return [mm.current_loaded_models.pop(i) for i in sorted(unloaded, reverse=True)]

    mm.load_models_gpu, mm.free_memory, mm.soft_empty_cache = load_models_gpu, free_memory, lambda force=False: None
    return mm


@pytest.fixture
def comfy(tmp_path, monkeypatch):
    """A fake ComfyUI (folder_paths, comfy.model_patcher, comfy.model_management), fresh loader slots."""
    for name in ("QWEN_EDIT_HOME", "QWEN_EDIT_LORAS", "QWEN_EDIT_OUTPUT"):
        monkeypatch.setenv(name, str(tmp_path / name.lower()))
    monkeypatch.chdir(tmp_path)
    folder_paths = types.ModuleType("folder_paths")
    folder_paths.models_dir = str(tmp_path / "models")
    folder_paths.folder_names_and_paths = {}
    folder_paths.get_folder_paths = lambda name: []
    comfy_pkg, patcher = types.ModuleType("comfy"), types.ModuleType("comfy.model_patcher")
    patcher.ModelPatcher = ModelPatcher
    comfy_pkg.model_patcher, comfy_pkg.model_management = patcher, _management()
    comfy_pkg.__path__ = [str(tmp_path / "comfy")]
    for name, module in (("folder_paths", folder_paths), ("comfy", comfy_pkg), ("comfy.model_patcher", patcher),
                         ("comfy.model_management", comfy_pkg.model_management)):
        monkeypatch.setitem(sys.modules, name, module)
    monkeypatch.setattr(comfy_runtime, "_patcher_type", None)
    monkeypatch.setattr(comfy_runtime, "_PATCHERS", weakref.WeakKeyDictionary())
    monkeypatch.setattr(comfy_runtime, "_JOB_PATCHERS", weakref.WeakKeyDictionary())
    monkeypatch.setattr(comfy_runtime, "_job_types", None)
    monkeypatch.setattr(loaded_models, "SLOTS", loaded_models.LoaderSlots())
    monkeypatch.setattr(jobs, "REGISTRY", jobs.JobRegistry())
    return comfy_pkg.model_management


def _load(node="4", **widgets):
    widgets = {"model": TINY_MODEL, "transformer_device": "cpu", "vae_device": "cpu", "text_encoder_device": "cpu",
               "dtype": "float32", **widgets}
    token = nodes.QwenEditModelLoader.IS_CHANGED(unique_id=node, **widgets)
    with torch.inference_mode():
        (handle,) = nodes.QwenEditModelLoader().load_tracked(unique_id=node, **widgets)
    return handle, token


def _ours(mm) -> dict:
    return {id(entry.model.module): entry for entry in mm.current_loaded_models}


def test_loaded_components_are_comfyuis_loaded_models_and_it_can_offload_them(comfy, monkeypatch):
    handle, _ = _load()
    modules = loaded_models.modules_of(handle)
    entries = _ours(comfy)
    assert set(entries) == {id(m) for m in modules} and len(modules) == 3  # transformer, VAE, text encoder
    transformer = handle.components.transformer
    sizes = {id(m): sum(t.numel() * t.element_size() for t in {id(t): t for t in (*m.parameters(), *m.buffers())}
                        .values()) for m in modules}
    assert all(entries[key].model.model_size() == sizes[key] for key in sizes)
    assert entries[id(transformer)].model.loaded_size() == sizes[id(transformer)]
    detached = []
    real = comfy_runtime._patcher_class().detach
    monkeypatch.setattr(comfy_runtime._patcher_class(), "detach",
                        lambda self, unpatch_all=True: detached.append(self.module) or real(self, unpatch_all))
    comfy.free_memory(1e30, torch.device("cpu"))  # another model needs the room: ComfyUI unloads ours
    assert comfy.current_loaded_models == [] and {id(m) for m in detached} == set(sizes)
    nodes.QwenEditEncodeImage().encode(handle, torch.rand(1, 64, 64, 3), 64)  # a node using it loads it again
    assert set(_ours(comfy)) == {id(handle.components.vae)}


def test_comfyui_cannot_offload_a_model_a_training_job_uses(comfy, monkeypatch, caplog):
    handle, _ = _load()
    transformer = handle.components.transformer
    entry = _ours(comfy)[id(transformer)]
    entry.model.offload_device = torch.device("meta")  # a visible "offload" on this CPU-only machine
    started, finish = threading.Event(), threading.Event()

    def held(config, *, resume, progress, cancel, lock=None, model=None):
        started.set()
        finish.wait()
        return TrainResult(state="done", step=0, lora_path=None, loss_plot=None)

    monkeypatch.setattr(jobs, "REGISTRY", jobs.JobRegistry(fit=held, preflight=lambda config, resume: None))
    from qwen_edit_core.config import load_config
    job = jobs.REGISTRY.start(load_config(overrides={"train": {"output_dir": "run", "device": "cpu"}}),
                              model=handle.components)
    assert started.wait(60)
    comfy.free_memory(1e30, torch.device("cpu"))
    assert next(transformer.parameters()).device.type == "cpu"  # kept: the job trains on it
    assert "training job 'lora' trains on: it stays" in caplog.text
    finish.set()
    job.wait()
    loaded_models.use(handle)
    comfy.free_memory(1e30, torch.device("cpu"))
    assert next(transformer.parameters()).device.type == "meta"  # the job is over: ComfyUI may offload it


def test_a_loader_frees_its_previous_model_and_loads_it_again_when_its_settings_come_back(comfy):
    first, token_a = _load()
    again, token_a2 = _load()  # the same settings: ComfyUI serves the cached output, same token
    assert token_a2 == token_a
    second, token_b = _load(instance=1)  # a widget changed: a new model, the previous one is freed
    assert token_b != token_a
    old = first.components.transformer
    assert all(p.device.type == "meta" for p in old.parameters())  # no memory held by the cached old output
    assert set(_ours(comfy)) == {id(m) for m in loaded_models.modules_of(second)}
    with pytest.raises(RuntimeError, match="its loader node has since loaded another model"):
        loaded_models.use(first)
    # back to the first settings: IS_CHANGED differs from the cached run's, so ComfyUI runs the loader again
    third, token_a3 = _load()
    assert token_a3 != token_a and loaded_models.freed(second.components.transformer)
    assert not loaded_models.freed(third.components.transformer)
    _, other_node = _load(node="9")  # another loader node keeps its own model
    assert not loaded_models.freed(third.components.transformer)


def test_comfyui_keeps_counting_a_running_job_and_cannot_unload_it(comfy, monkeypatch, caplog):
    """ComfyUI's free_memory drops any entry whose model_unload returns True: the job's stand-in entry declines,
    reports all the job holds on its device (its model's weights plus what it measured), and stays listed while
    the job's own modules leave the list (counted once); once the job is over ComfyUI unloads it like a model."""
    handle, _ = _load()
    modules = loaded_models.modules_of(handle)
    weights = sum(comfy_runtime._nbytes(m) for m in modules)
    started, finish = threading.Event(), threading.Event()

    def held(config, *, resume, progress, cancel, lock=None, model=None):
        started.set()
        finish.wait()
        return TrainResult(state="done", step=0, lora_path=None, loss_plot=None)

    monkeypatch.setattr(jobs, "REGISTRY", jobs.JobRegistry(fit=held, preflight=lambda config, resume: None))
    from qwen_edit_core.config import load_config
    job = jobs.REGISTRY.start(load_config(overrides={"train": {"output_dir": "run", "device": "cpu"}}),
                              model=handle.components)
    assert started.wait(60)
    job.memory.steady, job.memory.working = 1000, 5000  # what a CUDA job measures at a step's end
    cpu = torch.device("cpu")
    assert comfy_runtime.count_job(job, modules, cpu) and not comfy_runtime.count_job(job, modules, cpu)
    (entry,) = comfy.current_loaded_models  # the modules' own entries left: the job's entry counts them
    assert entry.model_memory() == weights + 6000 and entry.model_offloaded_memory() == 0
    comfy.free_bytes[str(cpu)] = 0
    assert comfy.free_memory(1e30, cpu) == []  # ComfyUI needs the room: the job's entry declines
    assert comfy.current_loaded_models == [entry] and entry.model_memory() == weights + 6000
    assert all(not loaded_models.freed(m) and next(m.parameters()).device == cpu for m in modules)
    assert "ComfyUI asked for the memory of training job 'lora'" in caplog.text
    loaded_models.use(handle)  # a node using the job's model does not list its modules again
    assert comfy.current_loaded_models == [entry]
    finish.set()
    job.wait()
    entry.model.offload_device = torch.device("meta")  # a visible "offload" on this CPU-only machine
    assert entry.model_memory() == weights  # over: its modules' bytes, as their own entries would report
    assert comfy.free_memory(1e30, cpu) == [entry] and comfy.current_loaded_models == []
    assert all(p.device.type == "meta" for m in modules for p in m.parameters())


def test_a_job_measures_what_it_holds_beyond_its_weights_at_each_steps_end():
    """steady: allocated now minus at the start; working: the largest step peak above that (CUDA statistics,
    here a stand-in); both stay 0 on a device without them."""
    readings = iter([(100, 100), (400, 900), (450, 700)])
    resets = []
    use = jobs.DeviceUse("cuda", stats=lambda device: next(readings), reset=resets.append)
    use.started()
    use.step_ended()
    assert (use.steady, use.working) == (300, 500)
    use.step_ended()
    assert (use.steady, use.working) == (350, 500) and len(resets) == 3
    cpu = jobs.DeviceUse("cpu")
    cpu.started()
    cpu.step_ended()
    assert (cpu.steady, cpu.working) == (0, 0)
