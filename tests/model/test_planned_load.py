"""Plan first, then load: the transformer reaches the device already in its planned form (fp8 where planned,
offloaded blocks left in host memory), so the bytes placed on the device while loading never exceed the plan's
resident weights; and the planned load gives exactly the weights, offloaded host copies and training step of
loading whole and applying the levers afterwards. For both model families (the 2025 Qwen-Image transformer and
Qwen-Image-2.1's, whose ComfyUI files fuse the MLP's gate and up projections), from a sharded diffusers directory
and from ComfyUI single files in bf16 and scaled fp8."""

from __future__ import annotations

import shutil

import pytest
import torch
from diffusers import QwenImage21Transformer2DModel, QwenImageTransformer2DModel
from safetensors.torch import save_file

from qwen_edit_core import speed
from qwen_edit_core.bench.memory_fp8_copy import DeviceBytes  # noqa: F401 (other tests import it from here)
from qwen_edit_core.adapters import lora, multires
from qwen_edit_core.config import load_config
from qwen_edit_core.model import components as comp
from qwen_edit_core.model import planned_load, weight_source
from qwen_edit_core.families.qwen_image_21 import single_file as single_file21
from qwen_edit_core.families import QWEN_IMAGE, QWEN_IMAGE_21, family_of_model
from qwen_edit_core.model.tiny import build_tiny

from conftest import scaled_fp8

N_BLOCKS = 6


def _bytes(tensors) -> int:
    return sum(t.untyped_storage().nbytes() for t in {id(t): t for t in tensors}.values())


def _sharded(root, cls):
    """`root`'s transformer re-saved as a sharded checkpoint (an index and several files)."""
    model = cls.from_pretrained(root, subfolder="transformer")
    shutil.rmtree(root / "transformer")
    model.save_pretrained(root / "transformer", max_shard_size="100KB")
    assert (root / "transformer" / weight_source.INDEX_NAME).is_file()
    return root


@pytest.fixture(scope="module")
def six_block_dir(tmp_path_factory):
    """A tiny Edit model with 6 blocks whose transformer is a sharded checkpoint (an index and several files)."""
    root = build_tiny(tmp_path_factory.mktemp("planned") / "edit", transformer_overrides={"num_layers": N_BLOCKS})
    return _sharded(root, QwenImageTransformer2DModel)


@pytest.fixture(scope="module")
def six_block_21_dir(tmp_path_factory):
    """A tiny Qwen-Image-2.1 model with 6 blocks whose transformer is a sharded checkpoint."""
    root = build_tiny(tmp_path_factory.mktemp("planned21") / "image-2.1", variant="image-2.1", seed=2,
                      transformer_overrides={"num_layers": N_BLOCKS})
    return _sharded(root, QwenImage21Transformer2DModel)


def _train(**train):
    return load_config(overrides={"train": {"gradient_checkpointing": True, **train}}).train


def _single_file(model_dir, family, path, layout: str):
    """The transformer of `model_dir` written as one ComfyUI file: bf16, or scaled fp8 (e4m3 linears); a 2.1 one
    in ComfyUI's layout (the MLP's gate and up fused, under the `model.diffusion_model.` prefix)."""
    state = family.class_of("transformer").from_pretrained(model_dir, subfolder="transformer").state_dict()
    if family is QWEN_IMAGE_21:
        state = single_file21.fuse(state)
    state = scaled_fp8(state) if layout == "scaled-fp8 single file" else {k: v.to(torch.bfloat16)
                                                                         for k, v in state.items()}
    prefix = "model.diffusion_model." if family is QWEN_IMAGE_21 else ""
    save_file({prefix + k: v for k, v in state.items()}, path)
    return path


def _source(model_dir, family, tmp_path, layout: str):
    if layout == "sharded directory":
        return weight_source.DirectorySource(model_dir)
    return weight_source.SingleFileSource(_single_file(model_dir, family, tmp_path / "t.safetensors", layout), "keep")


LAYOUTS = ["sharded directory", "bf16 single file", "scaled-fp8 single file"]
FAMILIES = {"2025": (QWEN_IMAGE, "six_block_dir"), "2.1": (QWEN_IMAGE_21, "six_block_21_dir")}
CASES = [pytest.param(f, layout, id=f"{f} {layout}") for f in FAMILIES for layout in LAYOUTS]


def _model_dir(request, family: str):
    return FAMILIES[family][0], request.getfixturevalue(FAMILIES[family][1])


@pytest.mark.parametrize("family, layout", CASES)
def test_a_planned_fp8_and_offload_load_places_at_most_the_plans_resident_weights_on_the_device(
        request, tmp_path, family, layout):
    """fp8 base with 3 of 6 blocks offloaded, "meta" standing in for the GPU: every byte the load puts on that
    device is counted, for a diffusers directory and for ComfyUI single files (bf16, and scaled fp8 whose e4m3
    weights are kept). Its peak stays within the plan's resident weights: the resident blocks and the rest of
    the model in fp8/bf16 as planned, plus the two offloaded blocks the plan lets be in flight at a time.
    Loading whole first (then fp8 and offload) places the full fp32 model there: over 2.5x more than that here
    (2.6x for the tiny 2.1 model, whose embedders and output projection weigh more beside its blocks)."""
    family, model_dir = _model_dir(request, family)
    source = _source(model_dir, family, tmp_path, layout)
    assert source.family is family
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
    assert type(model).__name__ == family.transformer_class
    whole = _bytes([t for t in comp.load_transformer(model_dir, device=torch.device("cpu"), dtype=torch.float32,
                                                     family=family).state_dict().values()])
    assert placed.peak > 0  # the count sees the resident weights arrive
    assert placed.peak <= resident + in_flight, (placed.peak, resident, in_flight)
    assert resident + in_flight < whole / 2.5, (resident, in_flight, whole)
    assert all(host.device.type == "cpu" for slots in offloader.slots.values() for *_, host in slots)
    assert speed.has_fp8(model) and speed.loaded_plan(model) is None  # a sampling-style plan: not re-applied


def _forward_2025(model, g):
    """The 2025 transformer's prediction for a random target of 6x8 tokens beside one control of 6x8."""
    hidden, text = torch.randn(1, 96, 64, generator=g), torch.randn(1, 20, 32, generator=g)
    return model(hidden_states=hidden, timestep=torch.tensor([0.6]), encoder_hidden_states=text,
                 img_shapes=[[(1, 6, 8), (1, 6, 8)]], return_dict=False)[0][:, :48]


def _forward_21(model, g):
    """The 2.1 transformer's prediction for a random target of 6x8 latent tokens after one reference of 6x8, whose
    12 vision slots (2x2 tokens each) sit inside a 20-token text."""
    hidden, text = torch.randn(1, 96, 64, generator=g), torch.randn(1, 20, 32, generator=g)
    slots = torch.zeros(1, 20, dtype=torch.bool)
    slots[:, 4:16] = True
    img_mask = torch.cat([slots, torch.ones(1, 12, dtype=torch.bool)], dim=1)
    return model(hidden_states=hidden, timestep=torch.tensor([0.6]), encoder_hidden_states=text,
                 img_shapes=[[(1, 6, 8), (1, 6, 8)]], img_mask=img_mask, return_dict=False)[0][:, -48:]


def _lora_step(model):
    """Inject a seeded LoRA, give it an effect, and return the loss and LoRA gradients of one training step."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        targets = family_of_model(model).lora_targets["all"]  # 2.1: its MLP halves, split from a fused file
        lora.inject_lora(model, lora.LoraSpec(rank=4, alpha=4.0, targets=targets))
        with torch.no_grad():
            for layer in lora.adapter_layers(model).values():
                layer.lora_B["default"].weight.normal_(0, 0.1)
    multires.install(model)
    speed.configure_training(model, _train(fp8_base=True, offload_blocks=3), torch.device("cpu"), tokens=116)
    g = torch.Generator().manual_seed(1)
    pred = (_forward_21 if isinstance(model, QwenImage21Transformer2DModel) else _forward_2025)(model, g)
    target = torch.randn(pred.shape, generator=g)
    loss = (pred - target).pow(2).mean()
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


def _host_copies(model) -> dict[str, torch.Tensor]:
    names = {id(m): n for n, m in model.named_modules()}
    return {f"{names[id(owner)]}.{name}": host for slots in model._qwen_edit_offloader.slots.values()
            for owner, name, _, host in slots}


@pytest.mark.parametrize("family, layout", CASES)
def test_the_planned_load_equals_loading_whole_then_applying_the_levers(request, tmp_path, family, layout):
    """Same resident weights, same host copies of the offloaded blocks, same loss and LoRA gradients (exactly:
    the same quantizer runs on the same values) as the load-then-configure path (the whole model loaded on the
    device, then fp8 and offload applied by `speed.configure_training`)."""
    family, model_dir = _model_dir(request, family)
    if layout == "sharded directory":
        source = weight_source.DirectorySource(model_dir)
        old = comp.load_transformer(model_dir, device=torch.device("cpu"), dtype=torch.float32, family=family)
    else:
        from qwen_edit_core.model.planned_load import load_transformer_file
        source = _source(model_dir, family, tmp_path, layout)
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


@pytest.mark.parametrize("family, layout", [CASES[2], CASES[4]])
def test_a_planned_load_pins_one_region_of_exactly_the_offloaded_blocks(request, tmp_path, monkeypatch, family,
                                                                         layout):
    """Pinning as on CUDA (`WeightPlan.pin` on, "meta" standing in for the GPU): the offloaded blocks' converted
    tensors go into one region sized from the file's header, whose power-of-two chunks are all the allocator is
    asked for (no tensor pinned on its own), and the offloader takes them from there as they are."""
    from qwen_edit_core.speed import host_memory
    requests, chunks = [], []

    def allocate(nbytes, pin):
        requests.append(nbytes)
        chunks.append(torch.empty(nbytes, dtype=torch.uint8))
        return chunks[-1]

    def pin_memory(self, *args, **kwargs):
        raise AssertionError("a tensor was pinned on its own")

    family, model_dir = _model_dir(request, family)
    source = _source(model_dir, family, tmp_path, layout)
    plan = speed.checked_plan("meta", torch.float32, N_BLOCKS, fp8=True, n_checkpointed=-1, n_offloaded=3,
                              already_fp8=source.keeps_fp8(torch.device("meta")))
    monkeypatch.setattr(host_memory, "_allocate", allocate)
    monkeypatch.setattr(host_memory, "MIN_CHUNK", host_memory.ALIGN)
    monkeypatch.setattr(speed.WeightPlan, "pin", property(lambda self: True))
    monkeypatch.setattr(torch.Tensor, "pin_memory", pin_memory)
    model = planned_load.load_transformer_planned(source, plan)
    hosts = _host_copies(model)
    assert sum(requests) == sum(host_memory.pack([h.nbytes for h in hosts.values()])[0])
    assert sum(h.nbytes for h in hosts.values()) <= sum(requests) <= 2 * sum(h.nbytes for h in hosts.values())
    assert model._qwen_edit_offloader.region is None  # the offloader copied nothing again: it took the views
    assert {h.untyped_storage().data_ptr() for h in hosts.values()} <= {c.data_ptr() for c in chunks}


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


def test_a_plan_larger_than_the_card_is_refused_before_any_weight_is_read(six_block_dir, monkeypatch):
    """A loader node's whole bf16 transformer on a card smaller than it is refused before any weight is read,
    naming both sizes and the fp8 load (never an out-of-memory part way through). Offloaded blocks do not count."""
    source = weight_source.DirectorySource(six_block_dir)
    plan = speed.WeightPlan(device=torch.device("cuda:0"), dtype=torch.float32)
    converted = planned_load.planned_state(source.convert(source.header(), set(), torch.float32, False), set())
    device_bytes = sum(t.numel() * t.element_size() for t in converted.values())
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (0, device_bytes - 1))
    monkeypatch.setattr(source, "modules", lambda: pytest.fail("a weight was read"))
    with pytest.raises(ValueError, match=r"take 0.0 GiB on cuda:0 \(float32\), more than its 0.0 GiB: read it into "
                                         r"fp8 \(transformer_fp8 on the loader"):
        planned_load.load_transformer_planned(source, plan)
    offloading = speed.WeightPlan(device=torch.device("cuda:0"), dtype=torch.float32, offloaded=(1, 3))
    planned_load.check_card(converted, offloading, "transformer_blocks", "t")  # two blocks fewer: fits


@pytest.mark.parametrize("family", FAMILIES)
def test_the_loader_runs_without_weights_under_fake_tensors(family):
    """A shapes-only source on the stand-in device under FakeTensorMode (how a real-size load is simulated)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from qwen_edit_core.families.qwen_image import tiny
    from qwen_edit_core.families.qwen_image_21 import tiny as tiny21
    config = tiny.transformer_config("tiny", num_layers=N_BLOCKS) if family == "2025" else \
        {**tiny21.transformer_config("tiny"), "num_layers": N_BLOCKS}
    source = weight_source.ShapeOnlySource(config, torch.bfloat16, family=FAMILIES[family][0])
    plan = speed.checked_plan("meta", torch.bfloat16, N_BLOCKS, fp8=True, n_checkpointed=-1, n_offloaded=2)
    with FakeTensorMode(allow_non_fake_inputs=True):
        model = planned_load.load_transformer_planned(source, plan)
    assert speed.has_fp8(model) and sorted(model._qwen_edit_offloader.slots) == [1, 4]
    assert type(model).__name__ == FAMILIES[family][0].transformer_class


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



def test_predict_fp8_streams_the_21_transformer_into_fp8_with_the_weights_of_quantizing_after_loading(tiny_21_dir):
    """`predict.fp8` plans before loading for Qwen-Image-2.1 too (`sample.predict.sampling_plan`): its block
    linears arrive in fp8, with exactly the state of loading whole and applying `predict.fp8` afterwards."""
    from qwen_edit_core.model.devices import DevicePlan
    from qwen_edit_core.sample import predict
    cpu = torch.device("cpu")
    config = load_config(overrides={"predict": {"fp8": True}})
    plan = predict.sampling_plan(cpu, torch.float32, config.predict)
    devices = DevicePlan.from_mapping({"text_encoder": "cpu", "vae": "cpu", "transformer": "cpu"}, dtype="float32")
    new = comp.load_components(tiny_21_dir, devices, which=("transformer",), transformer_plan=plan).transformer
    old = comp.load_transformer(tiny_21_dir, device=cpu, dtype=torch.float32, family=QWEN_IMAGE_21)
    speed.configure_inference(old, cpu, fp8=True, compile=False)
    assert isinstance(new, QwenImage21Transformer2DModel) and speed.has_fp8(new)
    old_state, new_state = old.state_dict(), new.state_dict()
    assert old_state.keys() == new_state.keys() and all(torch.equal(old_state[k], new_state[k]) for k in old_state)
