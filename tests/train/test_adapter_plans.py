"""DoRA, LoKr and LoHa load straight into their memory plan, as a plain LoRA does: the planner plans them in bf16
with offloaded blocks (they cannot wrap an fp8 base: `speed.adapter_no_fp8`), the transformer streams into that
plan without ever being whole on the device ("meta" stands in for the GPU and counts every byte placed there), and
an adapter made on blocks left in host memory trains exactly as one made on the whole model. A model loaded
otherwise (a ComfyUI graph's, lent to the Train node) is planned the same way from the adapter it carries."""

from __future__ import annotations

import pytest
import torch

from qwen_edit_core import speed
from qwen_edit_core.adapters import lora, multires
from qwen_edit_core.bench.memory_fp8_copy import DeviceBytes
from qwen_edit_core.config import load_config
from qwen_edit_core.model import components as comp
from qwen_edit_core.model import planned_load, weight_source
from qwen_edit_core.model.tiny import build_tiny
from qwen_edit_core.train import run

from conftest import train_config
from tolerances import TINY_TRAIN_STEP_ROUNDINGS, assert_close_fp32

N_BLOCKS = 6
KINDS = {"dora": {"type": "lora", "dora": True}, "lokr": {"type": "lokr"}, "loha": {"type": "loha"}}
#: the real 20 B model's sizes (speed.model_sizes) and a 1024^2 Edit step's tokens
REAL = {"n_blocks": 60, "block_params": 339_831_296, "other_params": 40_523_328, "dim": 3072,
        "trainable_params": 23_592_960}


def _spec(kind: str) -> lora.LoraSpec:
    return lora.LoraSpec(rank=2, alpha=2.0, targets=lora.resolve_targets("all"), **KINDS[kind])


def _bytes(tensors) -> int:
    return sum(t.untyped_storage().nbytes() for t in {id(t): t for t in tensors}.values())


@pytest.fixture(scope="module")
def six_block_dir(tmp_path_factory):
    return build_tiny(tmp_path_factory.mktemp("adapter_plans") / "edit", transformer_overrides={"num_layers": N_BLOCKS})


@pytest.mark.parametrize("kind", KINDS)
def test_an_adapter_without_fp8_loads_straight_into_a_bf16_offload_plan(six_block_dir, pairs_dir, tmp_path, kind):
    """The run's plan is made before loading (3 of 6 blocks offloaded, no fp8), and the load and the adapter's
    creation place on the device at most the plan's resident weights, the adapter and the two offloaded blocks in
    flight: never the whole model."""
    spec = _spec(kind)
    config = train_config(six_block_dir, pairs_dir, tmp_path, model={"lora": {"rank": 2, **KINDS[kind]}},
                          train={"gradient_checkpointing": True, "offload_blocks": 3})
    plan = run.training_plan(config, torch.device("meta"), six_block_dir, [((64, 64), ((64, 64),))], spec)
    assert plan is not None and not plan.fp8 and plan.offloaded == (1, 3, 5) and plan.training
    source = weight_source.DirectorySource(six_block_dir)
    skeleton = planned_load.build_skeleton(source, fp8=False)  # its meta tensors hold no memory on a real device
    with DeviceBytes("meta") as placed:
        model = planned_load.load_transformer_planned(source, plan, skeleton=skeleton)
        lora.inject_lora(model, spec)
    offloader = model._qwen_edit_offloader
    trainable = [p for p in model.parameters() if p.requires_grad]
    on_device = _bytes([t for t in (*model.parameters(), *model.buffers()) if t.device.type == "meta"])
    in_flight = _bytes([b.memory for b in offloader.buffers])
    whole = _bytes(comp.load_transformer(six_block_dir, device=torch.device("cpu"), dtype=plan.dtype)
                   .state_dict().values())
    assert 0 < placed.peak <= on_device + in_flight, (placed.peak, on_device, in_flight)
    assert placed.peak <= whole - offloader.host_bytes + in_flight + _bytes(trainable), (placed.peak, whole)
    assert trainable and all(p.device.type == "meta" for p in trainable)  # on the device, offloaded blocks' too
    assert all(host.device.type == "cpu" for slots in offloader.slots.values() for *_, host in slots)


def _norm_devices(monkeypatch) -> dict:
    """Spy on peft's DoRA norm: {base layer: device of the weight its latest magnitude was computed from}."""
    from peft.tuners.lora.dora import DoraLinearLayer
    made, current = {}, []
    update, norm = DoraLinearLayer.update_layer, DoraLinearLayer.get_weight_norm

    def update_layer(self, *, base_layer, **kwargs):
        current.append(base_layer)
        try:
            return update(self, base_layer=base_layer, **kwargs)
        finally:
            current.pop()

    def get_weight_norm(self, weight, *args, **kwargs):
        made[current[-1]] = weight.device
        return norm(self, weight, *args, **kwargs)

    monkeypatch.setattr(DoraLinearLayer, "update_layer", update_layer)
    monkeypatch.setattr(DoraLinearLayer, "get_weight_norm", get_weight_norm)
    return made


def test_dora_magnitudes_of_offloaded_blocks_are_computed_on_the_plans_device(six_block_dir, monkeypatch):
    """peft makes an offloaded block's DoRA magnitude beside its host copy (on the CPU, where bf16 norms may round
    otherwise): each is computed again on the plan's device ("meta" stands in), one layer's base copy at a time,
    within the plan's bytes; on the CPU in bf16 they equal a whole model's bit for bit."""
    made = _norm_devices(monkeypatch)
    plan = speed.checked_plan("meta", torch.bfloat16, N_BLOCKS, fp8=False, n_checkpointed=-1, n_offloaded=3,
                              training=True)
    source = weight_source.DirectorySource(six_block_dir)
    skeleton = planned_load.build_skeleton(source, fp8=False)
    with DeviceBytes("meta") as placed:
        model = planned_load.load_transformer_planned(source, plan, skeleton=skeleton)
        lora.inject_lora(model, _spec("dora"))
    offloader = model._qwen_edit_offloader
    layers = lora.adapter_layers(model, "default")
    assert layers and {layer.get_base_layer() for layer in layers.values()} == set(made)
    assert all(device.type == "meta" for device in made.values()), made
    on_device = _bytes([t for t in (*model.parameters(), *model.buffers()) if t.device.type == "meta"])
    assert 0 < placed.peak <= on_device + _bytes([b.memory for b in offloader.buffers])
    assert all(host.device.type == "cpu" and host.numel() for slots in offloader.slots.values() for *_, host in slots)
    assert all(t.numel() == 0 for i in offloader.indices for t in offloader.blocks[i].parameters()
               if not t.requires_grad)  # the temporary copies are gone

    def magnitudes(model):
        torch.manual_seed(0)
        lora.inject_lora(model, _spec("dora"))
        return {n: p.detach() for n, p in model.named_parameters() if "lora_magnitude_vector" in n}

    cpu_plan = speed.checked_plan("cpu", torch.bfloat16, N_BLOCKS, fp8=False, n_checkpointed=-1, n_offloaded=3,
                                  training=True)
    planned = magnitudes(planned_load.load_transformer_planned(source, cpu_plan))
    whole = magnitudes(comp.load_transformer(six_block_dir, device=torch.device("cpu"), dtype=torch.bfloat16))
    assert planned.keys() == whole.keys() and all(torch.equal(planned[n], whole[n]) for n in planned)


def _step(model, kind: str):
    """A seeded adapter of `kind` with an effect, the planned levers; the adapter as made, and one step's loss and
    adapter gradients."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        lora.inject_lora(model, _spec(kind))
        with torch.no_grad():
            for p in model.parameters():
                if p.requires_grad:
                    p.add_(torch.randn(p.shape) * 0.05)
    multires.install(model)
    train = load_config(overrides={"train": {"gradient_checkpointing": True, "offload_blocks": 3}}).train
    made = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    levers = speed.configure_training(model, train, torch.device("cpu"), tokens=116)
    assert levers.offloaded == (1, 3, 5) and not levers.fp8
    g = torch.Generator().manual_seed(1)
    hidden, text = torch.randn(1, 96, 64, generator=g), torch.randn(1, 20, 32, generator=g)
    pred = model(hidden_states=hidden, timestep=torch.tensor([0.6]), encoder_hidden_states=text,
                 img_shapes=[[(1, 6, 8), (1, 6, 8)]], return_dict=False)[0][:, :48]
    loss = (pred - torch.randn(pred.shape, generator=g)).pow(2).mean()
    loss.backward()
    return made, loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("kind", KINDS)
def test_an_adapter_made_on_offloaded_blocks_trains_as_one_made_on_the_whole_model(six_block_dir, kind):
    """The planned load leaves offloaded blocks' weights in host memory (empty placeholders on the modules): the
    adapter is made on the real base there (LoHa's shape, DoRA's row norms) and moves to the device. It is
    the same adapter as on the whole model before offloading (exactly), and the same step (within float32
    rounding: the weights' memory layouts differ, and with them the kernels' summation order)."""
    plan = speed.checked_plan("cpu", torch.float32, N_BLOCKS, fp8=False, n_checkpointed=-1, n_offloaded=3,
                              training=True)
    planned = planned_load.load_transformer_planned(weight_source.DirectorySource(six_block_dir), plan)
    whole = comp.load_transformer(six_block_dir, device=torch.device("cpu"), dtype=torch.float32)
    made, loss, grads = _step(planned, kind)
    want_made, want_loss, want_grads = _step(whole, kind)
    assert made.keys() == want_made.keys() and all(torch.equal(made[n], want_made[n]) for n in made)
    ops = 3 * TINY_TRAIN_STEP_ROUNDINGS  # six blocks, not two
    assert_close_fp32(loss, want_loss, ops=ops, what="loss")
    assert_close_fp32(grads, want_grads, ops=ops, what="adapter gradients")


def test_the_planner_plans_a_base_that_cannot_take_fp8_in_bf16_with_offloaded_blocks():
    """At 24 and 16 GiB the real model's bf16 base (38 GiB) fits only with offloaded blocks; where no bf16 plan
    fits, the refusal says fp8 was not possible and why; fp8 asked for is refused before any weight loads."""
    why = speed.adapter_no_fp8("lora", dora=True)
    assert why is not None and speed.adapter_no_fp8("lora", dora=False) is None
    for budget in (24, 16):
        plan = speed.plan_for_budget(budget, tokens=9601, no_fp8=why, **REAL)
        assert not plan.fp8 and 0 < plan.offload_blocks and plan.estimate.total <= budget * 2**30
    assert speed.plan_for_budget(24, tokens=9601, **REAL).fp8  # a plain LoRA still takes fp8 first
    with pytest.raises(ValueError, match=r"too small: even a bf16 base \(no fp8: DoRA reads"):
        speed.plan_for_budget(4, tokens=9601, no_fp8=why, **REAL)
    train = load_config(overrides={"train": {"fp8_base": True, "gradient_checkpointing": True}}).train
    with pytest.raises(ValueError, match=r"train.fp8_base asks for an fp8 base, and peft's LoKr"):
        speed.plan_training(train, "cpu", torch.bfloat16, REAL, 9601, no_fp8=speed.adapter_no_fp8("lokr", False))
    only_ckpt = speed.plan_for_budget(48, tokens=9601, no_fp8="x", no_offload="y", **REAL)
    assert not only_ckpt.fp8 and only_ckpt.offload_blocks == 0


@pytest.mark.parametrize("kind", KINDS)
def test_a_loaded_model_carrying_such_an_adapter_is_planned_without_fp8(six_block_dir, monkeypatch, kind):
    """The Train node plans the graph's loaded model after the adapter is injected: with six real-size blocks a
    6 GiB budget gives bf16 with offloaded blocks, never fp8, which the adapter cannot wrap."""
    model = comp.load_transformer(six_block_dir, device=torch.device("cpu"), dtype=torch.float32)
    lora.inject_lora(model, _spec(kind))
    assert speed.base_limits(model)[0] is not None
    monkeypatch.setattr(speed.levers, "model_sizes", lambda transformer: {**REAL, "n_blocks": N_BLOCKS})
    train = load_config(overrides={"train": {"gradient_checkpointing": True, "memory_budget_gb": 6}}).train
    levers = speed.configure_training(model, train, torch.device("cpu"), tokens=9601)
    assert not levers.fp8 and levers.offloaded


class Linear8bitLt(torch.nn.Linear):
    """Stands in for bitsandbytes' int8 layer (not installed here): the planner reads the package a layer comes from
    and the bytes its weight holds."""


Linear8bitLt.__module__ = "bitsandbytes.nn.modules"


def test_a_bitsandbytes_base_is_planned_with_its_own_bytes_without_fp8_or_offload(six_block_dir, monkeypatch):
    """`model.quantize: int8` loads through diffusers, never planned before loading: the training levers then plan
    checkpointing alone (fp8 and offload cannot apply to its layers) with its weights' int8 bytes, not bf16's."""
    from qwen_edit_core.speed import weight_plan
    model = comp.load_transformer(six_block_dir, device=torch.device("cpu"), dtype=torch.float32)
    for block in model.transformer_blocks:
        for parent in list(block.modules()):
            for name, child in list(parent.named_children()):
                if type(child) is torch.nn.Linear:
                    int8 = Linear8bitLt(child.in_features, child.out_features, bias=child.bias is not None)
                    int8.weight = torch.nn.Parameter(torch.zeros(int8.weight.shape, dtype=torch.int8),
                                                     requires_grad=False)
                    setattr(parent, name, int8.requires_grad_(False))
    assert speed.base_limits(model) == (weight_plan.NO_FP8_BNB, weight_plan.NO_OFFLOAD_BNB)
    asked = {}
    real_plan = weight_plan.plan_for_budget
    monkeypatch.setattr(weight_plan, "plan_for_budget", lambda *a, **kw: asked.update(kw) or real_plan(*a, **kw))
    train = load_config(overrides={"train": {"gradient_checkpointing": True, "memory_budget_gb": 8}}).train
    levers = speed.configure_training(model, train, torch.device("cpu"), tokens=116)
    assert not levers.fp8 and not levers.offloaded
    assert asked["no_fp8"] == weight_plan.NO_FP8_BNB and asked["no_offload"] == weight_plan.NO_OFFLOAD_BNB
    assert 1.0 <= asked["base_bytes"] < 1.2  # int8 weights; the biases and norms stay float32
    with pytest.raises(ValueError, match=r"train.offload_blocks 2: bitsandbytes keeps each weight's quantization"):
        speed.plan_training(load_config(overrides={"train": {"gradient_checkpointing": True,
                                                             "offload_blocks": 2}}).train,
                            "cpu", torch.bfloat16, REAL, 9601, no_offload=weight_plan.NO_OFFLOAD_BNB)


def test_training_with_dora_loads_into_the_plan_it_made_before_loading(tiny_edit_dir, pairs_dir, tmp_path):
    """`fit` with DoRA and an offloaded block: planned before loading (bf16, the block offloaded), loaded into that
    plan, the adapter made on the offloaded block's host copy, and one step trained."""
    from qwen_edit_core import QwenImageEditTrainer
    trainer = QwenImageEditTrainer(train_config(tiny_edit_dir, pairs_dir, tmp_path / "o", model={"lora": {
        "rank": 2, "targets": "attn-img", "dora": True}}, train={"max_steps": 1, "gradient_checkpointing": True,
                                                                 "offload_blocks": 1}))
    assert trainer.fit().state == "done"
    transformer = trainer.components.transformer
    plan = speed.loaded_plan(transformer)
    assert plan is not None and not plan.fp8 and plan.offloaded == (1,)
    assert sorted(transformer._qwen_edit_offloader.slots) == [1]
    magnitudes = [p for n, p in transformer.named_parameters() if "transformer_blocks.1." in n and "magnitude" in n]
    assert magnitudes and all(p.device.type == "cpu" and p.numel() > 0 for p in magnitudes)


def test_a_dora_file_continued_on_offloaded_blocks_takes_its_norms_on_the_plans_device(six_block_dir, tmp_path,
                                                                                        monkeypatch):
    """Continuing from a DoRA file (into the run's adapter) or loading one (a new adapter): each layer's magnitude
    is made from its base rows' norms, which for an offloaded block are read from a temporary device copy of that
    layer ("meta" stands in for the GPU), as for a resident layer; on the CPU the magnitudes equal a whole model's
    bit for bit."""
    from qwen_edit_core.adapters import kinds

    spec = _spec("dora")
    whole = comp.load_transformer(six_block_dir, device=torch.device("cpu"), dtype=torch.bfloat16)
    torch.manual_seed(0)
    lora.inject_lora(whole, spec)
    with torch.no_grad():
        for p in whole.parameters():
            if p.requires_grad:
                p.add_(torch.randn(p.shape) * 0.05)
    path = lora.save_lora(tmp_path / "dora.safetensors", whole, spec, base_identity="tiny", steps=1)
    source = weight_source.DirectorySource(six_block_dir)

    def planned(device: str):
        plan = speed.checked_plan(device, torch.bfloat16, N_BLOCKS, fp8=False, n_checkpointed=-1, n_offloaded=3,
                                  training=True)
        return planned_load.load_transformer_planned(source, plan, skeleton=planned_load.build_skeleton(
            source, fp8=False) if device == "meta" else None)

    seen, real = [], (kinds.peft_dora_from, kinds.row_norm)
    # the spies record the base's device and answer in host memory (meta has no values to divide or copy out)
    monkeypatch.setattr(kinds, "peft_dora_from", lambda base, down, up, *args: seen.append(base.device) or (
        up, torch.ones(base.shape[0])))
    monkeypatch.setattr(kinds, "row_norm", lambda base: seen.append(base.device) or torch.ones(base.shape[0], 1))
    model = planned("meta")
    offloaded = {id(m) for i in model._qwen_edit_offloader.indices for m in model.transformer_blocks[i].modules()}
    lora.inject_lora(model, spec)  # the run's adapter: training continues from the file
    seen.clear()
    lora.load_lora_file(model, path)
    fresh = planned("meta")
    lora.load_lora_file(fresh, path)  # a new adapter from the file
    assert offloaded and len(seen) == 2 * len(lora.adapter_layers(model, "default"))
    assert set(seen) == {torch.device("meta")}, seen
    monkeypatch.setattr(kinds, "peft_dora_from", real[0])
    monkeypatch.setattr(kinds, "row_norm", real[1])

    def magnitudes(model):
        lora.inject_lora(model, spec)
        lora.load_lora_file(model, path)
        return {n: p.detach() for n, p in model.named_parameters() if "lora_magnitude_vector" in n}

    on_plan = magnitudes(planned("cpu"))
    on_whole = magnitudes(comp.load_transformer(six_block_dir, device=torch.device("cpu"), dtype=torch.bfloat16))
    assert on_plan.keys() == on_whole.keys() and all(torch.equal(on_plan[n], on_whole[n]) for n in on_plan)
