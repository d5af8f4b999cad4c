"""A transformer lent to a training run comes back as it was: the run's levers act on a copy over the same
tensors, offloaded and fp8-replaced weights are put back exactly."""

from __future__ import annotations

import pytest
import torch
from diffusers import QwenImageTransformer2DModel

from qwen_edit_core import speed
from qwen_edit_core.speed import lending
from qwen_edit_core.families.qwen_image.tiny import transformer_config


def _model(num_layers: int = 2):
    torch.manual_seed(0)
    return QwenImageTransformer2DModel(**transformer_config("tiny", num_layers=num_layers)).requires_grad_(False).eval()


def _held_bytes(*models) -> int:
    """Bytes the models' modules hold (parameters and buffers, each storage once): with the CPU standing for the
    device, what they keep on the device (host copies are held by the offloader, not by a module)."""
    storages = {}
    for model in models:
        for t in (*model.parameters(), *model.buffers()):
            if t.numel():
                storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(storages.values())


def _frozen_bytes(block) -> int:
    return sum(t.nbytes for t in (*block.parameters(), *block.buffers()) if not t.requires_grad)


def _state(model):
    return {name: t.clone() for name, t in model.state_dict().items()}


def test_the_copy_shares_every_weight_and_its_levers_stay_on_it():
    model = _model()
    copy = speed.lend(model)
    originals = {id(p) for p in model.parameters()}
    assert {id(p) for p in copy.parameters()} == originals  # no weight is copied
    copy.enable_gradient_checkpointing()
    copy.train()
    assert not model.is_gradient_checkpointing and not model.training
    speed.give_back(copy)


def test_fp8_replaced_weights_wait_in_host_memory_and_come_back_exactly(monkeypatch):
    # On this CPU-only machine the weights are already in host memory; pretend they are not, so they park.
    monkeypatch.setattr(lending, "on_host", lambda tensor: False)
    model = _model()
    before = _state(model)
    copy = speed.lend(model)
    replaced = speed.quantize_fp8(copy)
    emptied = [name for name, p in model.named_parameters() if p.numel() == 0]
    assert replaced > 0 and len(emptied) >= replaced  # each replaced layer's weight (and bias) parked
    assert all(".transformer_blocks." in f".{name}" for name in emptied)
    assert not any(isinstance(m, speed.Fp8Linear) for m in model.modules())
    speed.give_back(copy)
    after = model.state_dict()
    assert after.keys() == before.keys() and all(torch.equal(after[k], before[k]) for k in before)


def test_offloaded_weights_and_trainable_flags_come_back():
    model = _model()
    before = _state(model)
    copy = speed.lend(model)
    copy.proj_out.requires_grad_(True)  # a shared Parameter's flag: restored on give back
    copy._qwen_edit_offloader = speed.BlockOffloader(copy.transformer_blocks, [0], torch.device("cpu"))
    assert all(p.numel() > 0 for p in model.transformer_blocks[0].parameters())  # the copy's Parameters are new
    speed.give_back(copy)
    assert not any(p.requires_grad for p in model.parameters())
    after = model.state_dict()
    assert all(torch.equal(after[k], before[k]) for k in before)


def test_a_model_that_is_not_lent_keeps_its_replaced_layers_weights(monkeypatch):
    monkeypatch.setattr(lending, "on_host", lambda tensor: False)
    model = _model()
    linear = model.transformer_blocks[0].attn.to_q
    speed.quantize_fp8(model)
    assert linear.weight.numel() > 0  # nothing parked: the layer was the model's own


@pytest.mark.parametrize("k", [1, 2])
def test_offloading_k_blocks_of_a_lent_fp8_model_frees_k_blocks_and_gives_them_back_exactly(k):
    """The 24 GB ComfyUI path: the graph's model loaded from a scaled-fp8 file (fp8 block linears), lent to a run
    whose plan offloads k blocks. The lender's tensors of those blocks are parked on the offloader's host copies
    (one copy serves both): the two trees together hold k blocks' bytes fewer, the host copies are exactly k
    blocks, the copy still runs, and `give_back` restores every tensor object bit for bit."""
    from qwen_edit_core.speed import levers
    from qwen_edit_core.speed.weight_plan import WeightPlan
    model = _model(num_layers=3)
    speed.quantize_fp8(model)
    before, objects, total = _state(model), [*model.parameters(), *model.buffers()], _held_bytes(model)
    block = _frozen_bytes(model.transformer_blocks[0])
    copy = speed.lend(model)
    plan = WeightPlan(device=torch.device("cpu"), dtype=torch.float32, fp8=True, offloaded=tuple(range(k)),
                      checkpoint_blocks=-1, training=True)
    levers._apply(copy, plan, compile=False)
    assert _held_bytes(model, copy) == total - k * block
    assert copy._qwen_edit_offloader.host_bytes == k * block
    from qwen_edit_core.bench import memory
    assert memory.host_bytes(copy) == memory.pinned_host_bytes(copy)  # one host copy, counted once
    with torch.no_grad():  # the copy computes with its offloaded blocks copied in
        copy(hidden_states=torch.randn(1, 48, 64), timestep=torch.tensor([0.6]), encoder_hidden_states=torch.randn(
            1, 12, 32), img_shapes=[[(1, 6, 8)]], return_dict=False)
    speed.give_back(copy)
    assert [*model.parameters(), *model.buffers()] == objects
    after = model.state_dict()
    assert after.keys() == before.keys() and all(torch.equal(after[k], before[k]) for k in before)
    assert _held_bytes(model) == total


def _largest_linear(model):
    return max((m for m in model.transformer_blocks.modules() if type(m) is torch.nn.Linear),
               key=lambda m: m.weight.nbytes)


@pytest.mark.parametrize("park", [True, False])
def test_an_fp8_sampling_copy_never_holds_both_forms_of_the_block_weights(park):
    """`inference_copy` with fp8 on a bf16 model, "meta" standing in for the GPU (every byte placed there is
    counted): each bf16 block linear is parked as soon as its fp8 layer exists, so the peak is the input's
    weights W plus one layer's conversion (its fp32 temporary and e4m3 result, 2.5x its bf16 bytes L, and its
    scales and bias, 8 bytes a row): peak <= W + 2.5 L + 8 rows. Keeping the input's bf16 linears beside the new
    fp8 ones (`shared_copy`, the copy before) peaks over 1.5 W."""
    from qwen_edit_core.bench.memory_fp8_copy import DeviceBytes, fp8_copy
    model = _model().to(torch.bfloat16)
    largest = _largest_linear(model)
    layer, rows = largest.weight.nbytes, largest.out_features
    meta = torch.device("meta")
    with DeviceBytes("meta") as placed:
        model.to(meta)
        weights = placed.live
        fast = fp8_copy(model, meta, park=park)
    assert speed.has_fp8(fast) and not speed.has_fp8(model)
    if park:
        assert placed.peak <= weights + 2.5 * layer + 8 * rows, (placed.peak, weights, layer, rows)
        assert placed.live < 0.7 * weights  # then: the fp8 block linears beside the rest
    else:
        assert placed.peak > 1.5 * weights


def test_the_input_of_an_fp8_sampling_copy_gets_its_weights_back_when_used_and_the_copy_parks_them_again(
        monkeypatch):
    monkeypatch.setattr(lending, "on_host", lambda tensor: False)  # the CPU stands for the device
    model = _model()
    before = _state(model)
    fast = speed.inference_copy(model, torch.device("cpu"), fp8=True, compile=False)
    emptied = {name for name, p in model.named_parameters() if p.numel() == 0}
    assert emptied and all(".transformer_blocks." in f".{name}" for name in emptied)
    assert speed.repark(fast) == 0 and speed.unpark(fast) == 0  # already parked; the copy lends nothing back
    moved = speed.unpark(model)  # the input runs again: its own weights, bit for bit
    assert moved > 0 and all(torch.equal(t, before[k]) for k, t in model.state_dict().items())
    assert speed.repark(fast) == moved and {n for n, p in model.named_parameters() if p.numel() == 0} == emptied
    assert speed.unpark(model) == moved and all(torch.equal(t, before[k]) for k, t in model.state_dict().items())


def test_two_fp8_sampling_copies_of_one_input_each_park_its_weights_when_used(monkeypatch):
    """Two Sampling Speed copies of one input, used in turns with the input: whichever copy runs, the input's
    bf16 block linears are off the (stand-in) device; when the input runs they all come back, bit for bit."""
    monkeypatch.setattr(lending, "on_host", lambda tensor: False)  # the CPU stands for the device

    def use(module):  # what a node does first (nodes.loaded_models.use)
        speed.unpark(module)
        speed.repark(module)

    model = _model()
    before = _state(model)
    first = speed.inference_copy(model, torch.device("cpu"), fp8=True, compile=False)
    emptied = {name for name, p in model.named_parameters() if p.numel() == 0}
    use(model)
    second = speed.inference_copy(model, torch.device("cpu"), fp8=True, compile=False)
    both = _held_bytes(model, first, second)  # the input's parked linears on no device, each copy's fp8 ones
    for module in (first, model, first, second, model, second, first):
        use(module)
        if module is model:
            assert all(torch.equal(t, before[k]) for k, t in model.state_dict().items())
        else:
            assert {n for n, p in model.named_parameters() if p.numel() == 0} == emptied
            assert _held_bytes(model, first, second) == both


def test_the_fp8_copy_bench_counts_the_parked_copy_within_one_layers_conversion_of_the_weights():
    """`qwen-edit bench memory --fp8-copy` (BENCHMARKS.md, "Sampling Speed fp8") on two real-width blocks: parking
    peaks within the weights plus one layer's conversion; keeping the input's linears holds both forms."""
    from qwen_edit_core.bench import memory_fp8_copy
    parked = memory_fp8_copy.measure("edit", park=True, num_layers=2)
    kept = memory_fp8_copy.measure("edit", park=False, num_layers=2)
    layer, rows = 3072 * 18432 * 2 / 2**30, 18432  # the largest block linear's bf16 bytes (the modulation's)
    assert parked["weights_gib"] == kept["weights_gib"]
    assert parked["peak_gib"] <= parked["weights_gib"] + 2.5 * layer + 8 * rows / 2**30, parked
    assert kept["peak_gib"] > 1.4 * kept["weights_gib"], kept  # both forms of the block linears
    assert parked["after_gib"] < kept["after_gib"]
