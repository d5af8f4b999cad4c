"""The node pack without ComfyUI: schemas agree with functions, workflows match the nodes, nodes run on the
tiny model inside torch.inference_mode() (as ComfyUI calls them), and training jobs start, report, stop and
resume."""

from __future__ import annotations

import inspect
import json
from pathlib import Path

import pytest
import torch

import nodes
from nodes.common import TINY_MODEL, DatasetHandle, has_control_after_generate
from qwen_edit_core import jobs

from tolerances import TINY_SAMPLER_ROUNDINGS, assert_close_fp32, tiny_sampler_roundings

ROOT = Path(__file__).resolve().parents[2]
WORKFLOWS = sorted((ROOT / "example_workflows").glob("*.json"))
WIDGET_TYPES = ("INT", "FLOAT", "STRING", "BOOLEAN")
#: stock ComfyUI nodes the workflows use: (socket inputs, number of widgets, output types)
BUILTIN = {"SaveImage": ({"images": "IMAGE"}, 1, []), "PreviewImage": ({"images": "IMAGE"}, 0, []),
           "Note": ({}, 1, []), "SolidMask": ({}, 3, ["MASK"]),
           "MaskComposite": ({"destination": "MASK", "source": "MASK"}, 3, ["MASK"]),
           "ImageInvert": ({"image": "IMAGE"}, 0, ["IMAGE"]),
           "ImageCompositeMasked": ({"destination": "IMAGE", "source": "IMAGE", "mask": "MASK"}, 3, ["IMAGE"])}


def _inputs(cls):
    spec = cls.INPUT_TYPES()
    assert set(spec) <= {"required", "optional", "hidden"}
    return spec


@pytest.mark.parametrize("node_id", sorted(nodes.NODE_CLASS_MAPPINGS))
def test_schema_agrees_with_function(node_id):
    cls = nodes.NODE_CLASS_MAPPINGS[node_id]
    assert node_id.startswith("QwenEdit") and node_id in nodes.NODE_DISPLAY_NAME_MAPPINGS
    assert cls.CATEGORY.startswith("Qwen Edit")
    assert len(cls.RETURN_TYPES) == len(cls.RETURN_NAMES)
    spec = _inputs(cls)
    params = inspect.signature(getattr(cls, cls.FUNCTION)).parameters
    names = [n for group in spec.values() for n in group]
    if cls.FUNCTION == "load_tracked":  # loaders: load_tracked(<hidden>, **widgets) calls load(**widgets)
        hidden = ["unique_id", "prompt", "extra_pnginfo"]
        assert list(params) == ["self", *hidden, "widgets"] and list(spec["hidden"]) == hidden
        params = inspect.signature(cls.load).parameters
        names = [n for group in ("required", "optional") for n in spec.get(group, {})]
    for name in names:
        assert name in params, f"{node_id}.{cls.FUNCTION} does not take input {name!r}"
    for name, p in params.items():
        if name != "self" and p.default is inspect.Parameter.empty:
            assert name in spec["required"], f"{node_id}: parameter {name!r} has no required input"
    for group in ("required", "optional"):
        for name, value in spec.get(group, {}).items():
            assert isinstance(value, tuple) and (isinstance(value[0], (list, str)))
            if isinstance(value[0], list):
                assert value[0], f"{node_id}.{name}: empty combo"


def _outputs(node_type):
    if node_type in BUILTIN:
        return BUILTIN[node_type][2]
    return list(nodes.NODE_CLASS_MAPPINGS[node_type].RETURN_TYPES)


def _socket_and_widget_inputs(node_type):
    if node_type in BUILTIN:
        return BUILTIN[node_type][:2]
    spec = nodes.NODE_CLASS_MAPPINGS[node_type].INPUT_TYPES()
    sockets, widgets = {}, 0
    for group in ("required", "optional"):
        for name, value in spec.get(group, {}).items():
            options = value[1] if len(value) > 1 else {}
            if (isinstance(value[0], list) or value[0] in WIDGET_TYPES) and not options.get("forceInput"):
                widgets += 2 if has_control_after_generate(name, value) else 1
            else:
                sockets[name] = value[0]
    return sockets, widgets


@pytest.mark.parametrize("path", WORKFLOWS, ids=lambda p: p.name)
def test_workflow_matches_the_nodes(path):
    graph = json.loads(path.read_text())
    by_id = {n["id"]: n for n in graph["nodes"]}
    for node in graph["nodes"]:
        assert node["type"] in nodes.NODE_CLASS_MAPPINGS or node["type"] in BUILTIN, node["type"]
        sockets, widgets = _socket_and_widget_inputs(node["type"])
        assert len(node["widgets_values"]) == widgets, f"{path.name}: {node['type']} widget count"
        for socket in node["inputs"]:
            assert socket["name"] in sockets and socket["type"] == sockets[socket["name"]]
    for link_id, src, src_slot, dst, dst_slot, kind in graph["links"]:
        assert _outputs(by_id[src]["type"])[src_slot] == kind, f"{path.name}: link {link_id} source type"
        target = by_id[dst]["inputs"][dst_slot]
        assert target["type"] == kind and target["link"] == link_id, f"{path.name}: link {link_id} target"
    assert (ROOT / "example_workflows" / path.name).is_file()


#: the folders ComfyUI lists as a pack's templates (app/custom_node_manager.py, 0.3.64 and newer)
TEMPLATE_FOLDERS = ("example_workflows", "example", "examples", "workflow", "workflows")


def test_templates_are_listed_once_with_a_thumbnail_each():
    """ComfyUI lists every *.json of each template folder: only example_workflows/ holds them (no symlink),
    and beside each is the <name>.jpg the template browser shows, a picture the workflow drew."""
    from PIL import Image, ImageStat

    listed = [p.name for folder in TEMPLATE_FOLDERS for p in (ROOT / folder).glob("*.json")]
    assert sorted(listed) == [p.name for p in WORKFLOWS] and len(WORKFLOWS) >= 8, listed
    assert not (ROOT / "example_workflows").is_symlink()
    pictures = {}
    for path in WORKFLOWS:
        with Image.open(path.with_suffix(".jpg")) as image:
            assert image.format == "JPEG" and max(image.size) == 256, (path.name, image.format, image.size)
            assert max(ImageStat.Stat(image.convert("L")).stddev) > 10, f"{path.name}: blank thumbnail"
            pictures[path.name] = image.convert("RGB").tobytes()
    # as shipped, sample-with-LoRA (no LoRA) and two-GPU CFG (CFG 1) sample the same picture the same way
    same = [{"qwen_edit_sample_with_lora.json", "qwen_edit_two_gpu_cfg.json"}]
    assert all(len({pictures[n] for n in group}) == 1 for group in same)
    others = [picture for name, picture in pictures.items() if not any(name in group for group in same)]
    others += [pictures[min(group)] for group in same]
    assert len(set(others)) == len(others), "each thumbnail shows its own workflow's picture"


def test_shipped_workflows_are_the_generated_ones(tmp_path, monkeypatch):
    import importlib.util
    spec = importlib.util.spec_from_file_location("build_workflows", ROOT / "workflows" / "build_workflows.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    monkeypatch.setattr(module, "OUT", tmp_path)
    module.main()
    for path in WORKFLOWS:
        assert json.loads((tmp_path / path.name).read_text()) == json.loads(path.read_text()), path.name


@pytest.fixture(scope="module")
def env(tmp_path_factory, monkeypatch_module):
    root = tmp_path_factory.mktemp("comfy")
    for name in ("QWEN_EDIT_HOME", "QWEN_EDIT_LORAS", "QWEN_EDIT_OUTPUT"):
        monkeypatch_module.setenv(name, str(root / name.lower()))
    monkeypatch_module.chdir(root)
    return root


@pytest.fixture(scope="module")
def monkeypatch_module():
    mp = pytest.MonkeyPatch()
    yield mp
    mp.undo()


@pytest.fixture(scope="module")
def model(env):
    with torch.inference_mode():
        (handle,) = nodes.QwenEditModelLoader().load(TINY_MODEL, "cpu", "cpu", "cpu", "float32")
    return handle


def _image(seed=0, h=64, w=96):
    g = torch.Generator().manual_seed(seed)
    return torch.rand(1, h, w, 3, generator=g)


def test_sampler_and_encode_nodes_in_inference_mode(model):
    with torch.inference_mode():
        (image, _, _) = nodes.QwenEditSampler().sample(model, _image(), "make it blue", " ", 2, 3.0, 1, 0, 0, "dynamic",
                                                  "same", 64)
        (cond,) = nodes.QwenEditEncodePrompt().encode(model, _image(), "make it blue", " ", 0, 0, 64)
        (again, _) = nodes.QwenEditSampleConditioning().sample(model, cond, 2, 3.0, 1, "dynamic", "same")
        (latent, _) = nodes.QwenEditEncodeImage().encode(model, _image(), 64)
        (decoded,) = nodes.QwenEditDecodeLatent().decode(model, latent)
    assert image.ndim == 4 and image.shape[-1] == 3 and 0 <= image.min() and image.max() <= 1
    assert torch.equal(image, again)  # the same conditioning and denoising arithmetic, in the same order
    assert decoded.shape == (1, 64, 96, 3) or decoded.shape[-1] == 3


def test_split_cfg_node_equals_batched(model, monkeypatch):
    """The Sampler node with uncond_device set runs the uncond branch on a replica there, in its own thread, and
    gives the picture of its batched CFG (uncond_device same). An uncond_device that names the model's own device
    batches too, so the second device here is a second name for the CPU ("cpu:1")."""
    from qwen_edit_core.model import devices
    monkeypatch.setattr(devices, "available_devices", lambda: ["cpu", "cpu:1"])
    args = (_image(), "make it blue", "blurry, dark", 2, 3.0, 4, 64, 64, "dynamic")
    try:
        with torch.inference_mode():
            (batched, _, _) = nodes.QwenEditSampler().sample(model, *args, "same", 64)
            (split, _, _) = nodes.QwenEditSampler().sample(model, *args, "cpu:1", 64)
        assert list(model.replicas) == [("cpu:1", model.loras)]  # the node split CFG onto a replica
    finally:
        model.replicas.clear()
    # the uncond branch at batch 1 on its replica instead of beside the cond one: other kernels' sums
    assert_close_fp32(split, batched, ops=tiny_sampler_roundings(2), what="picture with split CFG vs batched")


def test_parallel_sampler_node_equals_in_process_and_keeps_its_workers(model, monkeypatch):
    """parallel: the transformer on 2 CPU worker processes (listed in QWEN_EDIT_PARALLEL_DEVICES), context
    parallel; the pool starts on the first run and serves the next one (same PIDs)."""
    from qwen_edit_core.sample import workers
    args = (_image(), "make it blue", " ", 2, 3.0, 1, 0, 0, "dynamic", "same", 64)
    monkeypatch.setenv(workers.DEVICES_ENV, "cpu,cpu")
    try:
        with torch.inference_mode():
            (plain, _, _) = nodes.QwenEditSampler().sample(model, *args)
            (first, _, _) = nodes.QwenEditSampler().sample(model, *args, parallel=True)
            pool = workers.shared_pool(model.components.transformer, ["cpu", "cpu"], tag=model.loras)
            pids = list(pool.pids)
            (cond,) = nodes.QwenEditEncodePrompt().encode(model, _image(), "make it blue", " ", 0, 0, 64)
            (second, _) = nodes.QwenEditSampleConditioning().sample(model, cond, 2, 3.0, 1, "dynamic", "same",
                                                                   parallel=True)
        assert workers.shared_pool(model.components.transformer, ["cpu", "cpu"], tag=model.loras).pids == pids
    finally:
        workers.close_pools()
    # attention split over the workers' sequence shards: other kernels' sums along a sampler run
    assert_close_fp32(first, plain, ops=TINY_SAMPLER_ROUNDINGS, what="picture from the parallel sampler")
    assert_close_fp32(second, plain, ops=TINY_SAMPLER_ROUNDINGS, what="picture from parallel conditioning")
    assert all(p.returncode == 0 for p in pool.processes)
    monkeypatch.setenv(workers.DEVICES_ENV, "cpu")
    with torch.inference_mode(), pytest.raises(ValueError, match=r"needs at least 2 devices; .* has 1 \(cpu\)"):
        nodes.QwenEditSampler().sample(model, *args, parallel=True)
    monkeypatch.setenv(workers.DEVICES_ENV, "cpu,cpu")
    with torch.inference_mode(), pytest.raises(ValueError, match="uncond_device cuda:1 .* set uncond_device to same"):
        nodes.QwenEditSampler().sample(model, *args[:9], "cuda:1", 64, parallel=True)


def test_train_job_from_nodes_reports_stops_and_resumes(model, env):
    with torch.inference_mode():
        (data, example) = nodes.QwenEditSyntheticDataset().make("pairs", 4, 0)
        result = nodes.QwenEditBuildCache().build(model, data, 64, "")
        cached = result["result"][0]
        (job,) = nodes.QwenEditTrain().start(model, cached, "node_lora", 400, 1e-3, 4, 4.0, "attn", 2, 64, 0, False, 0,
                                             True)
        with pytest.raises(jobs.JobBusyError, match="already runs on cpu"):
            nodes.QwenEditTrain().start(model, cached, "other", 5, 1e-3, 4, 4.0, "attn", 2, 64, 0, False, 0, True)
        seen = []
        status = jobs.wait_for(job, poll=0.05, on_tick=lambda s: seen.append(s.step) or (
            s.step >= 3 and job.stop()))
    assert status.state == "cancelled" and 3 <= status.step < 400 and status.last_checkpoint is not None
    assert max(seen) >= 3 and job.history
    stopped_at = status.step
    with torch.inference_mode():
        (job2,) = nodes.QwenEditTrain().start(model, cached, "node_lora", stopped_at + 2, 1e-3, 4, 4.0, "attn", 2,
                                              64, 0, True, 0, True)
        out = nodes.QwenEditTrainStatus().status(True, job2)
    name, path, plot, validation, loss = out["result"]
    assert out["ui"]["text"][0].startswith("node_lora: done") and name == "node_lora.safetensors"
    assert Path(path).is_file() and plot.shape[-1] == 3 and loss > 0
    assert job2.history[0][0] == stopped_at + 1  # continued, not restarted

    with torch.inference_mode():
        (with_lora,) = nodes.QwenEditLoraLoader().apply(model, "(none)", 1.0, lora_path=path)
    assert with_lora.loras == ((path, 1.0),) and model.loras == ()


def test_node_errors_are_clear(model, env, tmp_path):
    from qwen_edit_core.data.dataset import DatasetError
    from qwen_edit_core.model.devices import DeviceError
    with pytest.raises(DatasetError, match="does not exist"):
        nodes.QwenEditDataset().load(str(tmp_path / "missing"), False)
    (tmp_path / "empty").mkdir()
    with pytest.raises(DatasetError, match="accepted layouts"):
        nodes.QwenEditDataset().load(str(tmp_path / "empty"), False)
    with pytest.raises(DeviceError, match="transformer"):
        nodes.QwenEditModelLoader().load(TINY_MODEL, "cuda:3", "cpu", "cpu", "float32")
    from safetensors.torch import save_file
    save_file({"diffusion_model.single_blocks.0.linear.lora_down.weight": torch.zeros(4, 32),
               "diffusion_model.single_blocks.0.linear.lora_up.weight": torch.zeros(32, 4)}, tmp_path / "flux.st")
    with pytest.raises(ValueError, match="another model"):
        nodes.QwenEditLoraLoader().apply(model, "(none)", 1.0, lora_path=str(tmp_path / "flux.st"))
    with pytest.raises(ValueError, match="plain file name"):
        nodes.QwenEditTrain().start(model, None, "../x", 1, 1e-3, 4, 4.0, "attn", 1, 64, 0, False, 0, True)


def test_model_loader_takes_a_single_file_transformer(env, tmp_path):
    from safetensors.torch import save_file
    from nodes.common import resolve_model
    from qwen_edit_core.model.components import load_transformer
    model_dir = resolve_model(TINY_MODEL)
    state = load_transformer(model_dir, device=torch.device("cpu"), dtype=torch.float32).state_dict()
    save_file({f"model.diffusion_model.{k}": v.contiguous() for k, v in state.items()}, tmp_path / "q.safetensors")
    with torch.inference_mode():
        (handle,) = nodes.QwenEditModelLoader().load(TINY_MODEL, "cpu", "cpu", "cpu", "float32",
                                                      transformer_file=str(tmp_path / "q.safetensors"))
        transformer = nodes.QwenEditTransformerLoader().load(TINY_MODEL, "cpu", "float32", "none",
                                                             transformer_file=str(tmp_path / "q.safetensors"))[0]
        (vae,) = nodes.QwenEditVAELoader().load(TINY_MODEL, "cpu", "float32")
        (te,) = nodes.QwenEditTextEncoderLoader().load(TINY_MODEL, "cpu", "float32", "none")
        (scheduler,) = nodes.QwenEditSchedulerLoader().load(TINY_MODEL)
        (assembled,) = nodes.QwenEditAssembleModel().assemble(transformer, vae, te, scheduler)
    module = transformer[1]
    for key, value in state.items():
        assert torch.equal(handle.components.transformer.state_dict()[key], value)
        assert torch.equal(module.state_dict()[key], value)
    # The file travels through Assemble Model into the training config (it sets the cache identity).
    from nodes.train_nodes import _config
    from qwen_edit_core.data.dataset import load_dataset
    from conftest import make_pairs
    make_pairs(tmp_path / "data", n=2)
    dataset = DatasetHandle(tmp_path / "data", load_dataset(tmp_path / "data"))
    config = _config(assembled, dataset, output_dir=tmp_path / "out", resolution=64)
    assert assembled.components.transformer_file == tmp_path / "q.safetensors"
    assert config.model.transformer_file == str(tmp_path / "q.safetensors") and not config.model.vae_file


def test_speed_node_applies_fp8_and_the_attention_kernel_to_a_fresh_model(env):
    from qwen_edit_core import speed as perf
    with torch.inference_mode():
        (handle,) = nodes.QwenEditModelLoader().load(TINY_MODEL, "cpu", "cpu", "cpu", "float32")
        args = (_image(), "make it blue", " ", 2, 3.0, 1, 0, 0, "dynamic", "same", 64)
        (plain, _, _) = nodes.QwenEditSampler().sample(handle, *args)
        (fast,) = nodes.QwenEditSpeed().apply(handle, True, False, "math")
        (image, _, _) = nodes.QwenEditSampler().sample(fast, *args)
    assert fast.attention == "math" and perf.has_fp8(fast.components.transformer)
    assert float((image - plain).abs().mean()) < 0.002
    spec = nodes.QwenEditSpeed.INPUT_TYPES()["required"]
    assert list(spec) == ["model", "fp8", "compile", "attention"]
    assert tuple(spec["attention"][0]) == perf.SDPA_KERNELS  # its five choices, kept as saved workflows hold them


def test_speed_node_leaves_its_input_model_unchanged(env):
    """A graph without the Sampling Speed node, queued after one with it, samples exactly as a fresh load."""
    from qwen_edit_core import speed as perf
    args = (_image(), "make it blue", " ", 2, 3.0, 1, 0, 0, "dynamic", "same", 64)
    with torch.inference_mode():
        (handle,) = nodes.QwenEditModelLoader().load(TINY_MODEL, "cpu", "cpu", "cpu", "float32")
        (fast,) = nodes.QwenEditSpeed().apply(handle, True, False, "math")
        nodes.QwenEditSampler().sample(fast, *args)
        (after, _, _) = nodes.QwenEditSampler().sample(handle, *args)
        (fresh,) = nodes.QwenEditModelLoader().load(TINY_MODEL, "cpu", "cpu", "cpu", "float32")
        (reference, _, _) = nodes.QwenEditSampler().sample(fresh, *args)
    assert torch.equal(after, reference)
    assert not perf.has_fp8(handle.components.transformer) and handle.attention == "auto"
    assert fast.components.transformer is not handle.components.transformer
    # weights the levers leave alone are shared, not copied
    assert fast.components.transformer.img_in.weight is handle.components.transformer.img_in.weight


def test_train_node_trains_the_chosen_adapter_kind(model, env):
    """lora_type and dora (the Train node's last inputs) reach the run: a LoKr job writes LoKr keys, a DoRA job
    dora_scale, and both load back through Load LoRA."""
    from safetensors import safe_open
    with torch.inference_mode():
        (data, example) = nodes.QwenEditSyntheticDataset().make("pairs_kinds", 2, 0)
        cached = nodes.QwenEditBuildCache().build(model, data, 64, "")["result"][0]
    for lora_type, dora, key in (("lokr", False, "lokr_w1"), ("lora", True, "dora_scale")):
        name = f"kind_{lora_type}_{dora}"
        with torch.inference_mode():
            (job,) = nodes.QwenEditTrain().start(model, cached, name, 2, 1e-3, 4, 4.0, "attn", 2, 64, 0, False, 0,
                                                 True, lora_type=lora_type, dora=dora)
            path = nodes.QwenEditTrainStatus().status(True, job)["result"][1]
        with safe_open(path, framework="pt") as fh:
            assert any(k.endswith("." + key) for k in fh.keys()) and fh.metadata()["type"] == lora_type
        with torch.inference_mode():
            (with_lora,) = nodes.QwenEditLoraLoader().apply(model, "(none)", 1.0, lora_path=path)
        assert with_lora.loras == ((path, 1.0),)
