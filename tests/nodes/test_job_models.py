"""A training job owns what it trains on, inside a fake ComfyUI (test_comfy_memory's): every shipped workflow's
Load Model is node 1, so another workflow's loader of the same node id, with any settings or `instance`, and
ComfyUI's memory manager never free, move or replace a running job's model (checked on its tensors: the text
encoder's slot holds the model inside its wrapper); a load that cannot fit beside it is refused naming the job;
ComfyUI's unload frees the pack's models and closes their parallel worker pools; a transformer ComfyUI knows
pickles for the parallel workers."""

from __future__ import annotations

import gc
import pickle
import sys
import threading
import types
import weakref
from multiprocessing.reduction import ForkingPickler
from pathlib import Path

import pytest
import torch

import nodes
from nodes import comfy_runtime, job_service, loaded_models
from nodes.common import TINY_MODEL
from qwen_edit_core import jobs
from qwen_edit_core.config import load_config
from qwen_edit_core.train.loop import TrainResult
from tests.nodes.test_comfy_memory import _ours, comfy  # noqa: F401 - the fake ComfyUI fixture

#: two workflows as the frontend queues them: both start with Load Model as node 1
TRAINING = {"1": {"class_type": "QwenEditModelLoader"}, "2": {"class_type": "QwenEditSyntheticDataset"},
            "3": {"class_type": "QwenEditTrainLoRA"}, "4": {"class_type": "QwenEditTrainStatus"}}
SAMPLING = {"1": {"class_type": "QwenEditModelLoader"}, "2": {"class_type": "LoadImage"},
            "3": {"class_type": "QwenEditSampler"}, "4": {"class_type": "PreviewImage"}}


def _widgets(**widgets) -> dict:
    return {"model": TINY_MODEL, "transformer_device": "cpu", "vae_device": "cpu", "text_encoder_device": "cpu",
            "dtype": "float32", **widgets}


def _load(prompt, node="1", workflow=None, **widgets):
    """Load Model as ComfyUI runs it in `prompt` (IS_CHANGED first, with no prompt: ComfyUI gives it none)."""
    widgets = _widgets(**widgets)
    extra = {"workflow": {"id": workflow}} if workflow else None
    token = nodes.QwenEditModelLoader.IS_CHANGED(unique_id=node, **widgets)
    with torch.inference_mode():
        (handle,) = nodes.QwenEditModelLoader().load_tracked(unique_id=node, prompt=prompt, extra_pnginfo=extra,
                                                             **widgets)
    return handle, token


class HeldRun:
    """A training run that holds its model until released, then reads every weight (as a training step does:
    a weight moved to `meta` fails it) and leaves a LoRA."""

    def __init__(self):
        self.started, self.release = threading.Event(), threading.Event()

    def __call__(self, config, *, resume, progress, cancel, lock=None, model=None):
        self.started.set()
        assert self.release.wait(60)
        for module in loaded_models.modules_of(model):
            for weight in module.parameters():
                weight.detach().cpu()  # NotImplementedError: Cannot copy out of meta tensor
        out = Path(config.train.output_dir)
        out.mkdir(parents=True, exist_ok=True)
        lora = out / f"{config.train.lora_name}.safetensors"
        lora.write_text("trained")
        return TrainResult(state="done", step=1, lora_path=lora, loss_plot=None)


class Blocker:
    """comfy_execution.graph.ExecutionBlocker: the nodes fed by it are skipped (`message` None: silently)."""

    def __init__(self, message):
        self.message = message


@pytest.fixture
def training(comfy, tmp_path, monkeypatch):  # noqa: F811 - pytest's fixture by name
    """A registry whose jobs run HeldRun and deliver into the fake loras folder; (run, start(handle))."""
    loras = str(tmp_path / "loras")
    monkeypatch.setattr(sys.modules["folder_paths"], "get_folder_paths", lambda name: [loras] if name == "loras" else [])
    utils, graph = types.ModuleType("comfy.utils"), types.ModuleType("comfy_execution.graph")
    utils.ProgressBar = lambda total, node_id=None: types.SimpleNamespace(update_absolute=lambda *args: None)
    graph.ExecutionBlocker = Blocker
    monkeypatch.setitem(sys.modules, "comfy.utils", utils)
    monkeypatch.setattr(sys.modules["comfy"], "utils", utils, raising=False)
    monkeypatch.setitem(sys.modules, "comfy_execution", types.ModuleType("comfy_execution"))
    monkeypatch.setitem(sys.modules, "comfy_execution.graph", graph)
    monkeypatch.setattr(comfy, "processing_interrupted", lambda: False, raising=False)
    run = HeldRun()
    registry = jobs.JobRegistry(fit=run, preflight=lambda config, resume: None)
    registry.set_delivery(job_service.deliver)
    monkeypatch.setattr(jobs, "REGISTRY", registry)

    def start(handle, name="job_a"):
        config = load_config(overrides={"train": {"output_dir": str(tmp_path / "runs" / name), "device": "cpu",
                                                  "lora_name": name}})
        job = registry.start(config, model=handle.components)
        assert run.started.wait(60)
        return job

    yield run, start
    run.release.set()
    for job in registry.running():
        job.wait()


def _intact(handle) -> bool:
    return not any(loaded_models.freed(m) for m in loaded_models.modules_of(handle))


def test_a_job_uses_the_model_inside_its_text_encoders_wrapper_and_any_module_on_its_storage(training):
    run, start = training
    handle, _ = _load(TRAINING)
    job = start(handle)
    comps = handle.components
    assert all(job.uses(m) for m in (comps.transformer, comps.vae, comps.text_encoder, comps.text_encoder.model))
    view = torch.nn.Linear(1, 1)
    view.weight = torch.nn.Parameter(next(comps.vae.parameters()).data.view(-1)[:1].view(1, 1))
    assert job.uses(view)  # another module over the job's storage
    assert not job.uses(torch.nn.Linear(1, 1))
    assert loaded_models.busy(comps.text_encoder.model) == "job_a"


def test_another_workflows_loader_of_the_same_node_id_leaves_a_running_jobs_model_alone(training, comfy):  # noqa: F811
    run, start = training
    trained, _ = _load(TRAINING, workflow="train-workflow")
    job = start(trained)
    for patcher in (entry.model for entry in comfy.current_loaded_models):
        patcher.offload_device = torch.device("meta")  # a visible "offload" on this CPU-only machine
    # the sampling workflow with the same settings gets ComfyUI's cached model: sampling on it is refused
    with pytest.raises(jobs.JobBusyError, match="training job 'job_a' trains on this model"):
        jobs.REGISTRY.check_free(trained.components.transformer, "sample")
    # with another `instance` (the advice) its loader, node 1 too, loads a copy, and samples on it
    sampling, _ = _load(SAMPLING, workflow="sample-workflow", instance=1)
    sampled = {id(m) for m in loaded_models.modules_of(sampling)}
    comfy.free_memory(1e30, torch.device("cpu"),  # and ComfyUI makes room for what it runs next
                      keep_loaded=[e for e in comfy.current_loaded_models if id(e.model.module) in sampled])
    encoded = nodes.QwenEditEncodeImage().encode(sampling, torch.rand(1, 64, 64, 3), 64)
    assert encoded is not None and _intact(sampling)
    assert _intact(trained), "another workflow's load took the running job's model"
    run.release.set()
    status = job.wait()
    assert status.state == "done", status.error
    assert status.delivered is not None and status.delivered.read_text() == "trained"


def test_the_same_workflow_loading_another_model_while_its_job_trains_keeps_the_jobs_model(training):
    run, start = training
    trained, _ = _load(TRAINING)
    job = start(trained)
    other, _ = _load(TRAINING, dtype="bfloat16")  # its loader's settings changed and the graph queued again
    assert _intact(trained) and _intact(other)
    run.release.set()
    assert job.wait().state == "done"
    third, _ = _load(TRAINING)  # the job is over: the loader keeps one model again
    assert loaded_models.freed(other.components.transformer) and _intact(third)


def test_a_load_that_does_not_fit_beside_a_running_jobs_model_is_refused_naming_the_job(training, monkeypatch):
    run, start = training
    trained, _ = _load(TRAINING)
    start(trained)

    def out_of_memory(self, **widgets):
        raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 38.00 GiB")

    monkeypatch.setattr(nodes.QwenEditModelLoader, "load", out_of_memory)
    with pytest.raises(jobs.JobBusyError, match="training job 'job_a' on cpu keeps its model loaded"):
        _load(SAMPLING, instance=1)
    assert _intact(trained)


def test_comfyuis_unload_and_cache_free_let_the_packs_model_go_and_the_loader_loads_it_again(comfy):  # noqa: F811
    handle, token = _load(SAMPLING)
    refs = [weakref.ref(m) for m in loaded_models.modules_of(handle)]
    assert len(_ours(comfy)) == 3
    comfy.free_memory(1e30, torch.device("cpu"))  # "Free model and node cache": ComfyUI unloads every model ...
    del handle  # ... and drops its node cache (the loader's output)
    gc.collect()
    assert [ref() for ref in refs] == [None, None, None], "the loader slot still holds the freed model"
    again, token_again = _load(SAMPLING)  # ComfyUI runs the loader again (its cache is empty)
    assert _intact(again) and len(_ours(comfy)) == 3


def test_comfyuis_unload_frees_a_cpu_models_weights_while_its_node_cache_still_holds_the_loaders_output(
        comfy, training):  # noqa: F811
    """POST /free sets ComfyUI's "unload_models" flag, then "free_memory": its prompt worker can wake for the first
    and reset the node cache only after the next prompt, so the loader's output (`handle` here) outlives the
    unload. The unload alone must free the weights of a CPU model (nowhere to offload them), never a running
    job's, and the loader's IS_CHANGED then makes ComfyUI load the model again."""
    trained, _ = _load(TRAINING, workflow="train")
    training[1](trained)
    handle, token = _load(SAMPLING, instance=1)
    weights = [weakref.ref(w) for m in loaded_models.modules_of(handle) for w in (*m.parameters(), *m.buffers())]
    comfy.free_memory(1e30, torch.device("cpu"))  # unload_all_models, on a --cpu server
    gc.collect()
    assert all(ref() is None for ref in weights), "ComfyUI's unload left the pack's weights in memory"
    assert _intact(trained) and not _intact(handle)
    with pytest.raises(RuntimeError, match="ComfyUI unloaded it"):
        loaded_models.use(handle)
    again, token_again = _load(SAMPLING, instance=1)  # IS_CHANGED differs: ComfyUI runs the loader again
    assert token_again != token and _intact(again)
    assert nodes.QwenEditModelLoader.IS_CHANGED(unique_id="1", **_widgets(instance=1)) == token_again  # then cached


def test_a_transformer_comfyui_knows_pickles_as_the_parallel_pool_sends_it(comfy):  # noqa: F811
    from torch.multiprocessing import reductions
    handle, _ = _load(SAMPLING)
    transformer = handle.components.transformer
    assert id(transformer) in _ours(comfy)  # the pack's patcher is made for it
    reductions.init_reductions()  # as sample.workers.TransformerPool does before sending it
    copy = pickle.loads(ForkingPickler.dumps(transformer))
    assert all(torch.equal(a, b) for a, b in zip(transformer.state_dict().values(), copy.state_dict().values()))


def test_training_status_says_why_a_job_failed_and_shows_no_loss_before_its_first_step(training):
    run, start = training
    handle, _ = _load(TRAINING)
    job = start(handle)  # HeldRun holds it before its first step until `run.release`
    running = nodes.QwenEditTrainStatus().status(False, job=job)
    assert not job.finished and "still running" in running["ui"]["text"][0]
    assert "no loss yet" in running["ui"]["text"][0] and "0.0000" not in running["ui"]["text"][0]
    # no loss plot, no validation picture yet: the Preview Images fed by them are skipped, not shown black
    assert [type(running["result"][i]) for i in (2, 3)] == [Blocker, Blocker]
    assert all(running["result"][i].message is None for i in (2, 3))  # silently: no error shown
    loaded_models.modules_of(handle)[0].to("meta")  # the job's model taken away
    run.release.set()
    status = job.wait()
    assert status.state == "failed"
    out = nodes.QwenEditTrainStatus().status(False, job=job)
    assert "failed: NotImplementedError" in out["ui"]["text"][0] and "meta" in out["ui"]["text"][0]
    assert isinstance(out["result"][3], Blocker)  # no validation picture: Preview Image gets nothing, not a black square
    assert job_service.job_entry(job)["outcome"].startswith("failed: NotImplementedError")
    with pytest.raises(RuntimeError, match="failed: NotImplementedError"):
        nodes.QwenEditTrainStatus().status(True, job=job)


def test_a_cpu_or_comfyuis_out_of_memory_is_refused_naming_the_job_and_other_errors_pass(training, comfy,  # noqa: F811
                                                                                        monkeypatch):
    """The load running out of host memory (MemoryError), and ComfyUI's load_models_gpu running out while it puts
    the loaded model on its device (here the CPU allocator's own error, from a real allocation), are refused
    naming the job, as the load's CUDA out-of-memory error is; any other error passes unchanged."""
    run, start = training
    trained, _ = _load(TRAINING)
    start(trained)
    broken = RuntimeError("a patcher failed")

    def host_full(self, **widgets):
        raise MemoryError()

    def device_full(patchers, memory_required=0):
        torch.empty(2**62, dtype=torch.uint8)  # RuntimeError: DefaultCPUAllocator: can't allocate memory

    def failing(patchers, memory_required=0):
        raise broken

    with monkeypatch.context() as patch:
        patch.setattr(nodes.QwenEditModelLoader, "load", host_full)
        with pytest.raises(jobs.JobBusyError, match=r"training job 'job_a' on cpu keeps .*\(MemoryError"):
            _load(SAMPLING, instance=1)
    with monkeypatch.context() as patch:
        patch.setattr(comfy, "load_models_gpu", device_full)
        with pytest.raises(jobs.JobBusyError, match=r"'job_a' on cpu keeps .*\(RuntimeError: .*can't allocate memory"):
            _load(SAMPLING, instance=2)
        patch.setattr(comfy, "load_models_gpu", failing)
        with pytest.raises(RuntimeError) as raised:
            _load(SAMPLING, instance=3)
        assert raised.value is broken
    assert _intact(trained)


def test_comfyuis_unload_or_dropping_the_model_closes_its_parallel_pool_and_the_next_parallel_sample_starts_one(
        comfy, monkeypatch):  # noqa: F811
    """The Sampler's `parallel` workers each hold a copy of the transformer ComfyUI does not see (one per GPU, or
    a mapping of its shared CPU weights): its pool closes when ComfyUI unloads the transformer, when the loader
    frees it for another model and when it is garbage collected; the next parallel sample starts a new pool.
    (A stand-in pool here; tests/sample/test_workers.py checks that a real pool's processes exit.)"""
    from nodes import sample_nodes
    from qwen_edit_core.sample import workers

    class StandInPool:
        """workers.TransformerPool without processes; holds nothing of the transformer (as the real one)."""

        def __init__(self, transformer, devices, mode, attention):
            self.config, self.closed = transformer.config, False

        def close(self):
            self.closed = True

    monkeypatch.setattr(workers, "TransformerPool", StandInPool)
    monkeypatch.setattr(workers, "_POOLS", {})
    monkeypatch.setenv(workers.DEVICES_ENV, "cpu,cpu")
    pool_of = lambda handle: sample_nodes.parallel_components(handle).transformer  # noqa: E731
    handle, _ = _load(SAMPLING)
    first = pool_of(handle)
    assert pool_of(handle) is first and not first.closed  # kept from one parallel sample to the next
    # a patcher dropped (ComfyUI's ModelPatcher.__del__ detaches with unpatch_all False) is no unload
    comfy_runtime.patcher_of(handle.components.transformer).detach(unpatch_all=False)
    assert pool_of(handle) is first and not first.closed, "a patcher dropped closed the parallel workers"
    comfy.free_memory(1e30, torch.device("cpu"))  # Unload models / Free model and node cache
    assert first.closed, "ComfyUI's unload left the parallel workers' copies of the model running"
    again, _ = _load(SAMPLING)  # the loader loads it again, and the next parallel sample starts a new pool
    second = pool_of(again)
    assert second is not first and not second.closed
    other, _ = _load(SAMPLING, dtype="bfloat16")  # the loader's settings changed: it frees the previous model
    assert loaded_models.freed(again.components.transformer) and second.closed
    third = pool_of(other)
    del other
    gc.collect()
    assert third.closed, "the parallel pool outlived its transformer"
