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

from conftest import held_training_job

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
    mm.allocator = None  # a test's `Allocator` stands for torch's on its device

    def get_free_memory(dev=None, torch_free_too=False):
        if mm.allocator is not None and str(dev) == str(mm.allocator.device):
            return mm.allocator.free()
        return mm.free_bytes.get(str(dev), 0)

    mm.get_free_memory = get_free_memory

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
    assert all(loaded_models.freed(m) for m in modules)  # on the CPU, with nowhere to offload to, freed
    again, _ = _load()  # its IS_CHANGED changed: ComfyUI runs the loader again
    comfy.current_loaded_models.clear()
    nodes.QwenEditEncodeImage().encode(again, torch.rand(1, 64, 64, 3), 64)  # a node using it loads it
    assert set(_ours(comfy)) == {id(again.components.vae)}


def test_an_unload_on_the_cpu_frees_only_what_a_loader_node_loads_again(comfy, monkeypatch):
    """A Sampling Speed copy is no loader's output: nothing would load it again once emptied (ComfyUI serves its
    cached output), so an unload leaves it on the CPU; the loader's model is freed (its IS_CHANGED changes)."""
    import dataclasses

    from qwen_edit_core import speed
    handle, token = _load()
    fast = speed.inference_copy(handle.components.transformer, torch.device("cpu"), fp8=False, compile=False)
    copy = dataclasses.replace(handle, components=dataclasses.replace(handle.components, transformer=fast))
    loaded_models.use(copy)  # the copy gets its own entry in ComfyUI's list
    comfy_runtime.patcher_of(fast).detach()  # ComfyUI unloads only the copy
    assert not loaded_models.freed(fast)
    loaded_models.use(copy)  # it still runs
    comfy_runtime.patcher_of(handle.components.vae).detach()
    assert loaded_models.freed(handle.components.vae)
    assert _load()[1] != token  # ComfyUI runs the loader again


def test_comfyui_cannot_offload_a_model_a_training_job_uses(comfy, monkeypatch, caplog):
    handle, _ = _load()
    transformer = handle.components.transformer
    entry = _ours(comfy)[id(transformer)]
    entry.model.offload_device = torch.device("meta")  # a visible "offload" on this CPU-only machine
    with held_training_job(monkeypatch, handle.components):
        comfy.free_memory(1e30, torch.device("cpu"))
        assert next(transformer.parameters()).device.type == "cpu"  # kept: the job trains on it
        assert "training job 'lora' trains on: it stays" in caplog.text
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
    with held_training_job(monkeypatch, handle.components) as job:
        job.memory.working = 6000  # what a CUDA job measures at a step's end
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
    entry.model.offload_device = torch.device("meta")  # a visible "offload" on this CPU-only machine
    assert entry.model_memory() == weights  # over: its modules' bytes, as their own entries would report
    assert comfy.free_memory(1e30, cpu) == [entry] and comfy.current_loaded_models == []
    assert all(p.device.type == "meta" for m in modules for p in m.parameters())


class _Block:
    """One allocation of the stand-in allocator (freed when dropped)."""

    def __init__(self, nbytes):
        self.nbytes = nbytes


class Allocator:
    """torch's caching allocator on one device as ComfyUI's `get_free_memory` reads it (the driver's free bytes
    plus reserved minus active) and `speed.device_use.Allocator` drives it: `alloc` serves a request from a cached
    inactive block of its exact size, else reserves new memory; freeing caches the block (reserved, inactive)."""

    def __init__(self, device, total):
        self.device, self.total = torch.device(device), total
        self.reserved = self.active = self.peak = 0
        self.cached: list[int] = []

    def free(self) -> int:
        return self.total - self.reserved + (self.reserved - self.active)

    def alloc(self, n):
        if n in self.cached:
            self.cached.remove(n)
        else:
            self.reserved += n
        self.active += n
        self.peak = max(self.peak, self.active)
        block = _Block(n)
        weakref.finalize(block, self._free, n)
        return block

    def _free(self, n):
        self.active -= n
        self.cached.append(n)

    def stats(self, device):
        return self.active, self.peak

    def reset(self, device):
        self.peak = self.active

    def hold(self, device, nbytes):
        from qwen_edit_core.speed.device_use import pick_blocks
        return [self.alloc(n) for n in pick_blocks(self.cached, nbytes)]


def test_comfyuis_free_memory_leaves_out_what_a_running_jobs_next_step_needs(comfy, monkeypatch):
    """Between two steps the job's activations are reserved but inactive, which ComfyUI's `get_free_memory` counts
    as free: the job holds them until its next step starts. Its ledger entry reports its own bytes (its model's
    weights, the run's storages, a step's working bytes), not the process's: a model another prompt loaded meanwhile
    is not the job's."""
    from qwen_edit_core.common.progress import Progress
    from qwen_edit_core.speed import device_use
    handle, _ = _load()
    modules = loaded_models.modules_of(handle)
    weights = sum(comfy_runtime._nbytes(m) for m in modules)
    cpu, total = torch.device("cpu"), 100_000
    comfy.allocator = allocator = Allocator(cpu, total)
    real = device_use.DeviceUse
    monkeypatch.setattr(device_use, "DeviceUse", lambda device: real(device, allocator=allocator))
    between, go_on, stop = threading.Event(), threading.Event(), threading.Event()
    other = []

    def two_steps(config, *, resume, progress, cancel, lock=None, model=None):
        for step in (1, 2):
            progress(Progress("device", step, 2))
            other.append(allocator.alloc(7000))  # another prompt loads a model while the job trains
            activations = [allocator.alloc(3000), allocator.alloc(2000)]
            del activations  # the step is over: reserved, inactive
            progress(Progress("train", step, 2, device_storages=lambda: {1: 400}))  # the run's LoRA and optimizer state
            between.set()
            go_on.wait()
            go_on.clear()
            if stop.is_set():
                break
        return TrainResult(state="done", step=2, lora_path=None, loss_plot=None)

    monkeypatch.setattr(jobs, "REGISTRY", jobs.JobRegistry(fit=two_steps, preflight=lambda config, resume: None))
    from qwen_edit_core.config import load_config
    job = jobs.REGISTRY.start(load_config(overrides={"train": {"output_dir": "run", "device": "cpu"}}),
                              model=handle.components)
    try:
        assert between.wait(60)
        assert comfy_runtime.count_job(job, modules, cpu)
        (entry,) = comfy.current_loaded_models
        working = 5000
        assert entry.model_memory() == weights + 400 + working  # the other prompt's 7000 bytes are not the job's
        assert comfy.get_free_memory(cpu) == allocator.total - 7000 - working  # the next step's bytes are held
        assert comfy.free_memory(working, cpu) == [] and comfy.current_loaded_models == [entry]  # it declines
        between.clear()
        go_on.set()  # the second step starts: what was held back is its own
        assert between.wait(60)
        assert comfy.get_free_memory(cpu) == allocator.total - 2 * 7000 - working
        go_on.set()
    finally:
        stop.set()
        go_on.set()
        job.wait()
    assert allocator.active == 2 * 7000  # the job let go of everything it held


def test_memory_another_prompt_frees_during_a_step_is_not_the_steps():
    """A step's working bytes are its peak above what was allocated at its start (or at its end, when more):
    another prompt freeing its model during the step does not raise what the job holds for the rest of its run."""
    from qwen_edit_core.speed.device_use import DeviceUse
    allocator = Allocator("cpu", 100_000)
    other = allocator.alloc(30_000)  # another prompt's model
    use = DeviceUse(torch.device("cpu"), allocator=allocator)
    use.started({})
    use.release()  # the step starts
    activations = [allocator.alloc(3000), allocator.alloc(2000)]
    del other  # the other prompt lets go of its model during the step
    del activations
    use.step_ended({}, None)
    assert use.working == 5000 and use.held() == 5000
    assert sum(t.nbytes for t in use.held_back) == 5000


def test_a_hold_takes_only_cached_blocks_that_fit_largest_first():
    from qwen_edit_core.speed.device_use import pick_blocks
    assert pick_blocks([4, 16, 8, 2], 13) == [8, 4]
    assert pick_blocks([4, 16, 8, 2], 100) == [16, 8, 4, 2] and pick_blocks([4], 3) == []


def test_the_loaders_fp8_choice_streams_the_block_linears_into_fp8_without_loading_the_whole_model(
        comfy, monkeypatch):
    """Load Model and Load Transformer with `transformer_fp8`: the planned loader puts each block linear on the
    device in e4m3 as it is read (its device bytes: tests/model/test_planned_load.py); the whole-model loader,
    which would place every weight in the model's dtype first, is never called."""
    from qwen_edit_core import speed
    from qwen_edit_core.model import components as comp
    whole = comp.load_transformer
    monkeypatch.setattr(comp, "load_transformer", lambda *a, **k: pytest.fail("loaded whole before fp8"))
    handle, _ = _load(transformer_fp8=True, dtype="bfloat16")
    transformer = handle.components.transformer
    assert speed.has_fp8(transformer) and speed.loaded_plan(transformer) is None  # a sampling-style plan
    assert all(type(m) is not torch.nn.Linear for m in transformer.transformer_blocks.modules())
    with torch.inference_mode():
        ((_, alone, _),) = nodes.QwenEditTransformerLoader().load_tracked(
            unique_id="7", model=TINY_MODEL, device="cpu", dtype="bfloat16", quantize="none", transformer_fp8=True)
    assert speed.has_fp8(alone)
    monkeypatch.setattr(comp, "load_transformer", whole)
    with pytest.raises(ValueError, match="transformer_fp8 and quantize 'int8'"):
        nodes.QwenEditTransformerLoader().load(TINY_MODEL, "cpu", "bfloat16", "int8", transformer_fp8=True)


def test_load_transformer_with_fp8_places_about_half_the_bf16_model_on_the_device(comfy, monkeypatch):
    """Load Transformer with `transformer_fp8`, "meta" standing in for the GPU (every byte placed there counted,
    tests/model/test_planned_load.py): the peak stays within the loaded model's own bytes plus one layer in
    flight (read in the file's dtype and converted: at most 3x the largest block linear's bf16 bytes), below the
    whole bf16 transformer, which loading first and converting afterwards would place there (the tiny model's
    embedders and output projection, which stay bf16, weigh more beside its blocks than the real model's)."""
    from tests.model.test_planned_load import DeviceBytes
    from qwen_edit_core.model import components as comp
    from nodes import model_nodes
    from nodes.common import resolve_model
    monkeypatch.setattr(model_nodes, "_resolve", lambda name, component: torch.device("meta"))
    directory = comp.resolve_model_dir(resolve_model(TINY_MODEL, ""))
    whole = comp.load_transformer(directory, device=torch.device("cpu"), dtype=torch.bfloat16)
    bf16 = sum(t.nbytes for t in whole.state_dict().values())
    largest = max(m.weight.nbytes for m in whole.transformer_blocks.modules() if type(m) is torch.nn.Linear)
    from qwen_edit_core.model import planned_load
    from qwen_edit_core.model.weight_source import weight_source
    skeleton = planned_load.build_skeleton(weight_source(directory, None, "auto"), fp8=True)
    # built outside the count: a skeleton's meta tensors are shapes, which hold nothing on a real device
    monkeypatch.setattr(planned_load, "build_skeleton", lambda source, fp8: skeleton)
    with DeviceBytes("meta") as placed:
        ((_, module, _),) = nodes.QwenEditTransformerLoader().load(TINY_MODEL, "meta", "bfloat16", "none",
                                                                   transformer_fp8=True)
    resident = sum(t.untyped_storage().nbytes() for t in {id(t): t for t in (*module.parameters(),
                                                                             *module.buffers())}.values())
    assert 0 < placed.peak <= resident + 3 * largest, (placed.peak, resident, largest)
    assert placed.peak < 0.85 * bf16, (placed.peak, bf16)


def test_sampling_an_fp8_copy_whose_input_a_job_trains_on_is_refused_and_leaves_the_jobs_weights(
        comfy, monkeypatch):
    """The copy parks its input's block weights when a node uses it; while a job trains on the input (its lent
    copy shares those tensors) the node is refused before anything is parked."""
    import dataclasses

    from qwen_edit_core import speed
    from qwen_edit_core.speed import lending
    monkeypatch.setattr(lending, "on_host", lambda tensor: False)  # the CPU stands for the device
    handle, _ = _load()
    transformer = handle.components.transformer
    fast = speed.inference_copy(transformer, torch.device("cpu"), fp8=True, compile=False)
    copy = dataclasses.replace(handle, components=dataclasses.replace(handle.components, transformer=fast))
    loaded_models.use(handle)  # the training node uses the input: its weights come back
    before = {name: t.clone() for name, t in transformer.state_dict().items()}
    with held_training_job(monkeypatch, handle.components):
        with pytest.raises(jobs.JobBusyError, match="training job 'lora' trains on this model"):
            nodes.QwenEditSampleConditioning().sample(copy, types.SimpleNamespace(uncond=None), 1, 1.0, 0,
                                                       "diffusers", "same")
        assert all(torch.equal(t, before[k]) for k, t in transformer.state_dict().items())


def test_a_jobs_entry_leaves_comfyuis_list_when_a_node_uses_its_model_after_the_job(comfy, monkeypatch):
    """Once the job is over, a node using its model lists the modules under their own entries again: the job's
    stand-in entry leaves the list then (each byte counted once, and no later eviction of the stand-in moves
    modules that ComfyUI counts under their own entries)."""
    handle, _ = _load()
    modules = loaded_models.modules_of(handle)
    weights = sum(comfy_runtime._nbytes(m) for m in modules)
    monkeypatch.setattr(jobs, "REGISTRY", jobs.JobRegistry(
        fit=lambda config, **kwargs: TrainResult(state="done", step=0, lora_path=None, loss_plot=None),
        preflight=lambda config, resume: None))
    from qwen_edit_core.config import load_config
    job = jobs.REGISTRY.start(load_config(overrides={"train": {"output_dir": "run", "device": "cpu"}}),
                              model=handle.components)
    assert comfy_runtime.count_job(job, modules, torch.device("cpu"))
    job.wait()
    loaded_models.use(handle)
    assert sum(entry.model_memory() for entry in comfy.current_loaded_models) == weights
    assert set(_ours(comfy)) == {id(m) for m in modules} and len(comfy.current_loaded_models) == len(modules)


def test_a_job_that_parks_its_lenders_weights_reports_its_fp8_and_lora_bytes(monkeypatch, tmp_path):
    """fp8 parks the lender's bf16 linears and adds its own fp8 copies and the LoRA: the job reports the lender's
    weights still on the device (none) plus the run's storages, whatever else the process allocated (a stand-in
    allocator; the CPU tensors stand for the device's)."""
    from qwen_edit_core.speed import device_use
    monkeypatch.chdir(tmp_path)
    model = torch.nn.Linear(16, 16, bias=False)  # 1024 bytes
    allocator = Allocator("cpu", 10_000)
    real = device_use.DeviceUse
    monkeypatch.setattr(device_use, "DeviceUse", lambda device: real(device, allocator=allocator))
    stepped, finish = threading.Event(), threading.Event()
    fp8_copy = torch.zeros(300, dtype=torch.uint8)  # the fp8 copy and the LoRA

    def fp8(config, *, resume, progress, cancel, lock=None, model=None):
        model.weight.data = torch.empty(0)  # parked
        other = allocator.alloc(200)  # another model, loaded beside the job  # noqa: F841
        progress(jobs.Progress(stage="train", step=1, total=1,
                               device_storages=lambda: device_use.storages_on([fp8_copy], torch.device("cpu"))))
        stepped.set()
        finish.wait()
        return TrainResult(state="done", step=1, lora_path=None, loss_plot=None)

    monkeypatch.setattr(jobs, "REGISTRY", jobs.JobRegistry(fit=fp8, preflight=lambda config, resume: None))
    from qwen_edit_core.config import load_config
    job = jobs.REGISTRY.start(load_config(overrides={"train": {"output_dir": "run", "device": "cpu"}}), model=model)
    assert stepped.wait(60)
    try:
        assert job.memory.storages and job.device_bytes() == 300
    finally:
        finish.set()
        job.wait()


def test_a_job_walks_its_lenders_weights_only_after_its_setup_and_when_a_loan_moves_them(monkeypatch, tmp_path):
    """A step's ledger entry does not walk the lender's parameters again: they change only when the run's setup
    parks or offloads them (before its first step) or a loan parks or restores them later (speed.lending.moves)."""
    from qwen_edit_core.speed import lending
    monkeypatch.chdir(tmp_path)
    model = torch.nn.Linear(16, 16, bias=False)  # 1024 bytes
    walks, seen = [], []
    real = jobs.storages_of
    monkeypatch.setattr(jobs, "storages_of", lambda *a: walks.append(sum(real(*a).values())) or real(*a))

    def five_steps(config, *, resume, progress, cancel, lock=None, model=None):
        copy = lending.lend(model)
        for step in range(1, 6):
            if step == 4:  # a host copy made elsewhere (the block offloader's) lets the loan park a CPU tensor
                lending.loan_of(copy).park(model.weight, model.weight.detach().clone())
            progress(jobs.Progress("train", step, 5, device_storages=lambda: {}))
            seen.append(list(walks))
        lending.give_back(copy)
        return TrainResult(state="done", step=5, lora_path=None, loss_plot=None)

    monkeypatch.setattr(jobs, "REGISTRY", jobs.JobRegistry(fit=five_steps, preflight=lambda config, resume: None))
    from qwen_edit_core.config import load_config
    jobs.REGISTRY.start(load_config(overrides={"train": {"output_dir": "run", "device": "cpu"}}), model=model).wait()
    assert seen == [[1024, 1024]] * 3 + [[1024, 1024, 0]] * 2  # the start, the first step, the parked weight
