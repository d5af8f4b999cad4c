"""Block offloading keeps its promise through whole training steps: an offloaded block's frozen weights are on
the device only while the block runs or is recomputed, so none are left there after a step's backward pass.

The CPU stands in for the device: the offloader's host copies and its device copies are both CPU tensors, so
every device copy is followed with a weak reference (taken by a forward pre-hook that runs after the
offloader's) and counted while anything (the module, autograd's saved tensors, a prefetch) still holds it.
"""

from __future__ import annotations

import gc
import weakref

import torch
from diffusers import QwenImageTransformer2DModel

from qwen_edit_core import speed
from qwen_edit_core.adapters import lora
from qwen_edit_core.families.qwen_image.tiny import transformer_config
from qwen_edit_core.speed import offload

OFFLOADED = [1, 3]


def _model() -> QwenImageTransformer2DModel:
    torch.manual_seed(0)
    model = QwenImageTransformer2DModel(**transformer_config("tiny", num_layers=4)).requires_grad_(False)
    lora.inject_lora(model, lora.LoraSpec(rank=4, alpha=4.0, targets=lora.TARGET_PRESETS["attn"]))
    return model


class DeviceCopies:
    """Weak references to every frozen tensor an offloaded block held while it ran (forward, recompute or
    no-grad call): the device copies the offloader made."""

    def __init__(self, model, indices):
        self.refs: list[weakref.ref] = []
        for i in indices:
            model.transformer_blocks[i].register_forward_pre_hook(self._record)

    def _record(self, block, args):
        for module in block.modules():
            for name, t in (*module._parameters.items(), *module._buffers.items()):
                if t is not None and not t.requires_grad and t.numel():
                    self.refs.append(weakref.ref(t))

    def resident_bytes(self, offloader) -> int:
        """Bytes of device copies still alive (held by anyone), prefetched copies included."""
        gc.collect()
        alive = [t for t in (r() for r in self.refs) if t is not None and t.numel()]
        alive += [buffer.memory for buffer in offloader.ready.values()]
        storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in alive}
        return sum(storages.values())


def _step(model, optimizer, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(1, 96, 64, generator=g)
    text = torch.randn(1, 20, 32, generator=g)
    pred = model(hidden_states=hidden, timestep=torch.tensor([0.6]), encoder_hidden_states=text,
                 img_shapes=[[(1, 6, 8), (1, 6, 8)]], return_dict=False)[0]
    pred.square().mean().backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def test_offloaded_weights_leave_the_device_after_every_full_training_step():
    model = _model()
    speed.checkpoint_blocks(model, -1)
    offloader = speed.BlockOffloader(model.transformer_blocks, OFFLOADED, torch.device("cpu"))
    copies = DeviceCopies(model, OFFLOADED)
    block_bytes = sum(host.numel() * host.element_size() for _, _, _, host in offloader.slots[OFFLOADED[0]])
    assert block_bytes > 0
    model.train()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    for step in range(3):
        _step(model, optimizer, seed=step)
        if step in (0, 2):  # after one and after three full steps
            assert copies.resident_bytes(offloader) == 0, f"step {step + 1}: offloaded weights left on the device"
    with torch.no_grad():  # a sampling call after training leaves nothing either
        model(hidden_states=torch.randn(1, 96, 64), timestep=torch.tensor([0.6]),
              encoder_hidden_states=torch.randn(1, 20, 32), img_shapes=[[(1, 6, 8), (1, 6, 8)]], return_dict=False)
    assert copies.resident_bytes(offloader) == 0
    assert len(copies.refs) >= 3 * 2 * len(OFFLOADED)  # every step ran each offloaded block twice (forward, recompute)


def test_prefetch_follows_the_direction_blocks_run_in():
    """Forward runs blocks upwards, the backward's recompute downwards: each step copies only the first
    offloaded block of each direction when it starts (nothing ran before it to overlap with); every other
    offloaded block was prefetched while the one before it ran."""
    model = _model()
    speed.checkpoint_blocks(model, -1)
    offloader = speed.BlockOffloader(model.transformer_blocks, [0, 1, 2, 3], torch.device("cpu"))
    model.train()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    for step in range(3):
        _step(model, optimizer, seed=step)
        assert offloader.unprefetched == 2 * (step + 1)  # of 8 block calls per step


def test_offloaded_blocks_are_compiled_and_train_as_eager_blocks_do(monkeypatch):
    """With compile on, offloaded blocks compile their forward alone (the offloader's hooks run eagerly around
    it): every block is compiled, three training steps give the eager run's LoRA, and no offloaded weight stays on
    the device. The `aot_eager` backend runs the compiled path (dynamo's graph, autograd's forward/backward
    partition) without generating kernels."""
    import functools

    from qwen_edit_core.speed import compile as compile_mod
    from qwen_edit_core.speed import levers as levers_mod
    from qwen_edit_core.speed.weight_plan import WeightPlan
    from tolerances import TINY_FORWARD_ROUNDINGS, assert_close_fp32
    monkeypatch.setattr(levers_mod, "compile_blocks", functools.partial(compile_mod.compile_blocks,
                                                                        backend="aot_eager"))
    runs = {}
    for compiled in (False, True):
        model = _model()
        plan = WeightPlan(device=torch.device("cpu"), dtype=torch.float32, offloaded=tuple(OFFLOADED),
                          checkpoint_blocks=-1, training=True)
        levers = levers_mod._apply(model, plan, compile=compiled)
        copies = DeviceCopies(model, OFFLOADED)
        model.train()
        optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
        for step in range(3):
            _step(model, optimizer, seed=step)
        assert copies.resident_bytes(model._qwen_edit_offloader) == 0
        stats = speed.compile_stats(model)
        runs[compiled] = (levers, {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad},
                          stats.graphs if stats is not None else 0)
    torch._dynamo.reset()
    assert runs[True][0].compiled == 4 and runs[False][0].compiled == 0
    assert runs[True][0].offloaded == tuple(OFFLOADED)
    assert runs[True][2] <= 4, "a new graph per call: the offloader's fresh weights must not recompile"
    for key, value in runs[False][1].items():  # three steps of a forward, a recompute and a backward each
        assert_close_fp32(runs[True][1][key], value, ops=9 * TINY_FORWARD_ROUNDINGS, what=key)


class LaggingDevice(offload.SyncCopies):
    """A stand-in device whose compute lags behind the host without bound: an event marking that compute read a
    buffer completes only when the host waits for it. Each copy checks that the buffer it overwrites was waited
    for, and every block call counts the offloaded weights alive on the device."""

    def __init__(self):
        self.copies, self.waited = 0, set()

    def compute_done(self):
        return object()  # a new event, not complete until waited for

    def host_waits(self, event) -> None:
        if event is not None:
            self.waited.add(id(event))

    def copy(self, pairs, after=None):
        assert after is None or id(after) in self.waited, "a copy overwrote weights queued compute still reads"
        self.copies += 1
        return super().copy(pairs, after)


def test_offloaded_blocks_share_two_fixed_device_buffers_however_far_the_host_runs_ahead():
    """With a device that never catches up unless the host waits, every block call finds the offloaded weights
    alive on the device inside the two buffers made once (two blocks in flight, as the planner counts), and no
    copy reuses a buffer before the host waited for the compute that read it; the LoRA trains exactly as without
    offload."""
    grads = {}
    for offloaded in ((), tuple(OFFLOADED)):
        model = _model()
        speed.checkpoint_blocks(model, -1)
        device = LaggingDevice()
        offloader = speed.BlockOffloader(model.transformer_blocks, offloaded, torch.device("cpu"), copies=device)
        copies = DeviceCopies(model, offloaded)
        counts = []
        buffers = {b.memory.untyped_storage().data_ptr() for b in offloader.buffers}

        def count(block, args):
            gc.collect()
            alive = {t.untyped_storage().data_ptr() for t in (r() for r in copies.refs) if t is not None and t.numel()}
            counts.append(alive <= buffers and len(alive) <= 2)
        for i in offloaded:
            model.transformer_blocks[i].register_forward_pre_hook(count)
        model.train()
        optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.0)
        for step in range(2):
            _step(model, optimizer, seed=step)
        _step_keep_grads(model, seed=5)
        grads[offloaded] = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        if offloaded:
            block = sum(host.nbytes for *_, host in offloader.slots[OFFLOADED[0]])
            assert len(offloader.buffers) == 2 and all(b.memory.nbytes < block + 512 * 64 for b in offloader.buffers)
            assert counts and all(counts) and device.copies >= 3 * 2 * len(OFFLOADED) - 2
    assert grads[()].keys() == grads[tuple(OFFLOADED)].keys()
    assert all(torch.equal(grads[()][k], grads[tuple(OFFLOADED)][k]) for k in grads[()])


def _step_keep_grads(model, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    pred = model(hidden_states=torch.randn(1, 96, 64, generator=g), timestep=torch.tensor([0.6]),
                 encoder_hidden_states=torch.randn(1, 20, 32, generator=g), img_shapes=[[(1, 6, 8), (1, 6, 8)]],
                 return_dict=False)[0]
    pred.square().mean().backward()
