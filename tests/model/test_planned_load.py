"""Plan first, then load: the transformer reaches the device already in its planned form (fp8 where planned,
offloaded blocks left in host memory), so the bytes placed on the device while loading never exceed the plan's
resident weights; and the planned load gives exactly the weights, offloaded host copies and training step of
loading whole and applying the levers afterwards."""

from __future__ import annotations

import shutil
import weakref

import pytest
import torch
from diffusers import QwenImageTransformer2DModel
from safetensors.torch import save_file
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from qwen_edit_core import speed
from qwen_edit_core.adapters import lora, multires
from qwen_edit_core.config import load_config
from qwen_edit_core.model import components as comp
from qwen_edit_core.model import planned_load, weight_source
from qwen_edit_core.model.tiny import build_tiny

from conftest import scaled_fp8

N_BLOCKS = 6


class DeviceBytes(TorchDispatchMode):
    """Live and peak bytes of the tensors ops create on `device` from data: "meta" stands in for the GPU.

    The loader also uses meta tensors as mere shapes (the model skeleton, the files' headers), which hold no
    memory on any real device; so an output on `device` counts only when it holds data: a copy of a host tensor
    to the device, or the result of an op on a tensor already counted (a conversion on the device). It counts
    from the op that makes it until its storage is freed."""

    def __init__(self, device: str):
        super().__init__()
        self.device, self.live, self.peak = torch.device(device), 0, 0
        self._counted = weakref.WeakKeyDictionary()

    def _holds_data(self, func, t) -> bool:
        if not isinstance(t, torch.Tensor):
            return False
        copy = func in (torch.ops.aten._to_copy.default, torch.ops.aten.copy_.default)
        return (copy and t.device.type == "cpu") or t.untyped_storage() in self._counted

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if not any(self._holds_data(func, t) for t in tree_flatten((args, kwargs))[0]):
            return out
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.device == self.device and t.untyped_storage() not in self._counted:
                storage = t.untyped_storage()
                self._counted[storage] = storage.nbytes()
                self.live += storage.nbytes()
                self.peak = max(self.peak, self.live)
                weakref.finalize(storage, self._free, storage.nbytes())
        return out

    def _free(self, nbytes: int) -> None:
        self.live -= nbytes


def _bytes(tensors) -> int:
    return sum(t.untyped_storage().nbytes() for t in {id(t): t for t in tensors}.values())


@pytest.fixture(scope="module")
def six_block_dir(tmp_path_factory):
    """A tiny Edit model with 6 blocks whose transformer is a sharded checkpoint (an index and several files)."""
    root = build_tiny(tmp_path_factory.mktemp("planned") / "edit", transformer_overrides={"num_layers": N_BLOCKS})
    model = QwenImageTransformer2DModel.from_pretrained(root, subfolder="transformer")
    shutil.rmtree(root / "transformer")
    model.save_pretrained(root / "transformer", max_shard_size="100KB")
    assert (root / "transformer" / weight_source.INDEX_NAME).is_file()
    return root


def _train(**train):
    return load_config(overrides={"train": {"gradient_checkpointing": True, **train}}).train


def _single_file(model_dir, path, layout: str):
    """The transformer of `model_dir` written as one ComfyUI file: bf16, or scaled fp8 (e4m3 linears)."""
    state = QwenImageTransformer2DModel.from_pretrained(model_dir, subfolder="transformer").state_dict()
    state = scaled_fp8(state) if layout == "scaled-fp8 single file" else {k: v.to(torch.bfloat16)
                                                                         for k, v in state.items()}
    save_file(state, path)
    return path


def _source(model_dir, tmp_path, layout: str):
    if layout == "sharded directory":
        return weight_source.DirectorySource(model_dir)
    return weight_source.SingleFileSource(_single_file(model_dir, tmp_path / "t.safetensors", layout), "keep")


LAYOUTS = ["sharded directory", "bf16 single file", "scaled-fp8 single file"]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_planned_fp8_and_offload_load_places_at_most_the_plans_resident_weights_on_the_device(
        six_block_dir, tmp_path, layout):
    """fp8 base with 3 of 6 blocks offloaded, "meta" standing in for the GPU: every byte the load puts on that
    device is counted, for a diffusers directory and for ComfyUI single files (bf16, and scaled fp8 whose e4m3
    weights are kept). Its peak stays within the plan's resident weights: the resident blocks and the rest of
    the model in fp8/bf16 as planned, plus the two offloaded blocks the plan lets be in flight at a time.
    Loading whole first (then fp8 and offload) places the full fp32 model there: over 3x more than that here."""
    source = _source(six_block_dir, tmp_path, layout)
    keep = source.keeps_fp8(torch.device("meta"))
    assert keep == (layout == "scaled-fp8 single file")
    plan = speed.checked_plan("meta", torch.float32, N_BLOCKS, fp8=True, n_checkpointed=-1, n_offloaded=3,
                              already_fp8=keep)
    assert plan.fp8 and plan.offloaded == (1, 3, 5)
    skeleton = planned_load.build_skeleton(source, fp8=True)  # its meta tensors hold no memory on a real device
    with DeviceBytes("meta") as placed:
        model = planned_load.load_transformer_planned(source, plan, skeleton=skeleton)
    offloader = model._qwen_edit_offloader
    resident = _bytes([t for t in (*model.parameters(), *model.buffers()) if t.device.type == "meta"])
    in_flight = 2 * max(_bytes([host for *_, host in slots]) for slots in offloader.slots.values())
    whole = _bytes([t for t in comp.load_transformer(six_block_dir, device=torch.device("cpu"),
                                                     dtype=torch.float32).state_dict().values()])
    assert placed.peak > 0  # the count sees the resident weights arrive
    assert placed.peak <= resident + in_flight, (placed.peak, resident, in_flight)
    assert resident + in_flight < whole / 3, (resident, in_flight, whole)
    assert all(host.device.type == "cpu" for slots in offloader.slots.values() for *_, host in slots)
    assert speed.has_fp8(model) and speed.loaded_plan(model) is None  # a sampling-style plan: not re-applied


def _lora_step(model):
    """Inject a seeded LoRA, give it an effect, and return the loss and LoRA gradients of one training step."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        lora.inject_lora(model, lora.LoraSpec(rank=4, alpha=4.0, targets=lora.TARGET_PRESETS["attn"]))
        with torch.no_grad():
            for layer in lora.adapter_layers(model).values():
                layer.lora_B["default"].weight.normal_(0, 0.1)
    multires.install(model)
    speed.configure_training(model, _train(fp8_base=True, offload_blocks=3), torch.device("cpu"), tokens=116)
    g = torch.Generator().manual_seed(1)
    hidden, text, target = torch.randn(1, 96, 64, generator=g), torch.randn(1, 20, 32, generator=g), \
        torch.randn(1, 48, 64, generator=g)
    pred = model(hidden_states=hidden, timestep=torch.tensor([0.6]), encoder_hidden_states=text,
                 img_shapes=[[(1, 6, 8), (1, 6, 8)]], return_dict=False)[0][:, :48]
    loss = (pred - target).pow(2).mean()
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


def _host_copies(model) -> dict[str, torch.Tensor]:
    names = {id(m): n for n, m in model.named_modules()}
    return {f"{names[id(owner)]}.{name}": host for slots in model._qwen_edit_offloader.slots.values()
            for owner, name, _, host in slots}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_the_planned_load_equals_loading_whole_then_applying_the_levers(six_block_dir, tmp_path, layout):
    """Same resident weights, same host copies of the offloaded blocks, same loss and LoRA gradients (exactly:
    the same quantizer runs on the same values) as the load-then-configure path."""
    if layout == "sharded directory":
        source = weight_source.DirectorySource(six_block_dir)
        old = comp.load_transformer(six_block_dir, device=torch.device("cpu"), dtype=torch.float32)
    else:
        from qwen_edit_core.model.single_file import load_transformer_file
        source = _source(six_block_dir, tmp_path, layout)
        old = load_transformer_file(tmp_path / "t.safetensors", device=torch.device("cpu"), dtype=torch.float32,
                                    fp8="keep")
    old_loss, old_grads = _lora_step(old)
    sizes = speed.model_sizes(old)
    plan = speed.plan_training(_train(fp8_base=True, offload_blocks=3), torch.device("cpu"), torch.float32, sizes,
                               116, already_fp8=source.keeps_fp8(torch.device("cpu")))
    new = planned_load.load_transformer_planned(source, plan)
    assert speed.loaded_plan(new) == plan
    new_loss, new_grads = _lora_step(new)
    old_state, new_state = old.state_dict(), new.state_dict()
    assert old_state.keys() == new_state.keys()
    assert all(torch.equal(old_state[k], new_state[k]) for k in old_state)
    old_host, new_host = _host_copies(old), _host_copies(new)
    assert old_host.keys() == new_host.keys() and all(torch.equal(old_host[k], new_host[k]) for k in old_host)
    assert torch.equal(old_loss, new_loss)
    assert old_grads.keys() == new_grads.keys() and all(torch.equal(old_grads[k], new_grads[k]) for k in old_grads)


def test_a_source_that_does_not_match_its_config_is_refused_before_any_weight_is_read(six_block_dir, tmp_path):
    broken = tmp_path / "broken"
    shutil.copytree(six_block_dir / "transformer", broken / "transformer")
    config = (broken / "transformer" / "config.json").read_text().replace(f'"num_layers": {N_BLOCKS}',
                                                                          f'"num_layers": {N_BLOCKS + 1}')
    (broken / "transformer" / "config.json").write_text(config)
    plan = speed.checked_plan("cpu", torch.float32, N_BLOCKS + 1, fp8=False, n_checkpointed=None, n_offloaded=0)
    with pytest.raises(ValueError, match=r"does not match the architecture of its config: missing "
                                         r"\['transformer_blocks.6"):
        planned_load.load_transformer_planned(weight_source.DirectorySource(broken), plan)


def test_the_loader_runs_without_weights_under_fake_tensors():
    """A shapes-only source on the stand-in device under FakeTensorMode (how a real-size load is simulated)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from qwen_edit_core.model.tiny import transformer_config
    source = weight_source.ShapeOnlySource(transformer_config("tiny", num_layers=N_BLOCKS), torch.bfloat16)
    plan = speed.checked_plan("meta", torch.bfloat16, N_BLOCKS, fp8=True, n_checkpointed=-1, n_offloaded=2)
    with FakeTensorMode(allow_non_fake_inputs=True):
        model = planned_load.load_transformer_planned(source, plan)
    assert speed.has_fp8(model) and sorted(model._qwen_edit_offloader.slots) == [1, 4]


def test_training_loads_the_transformer_in_the_plan_it_made_before_loading(tiny_edit_dir, pairs_dir, tmp_path):
    """`fit` plans first (fp8, offloaded block, checkpointing) and loads the transformer straight into that plan;
    the training levers then apply that same plan."""
    from qwen_edit_core import QwenImageEditTrainer
    from conftest import train_config
    trainer = QwenImageEditTrainer(train_config(tiny_edit_dir, pairs_dir, tmp_path / "o", train={
        "max_steps": 1, "fp8_base": True, "gradient_checkpointing": True, "offload_blocks": 1}))
    assert trainer.fit().state == "done"
    transformer = trainer.components.transformer
    plan = speed.loaded_plan(transformer)
    assert plan is not None and plan.fp8 and plan.offloaded == (1,) and plan.checkpoint_blocks == -1
    assert speed.has_fp8(transformer) and sorted(transformer._qwen_edit_offloader.slots) == [1]
