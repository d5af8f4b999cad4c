"""The Train node at real size: it trains on the transformer the graph already loaded (no second copy), with
checkpointing, bf16 autocast and the free-memory planner by default; the sampler refuses that transformer while
the job runs; ComfyUI is asked to unload its own models from the training device first."""

from __future__ import annotations

import sys
import threading
import types

import pytest
import torch

import nodes
from nodes import comfy_runtime, train_nodes
from nodes.common import TINY_MODEL
from qwen_edit_core import jobs, speed
from qwen_edit_core.model import components as comp
from qwen_edit_core.train.loop import TrainResult


def _base_pointers(transformer) -> set[int]:
    return {p.data_ptr() for p in transformer.parameters() if not p.requires_grad}


def test_the_job_trains_the_graphs_transformer_without_a_second_copy(env, monkeypatch):
    with torch.inference_mode():
        (model,) = nodes.QwenEditModelLoader().load(TINY_MODEL, "cpu", "cpu", "cpu", "float32")
        (data, _) = nodes.QwenEditSyntheticDataset().make("pairs", 2, 0)
    transformer = model.components.transformer
    before = _base_pointers(transformer)
    loads, freed, seen = [], [], {}
    real_load = comp.load_components

    def load_components(*args, which=("transformer", "vae", "text_encoder"), **kwargs):
        loads.append(tuple(which))
        return real_load(*args, which=which, **kwargs)

    def spy_fit(config, *, resume, progress, cancel, lock=None, model=None):
        def spying(event):
            if event.stage == "train" and "pointers" not in seen:  # inside training, in the job's thread
                seen["same_object"] = model.transformer is transformer
                (copy,) = lent  # the run trains on a copy of the module tree over the graph's weights
                seen["pointers"] = _base_pointers(copy)
                seen["trainable"] = sum(p.numel() for p in copy.parameters() if p.requires_grad)
                seen["checkpointing"] = copy.is_gradient_checkpointing and not transformer.is_gradient_checkpointing
                with pytest.raises(jobs.JobBusyError, match="'shared_lora' trains on this model"):
                    nodes.QwenEditSampleConditioning().sample(handle, types.SimpleNamespace(uncond=None), 2, 1.0,
                                                              0, "dynamic", "same")
                seen["refused"] = True
            progress(event)
        return jobs.fit_with_trainer(config, resume=resume, progress=spying, cancel=cancel, lock=lock, model=model)

    handle, lent, real_lend = model, [], speed.lend
    monkeypatch.setattr(speed, "lend", lambda module: lent.append(real_lend(module)) or lent[-1])
    monkeypatch.setattr(comp, "load_components", load_components)
    monkeypatch.setattr(comfy_runtime, "free_device_memory", lambda device, **kept: freed.append(device))
    monkeypatch.setattr(jobs, "REGISTRY", jobs.JobRegistry(fit=spy_fit))
    with torch.inference_mode():
        (job,) = nodes.QwenEditTrain().start(model, data, "shared_lora", 2, 1e-3, 4, 4.0, "attn", 1, 64, 0, False,
                                             0, False)
    status = job.wait()
    assert status.state == "done", status.error
    train = job.config.train
    # mixed_precision "auto": bf16 on a GPU, the model's dtype on this CPU
    assert (train.gradient_checkpointing, train.mixed_precision, train.memory_budget_auto) == (True, "no", True)
    assert freed == ["cpu"]  # ComfyUI asked to free the training device before the job started
    # realtime training: the graph's transformer, text encoder and VAE serve it; nothing is loaded again
    assert seen["same_object"] and seen["pointers"] == before and seen["trainable"] > 0 and seen["refused"]
    assert seen["checkpointing"]
    assert all("transformer" not in which for which in loads), loads
    # afterwards the graph's transformer is as lent: same weights, no trained adapter, levers off, frozen
    assert _base_pointers(transformer) == before
    assert "default" not in (getattr(transformer, "peft_config", None) or {})
    assert not transformer.is_gradient_checkpointing and not transformer.training
    assert not any(p.requires_grad for p in transformer.parameters())
    jobs.REGISTRY.check_free(transformer)  # the sampler may use it again
    assert job.model is None  # the finished job keeps no reference to the graph's model


def test_free_device_memory_asks_comfyui_to_unload_its_models(monkeypatch):
    calls = []
    management = types.ModuleType("comfy.model_management")
    management.free_memory = lambda memory_required, device, keep_loaded=(): calls.append(
        ("free_memory", memory_required, device)) or ["a model"]
    management.soft_empty_cache = lambda force=False: calls.append(("soft_empty_cache",))
    comfy = types.ModuleType("comfy")
    comfy.model_management = management
    monkeypatch.setitem(sys.modules, "folder_paths", types.ModuleType("folder_paths"))
    monkeypatch.setitem(sys.modules, "comfy", comfy)
    monkeypatch.setitem(sys.modules, "comfy.model_management", management)
    assert comfy_runtime.free_device_memory("cuda")
    assert calls == [("free_memory", 1e30, torch.device("cuda", 0)), ("soft_empty_cache",)]
    calls.clear()
    assert not comfy_runtime.free_device_memory("cpu") and calls == []
    monkeypatch.delitem(sys.modules, "folder_paths")
    assert not comfy_runtime.free_device_memory("cuda:1") and calls == []  # outside ComfyUI: nothing to ask


def test_the_train_node_defaults_are_the_safe_ones():
    optional = nodes.QwenEditTrain.INPUT_TYPES()["optional"]
    assert optional["gradient_checkpointing"][1]["default"] is True
    assert optional["mixed_precision"][0][0] == "auto"  # a combo's default is its first choice
    on_gpu = types.SimpleNamespace(components=types.SimpleNamespace(transformer=torch.nn.Linear(1, 1, device="meta")))
    on_cpu = types.SimpleNamespace(components=types.SimpleNamespace(transformer=torch.nn.Linear(1, 1)))
    assert train_nodes._precision("auto", on_gpu) == "bf16" and train_nodes._precision("auto", on_cpu) == "no"
    assert train_nodes._precision("bf16", on_cpu) == "bf16"
    names = list(optional)  # new inputs go last: these two, then only the inputs added after them
    assert names[names.index("gradient_checkpointing"):] == ["gradient_checkpointing", "mixed_precision",
                                                             "validation_pairs", "overwrite", "cpu_threads"]


def _sampled(model) -> torch.Tensor:
    image = torch.rand(1, 64, 64, 3, generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        (_, latent, _) = nodes.QwenEditSampler().sample(model, image, "invert the colors", " ", 2, 3.0, 1, 64, 64,
                                                     "dynamic", "same", 64)
    return latent["samples"]


def _tree(transformer) -> tuple:
    """What a job could leave behind on the graph's transformer: its modules (objects and types), attention
    processors, compiled calls, modes and trainable flags."""
    return ({name: (id(m), type(m).__name__, m.training, getattr(m, "_compiled_call_impl", None))
             for name, m in transformer.named_modules()},
            {name: id(p) for name, p in transformer.attn_processors.items()},
            [(p.data_ptr(), p.requires_grad) for p in transformer.parameters()])


@pytest.mark.parametrize("ending", ["done", "cancelled", "failed"])
def test_after_a_job_the_graphs_model_samples_bit_identically(env, monkeypatch, ending):
    """The Train node trains on the graph's transformer; whether the job finishes, is stopped or fails, the
    graph's model afterwards is the same module tree and samples exactly the same numbers as before."""
    with torch.inference_mode():
        (model, ) = nodes.QwenEditModelLoader().load(TINY_MODEL, "cpu", "cpu", "cpu", "float32")
        (data, _) = nodes.QwenEditSyntheticDataset().make("pairs", 2, 0)
    transformer = model.components.transformer
    before, tree = _sampled(model), _tree(transformer)

    def ending_fit(config, *, resume, progress, cancel, lock=None, model=None):
        def ends(event):
            progress(event)
            if event.stage == "train" and event.step == 2:
                if ending == "cancelled":
                    cancel.cancel()
                elif ending == "failed":
                    raise RuntimeError("a failure inside training")
        return jobs.fit_with_trainer(config, resume=resume, progress=ends, cancel=cancel, lock=lock, model=model)

    monkeypatch.setattr(comfy_runtime, "free_device_memory", lambda device, **kept: False)
    monkeypatch.setattr(jobs, "REGISTRY", jobs.JobRegistry(fit=ending_fit))
    with torch.inference_mode():
        (job,) = nodes.QwenEditTrain().start(model, data, f"ends_{ending}", 4, 1e-2, 4, 4.0, "all", 2, 64, 0, False,
                                             0, False)
    status = job.wait()
    assert status.state == ending and status.step >= 2, status
    assert _tree(transformer) == tree
    assert torch.equal(_sampled(model), before)


def test_a_second_loader_instance_is_a_separate_model_the_sampler_may_use_while_a_job_trains(env, monkeypatch):
    """ComfyUI gives loaders with equal inputs one cached model; the refusal's advice (another `instance`) makes
    the second loader's inputs differ, and its model is a separate copy that samples while the job trains."""
    for loader in (nodes.QwenEditModelLoader, nodes.QwenEditTransformerLoader):
        names = list(loader.INPUT_TYPES()["optional"])  # added last, followed only by later inputs
        assert names[names.index("instance"):] == ["instance", "transformer_fp8"]
    with torch.inference_mode():
        (first,) = nodes.QwenEditModelLoader().load(TINY_MODEL, "cpu", "cpu", "cpu", "float32")
        (second,) = nodes.QwenEditModelLoader().load(TINY_MODEL, "cpu", "cpu", "cpu", "float32", instance=1)
        (data, _) = nodes.QwenEditSyntheticDataset().make("pairs", 2, 0)
    assert second.components.transformer is not first.components.transformer
    started, finish = threading.Event(), threading.Event()

    def held_fit(config, *, resume, progress, cancel, lock=None, model=None):
        started.set()
        finish.wait()
        return TrainResult(state="done", step=0, lora_path=None, loss_plot=None)

    monkeypatch.setattr(comfy_runtime, "free_device_memory", lambda device, **kept: False)
    monkeypatch.setattr(jobs, "REGISTRY", jobs.JobRegistry(fit=held_fit))
    with torch.inference_mode():
        (job,) = nodes.QwenEditTrain().start(first, data, "held", 2, 1e-3, 4, 4.0, "attn", 1, 64, 0, False, 0, False)
    try:
        assert started.wait(60)
        with pytest.raises(jobs.JobBusyError, match="another `instance` number"):
            _sampled(first)
        assert _sampled(second).isfinite().all()  # the second copy is free
    finally:
        finish.set()
        job.wait()
