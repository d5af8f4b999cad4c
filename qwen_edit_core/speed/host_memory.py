"""Pinned host memory exactly the size a plan needs: one region per plan, its tensors views into it.

torch's caching host allocator (torch 2.14 `ATen/core/CachingHostAllocator.h`, `allocate`) rounds every pinned
request up to a power of two unless `pinned_max_round_threshold` is set, and keeps freed blocks cached as
page-locked memory. One `pin_memory()` per tensor therefore pinned up to twice each tensor's bytes (one
offloaded fp8 block of the 20 B transformer: 325 MiB exact, 513 MiB pinned). The threshold is a process-wide
setting (it would change every other user of the allocator in a ComfyUI process), so a `HostRegion` instead
asks the allocator only for sizes it does not round: powers of two (`pack`), into which the tensors are packed
largest first, each a view at an aligned offset. `release_cache` hands the allocator's cached pinned blocks back
to the system when a job ends.
"""

from __future__ import annotations

from typing import Sequence

import torch

#: every view starts at a multiple of this (any dtype's alignment; what cudaMemcpy's fast paths like)
ALIGN = 512
#: the smallest chunk asked for (the last few small tensors share it)
MIN_CHUNK = 2**20


def allocator_bytes(nbytes: int) -> int:
    """The bytes torch's caching host allocator pins for one request of `nbytes` (its default: the next power
    of two)."""
    return 1 << max(0, int(nbytes) - 1).bit_length() if nbytes > 0 else 0


def _aligned(nbytes: int) -> int:
    return -(-int(nbytes) // ALIGN) * ALIGN


def _floor_pow2(n: int) -> int:
    return 1 << (int(n).bit_length() - 1)


def pack(sizes: Sequence[int]) -> tuple[list[int], list[tuple[int, int]]]:
    """Chunk sizes (each a power of two, so the allocator pins exactly that) and, for each of `sizes` in order,
    its (chunk, byte offset). Largest first, first fit; a new chunk is the largest power of two the bytes still
    to place fill (at least the next tensor's and `MIN_CHUNK`), so the chunks exceed the aligned sizes' sum by
    less than the last chunk."""
    order = sorted(range(len(sizes)), key=lambda i: -int(sizes[i]))
    remaining = sum(_aligned(s) for s in sizes)
    chunks: list[int] = []
    used: list[int] = []
    places: list[tuple[int, int]] = [(0, 0)] * len(sizes)
    for i in order:
        size = _aligned(sizes[i])
        chunk = next((c for c in range(len(chunks)) if chunks[c] - used[c] >= size), None)
        if chunk is None:
            chunks.append(max(_floor_pow2(remaining) if remaining else 1, allocator_bytes(size), MIN_CHUNK))
            used.append(0)
            chunk = len(chunks) - 1
        places[i] = (chunk, used[chunk])
        used[chunk] += size
        remaining -= size
    return chunks, places


def _allocate(nbytes: int, pin: bool) -> torch.Tensor:
    """One chunk of host memory: page-locked through torch's caching host allocator when `pin`."""
    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin)


class HostRegion:
    """Host memory for a known list of tensors (shapes and dtypes), allocated at once in power-of-two chunks
    (`pack`) and pinned when `pin`; `put(i, tensor)` copies tensor i in and returns its view. The region lives
    as long as any of its views."""

    def __init__(self, specs: Sequence[tuple[torch.Size, torch.dtype]], pin: bool) -> None:
        self.specs = [(torch.Size(shape), dtype) for shape, dtype in specs]
        self.pin = pin
        sizes = [shape.numel() * dtype.itemsize for shape, dtype in self.specs]
        chunk_sizes, self.places = pack(sizes)
        self.chunks = [_allocate(size, pin) for size in chunk_sizes]
        #: bytes asked of the allocator (what it pins: every chunk is a power of two)
        self.requested_bytes = sum(chunk_sizes)
        #: bytes the tensors themselves take
        self.tensor_bytes = sum(sizes)

    def view(self, i: int) -> torch.Tensor:
        """Tensor i's place in the region."""
        shape, dtype = self.specs[i]
        chunk, offset = self.places[i]
        nbytes = shape.numel() * dtype.itemsize
        return self.chunks[chunk][offset: offset + nbytes].view(dtype).view(shape)

    def put(self, i: int, tensor: torch.Tensor) -> torch.Tensor:
        """Copy `tensor` (shape and dtype of spec i) into its place; returns the view."""
        shape, dtype = self.specs[i]
        if tensor.shape != shape or tensor.dtype != dtype:
            raise ValueError(f"HostRegion.put: tensor {i} is {tuple(tensor.shape)} {tensor.dtype}, its place was "
                             f"planned for {tuple(shape)} {dtype}")
        view = self.view(i)
        view.copy_(tensor.detach())
        return view


def release_cache() -> None:
    """Hand the cached pinned blocks no tensor uses any more back to the system (torch keeps them otherwise:
    page-locked, unswappable memory a long-lived process such as ComfyUI would hold after a job). A no-op
    where the accelerator's allocator never started."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        empty_host_cache()


def empty_host_cache() -> None:
    """Empty torch's pinned host cache: `torch.accelerator.empty_host_cache` where this torch has it (2.14 does,
    2.11 does not); else `torch._C._host_emptyCache`, what torch 2.11's own torch/cuda/graphs.py calls for it."""
    public = getattr(torch.accelerator, "empty_host_cache", None)
    (public or torch._C._host_emptyCache)()
