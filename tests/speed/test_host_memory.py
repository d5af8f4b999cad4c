"""Pinned host memory is exactly what a plan needs: torch's caching host allocator pins the next power of two of
every request (torch 2.14 `CachingHostAllocator`), so the offloaded blocks' host copies are packed into chunks
that are powers of two already (speed.host_memory), counted here against the plan's bytes at real size."""

from __future__ import annotations

import pytest
import torch
from diffusers import QwenImageTransformer2DModel

from qwen_edit_core import speed
from qwen_edit_core.families.qwen_image.tiny import transformer_config
from qwen_edit_core.speed import host_memory

GIB = 2**30


def _real_fp8_block_sizes() -> list[int]:
    """Bytes of each frozen tensor of one real-size 2025-family block with fp8 linears (meta: no memory)."""
    with torch.device("meta"):
        model = QwenImageTransformer2DModel(**transformer_config("real", num_layers=1))
    model = model.to(torch.bfloat16).requires_grad_(False)
    speed.quantize_fp8(model)
    block = model.transformer_blocks[0]
    return [t.nbytes for t in (*block.parameters(), *block.buffers())]


@pytest.fixture(scope="module")
def block_sizes():
    return _real_fp8_block_sizes()


def test_one_fp8_block_is_325_mib_and_one_pin_per_tensor_pinned_about_1_6_times_that(block_sizes):
    exact = sum(block_sizes)
    assert 324 * 2**20 < exact < 325 * 2**20
    per_tensor = sum(host_memory.allocator_bytes(n) for n in block_sizes)
    assert per_tensor > 1.5 * exact  # what pinning each tensor on its own cost


@pytest.mark.parametrize("n_blocks", [1, 2, 37, 39, 60])
def test_a_plans_region_asks_for_powers_of_two_within_4_percent_of_its_bytes(block_sizes, n_blocks):
    sizes = block_sizes * n_blocks
    chunks, places = host_memory.pack(sizes)
    assert all(c == host_memory.allocator_bytes(c) for c in chunks)  # the allocator pins exactly these
    exact = sum(sizes)
    assert exact <= sum(chunks) <= 1.04 * exact, (n_blocks, exact / GIB, sum(chunks) / GIB)
    if n_blocks >= 37:  # the 16 GiB plan's offload: 12.4 GiB, not the ~19 GiB one pin per tensor asked for
        assert sum(chunks) - exact < 0.005 * exact
    # no two tensors overlap and each lies inside its chunk
    spans = sorted((c, o, o + s) for (c, o), s in zip(places, sizes))
    assert all(end <= chunks[c] for c, _, end in spans)
    assert all(a[0] != b[0] or a[2] <= b[1] for a, b in zip(spans, spans[1:]))


def test_the_offloader_pins_one_region_of_exactly_its_blocks_bytes(monkeypatch):
    """A (tiny) offloader told to pin: every byte it asks the allocator for is one region's power-of-two chunks,
    nothing is pinned tensor by tensor, and the host copies are views into the region holding the weights."""
    requests = []

    def allocate(nbytes, pin):
        requests.append((nbytes, pin))
        return torch.empty(nbytes, dtype=torch.uint8)

    def pin_memory(self, *args, **kwargs):
        raise AssertionError("a tensor was pinned on its own")

    monkeypatch.setattr(host_memory, "_allocate", allocate)
    monkeypatch.setattr(host_memory, "MIN_CHUNK", host_memory.ALIGN)
    monkeypatch.setattr(torch.Tensor, "pin_memory", pin_memory)
    torch.manual_seed(0)
    model = QwenImageTransformer2DModel(**transformer_config("tiny", num_layers=4)).requires_grad_(False)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    exact = sum(t.nbytes for i in (1, 3) for t in model.transformer_blocks[i].parameters())
    offloader = speed.BlockOffloader(model.transformer_blocks, [1, 3], torch.device("cpu"), pin=True)
    assert all(pin for _, pin in requests)
    assert sum(n for n, _ in requests) == offloader.region.requested_bytes
    assert offloader.host_bytes == exact <= offloader.region.requested_bytes <= 2 * exact
    chunks = {c.untyped_storage().data_ptr() for c in offloader.region.chunks}
    for i, slots in offloader.slots.items():
        for owner, name, is_param, host in slots:
            assert host.untyped_storage().data_ptr() in chunks
            assert torch.equal(host, before[f"transformer_blocks.{i}." + _path(model, owner) + name])
    offloader.remove()
    after = model.state_dict()
    assert all(torch.equal(after[k], before[k]) for k in before)


def _path(model, module) -> str:
    name = next(n for n, m in model.transformer_blocks.named_modules() if m is module and n)
    return name.split(".", 1)[1] + "." if "." in name else ""


def test_giving_back_a_lent_model_empties_the_host_cache(monkeypatch):
    released = []
    monkeypatch.setattr(host_memory, "release_cache", lambda: released.append(True))
    torch.manual_seed(0)
    model = QwenImageTransformer2DModel(**transformer_config("tiny", num_layers=2)).requires_grad_(False)
    copy = speed.lend(model)
    speed.give_back(copy)
    assert released == [True]


def test_the_host_cache_empties_on_a_torch_without_torch_accelerator_empty_host_cache(monkeypatch):
    """torch 2.11 has no `torch.accelerator.empty_host_cache`: the older binding it has serves."""
    called = []
    monkeypatch.delattr(torch.accelerator, "empty_host_cache", raising=False)
    monkeypatch.setattr(torch._C, "_host_emptyCache", lambda: called.append("older"))
    host_memory.empty_host_cache()
    assert called == ["older"]
