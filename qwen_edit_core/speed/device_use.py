"""What a training run holds on its device, measured as its own, and the memory its next step needs held back.

A run beside other work (a ComfyUI prompt on the same card) shares torch's caching allocator with it, so the
process-wide `torch.cuda.memory_allocated` counts the other work's tensors too. `DeviceUse` counts the run's own
tensors instead, storage by storage (its lender's weights, the LoRA, the optimizer state, fp8 copies, offload
buffers: `run_storages`), plus its `working` bytes: the most a step allocated above what it started with
(activations and gradients). That one is read from the allocator's peak (torch counts per device, and autograd's
backward allocates in a thread of its own), as a difference within the step, above the larger of what was allocated
at its start and at its end: memory another prompt frees during a step is not the step's.

Between steps those working bytes sit in the allocator's cache, reserved but inactive, and ComfyUI counts
reserved-but-inactive memory as free (comfy/model_management.py `get_free_memory`: the driver's free bytes plus
reserved minus active): a prompt queued beside the run would load its model there and the next step would run out
of memory. So at a step's end the run holds that many bytes (`Allocator.hold`: tensors over the cached blocks it
freed, never new device memory) and lets go of them when it uses the device again (`release`).
"""

from __future__ import annotations

import logging

import torch
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

log = logging.getLogger(__name__)

#: cached blocks smaller than this are left out of a hold (the allocator's small-block pool, 1 MiB)
SMALL_BLOCK = 1 << 20


def plain_tensors(tensor: torch.Tensor) -> list[torch.Tensor]:
    """The plain tensors that hold `tensor`'s data: itself, or a wrapper subclass's inner tensors (FSDP2 shards
    frozen weights into DTensors, whose shard is their local tensor). A wrapper's own storage has no data pointer,
    so a wrapper that does not name its inner tensors (`__tensor_flatten__`) counts for nothing."""
    if is_traceable_wrapper_subclass(tensor):
        names, _ = tensor.__tensor_flatten__()
        inner = (getattr(tensor, name) for name in names)
        return [t for part in inner if isinstance(part, torch.Tensor) for t in plain_tensors(part)]
    if type(tensor).__torch_dispatch__ is not torch.Tensor.__torch_dispatch__:
        return []
    return [tensor]


def storages_on(tensors, device: torch.device) -> dict[int, int]:
    """{storage data pointer: bytes} of the tensors that live on `device`, each storage once (a wrapper subclass's
    through its inner tensors: `plain_tensors`)."""
    found = {}
    plain = (inner for tensor in tensors if tensor is not None for inner in plain_tensors(tensor))
    for tensor in plain:
        if tensor.device == device and tensor.numel():
            storage = tensor.untyped_storage()
            found[storage.data_ptr()] = storage.nbytes()
    return found


def run_storages(transformer: torch.nn.Module, optimizer, device: torch.device) -> dict[int, int]:
    """The storages a training run holds on `device`: the transformer's parameters and buffers (its LoRA and fp8
    layers included, offloaded blocks' weights only while they are there), the optimizer's state and the block
    offloader's device buffers (speed/offload.py)."""
    state = [t for per_param in (optimizer.state.values() if optimizer is not None else ())
             for t in per_param.values() if isinstance(t, torch.Tensor)]
    offloader = getattr(transformer, "_qwen_edit_offloader", None)
    buffers = [b.memory for b in offloader.buffers] if offloader is not None else []
    return storages_on((*transformer.parameters(), *transformer.buffers(), *state, *buffers), device)


class Allocator:
    """torch's CUDA caching allocator as `DeviceUse` reads it (a stand-in replaces it in tests)."""

    def stats(self, device: torch.device) -> tuple[int, int]:
        """(allocated bytes, peak allocated bytes since the last `reset`)."""
        return torch.cuda.memory_allocated(device), torch.cuda.max_memory_allocated(device)

    def reset(self, device: torch.device) -> None:
        torch.cuda.reset_peak_memory_stats(device)

    def hold(self, device: torch.device, nbytes: int) -> list:
        """Tensors over up to `nbytes` of the allocator's cached, inactive blocks on `device` of the current
        stream, largest first: each request is a cached block's exact size, which the allocator serves from that
        block (its best fit), so a hold never asks the driver for memory. Nothing under another allocator backend
        (ComfyUI may set `backend:cudaMallocAsync`, which keeps no snapshot of cached blocks)."""
        if torch.cuda.get_allocator_backend() != "native":
            return []
        stream = torch.cuda.current_stream(device).cuda_stream
        sizes = [block["size"] for segment in torch.cuda.memory_snapshot()
                 if segment["device"] == device.index and segment["stream"] == stream
                 for block in segment["blocks"] if block["state"] == "inactive" and block["size"] >= SMALL_BLOCK]
        return [torch.empty(size, dtype=torch.uint8, device=device) for size in pick_blocks(sizes, nbytes)]


def pick_blocks(sizes, nbytes: int) -> list[int]:
    """The cached blocks (`sizes`) a hold of at most `nbytes` takes: largest first, each that still fits."""
    picked, left = [], nbytes
    for size in sorted(sizes, reverse=True):
        if size <= left:
            picked.append(size)
            left -= size
    return picked


class DeviceUse:
    """What a running job holds on its device: `own` (its tensors there at the last step's end, each storage
    once: `run_storages` merged with its lender's weights) plus `working` (the largest step peak above that).
    Measured on CUDA (or with a stand-in `allocator`); elsewhere `working` stays 0 and no memory is held."""

    def __init__(self, device: torch.device, allocator: Allocator | None = None) -> None:
        self.device = torch.device(device)
        if self.device.type != "cpu" and self.device.index is None:
            self.device = torch.device(self.device.type, 0)  # as tensors name it
        self.allocator = allocator if allocator is not None else Allocator() if self.device.type == "cuda" else None
        self.storages: dict[int, int] = {}
        self.working = 0
        self.held_back: list = []
        self.step_start = 0  # bytes allocated (process-wide) when the current step started

    def started(self, lender: dict[int, int]) -> None:
        """The job starts with its lender's weights (`storages_on`) on the device."""
        self.storages = dict(lender)
        self.release()

    def step_ended(self, lender: dict[int, int], run: dict[int, int] | None) -> None:
        """A step ended: its own storages now (`lender`'s weights still on the device, `run`'s tensors when the
        run reported them), the step's working peak (the largest so far); then hold that much back."""
        self.storages = {**lender, **(run or {})}
        if self.allocator is None:
            return
        allocated, peak = self.allocator.stats(self.device)
        self.working = max(self.working, peak - max(self.step_start, allocated))
        self.held_back = []  # the step's start let go of them; a run that reports no start lets go here
        self.held_back = self.allocator.hold(self.device, self.working)
        log.debug("holding %d of %d working bytes until the next step", sum(t.nbytes for t in self.held_back),
                  self.working)

    def release(self) -> None:
        """The job uses its device again (a step or a validation starts): what it held back is the allocator's,
        and the step's peak is measured from here."""
        self.held_back = []
        if self.allocator is not None:
            self.step_start = self.allocator.stats(self.device)[0]
            self.allocator.reset(self.device)

    def held(self) -> int:
        """Bytes the job holds on its device: its own storages plus `working`."""
        return sum(self.storages.values()) + self.working
