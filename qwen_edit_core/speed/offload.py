"""Block offloading: frozen block weights in pinned host memory, copied in just before each block runs.

Why not diffusers' `enable_group_offload(onload_device, offload_type="block_level", use_stream=True)`
(diffusers 0.42.1 `hooks/group_offloading.py`), which also copies blocks on a side stream:
- Its prefetch chain is the module order traced in the first forward pass (`LazyPrefetchGroupOffloadingHook`
  sets each group's `next_group` once). Training recomputes checkpointed blocks in the backward pass in
  reverse order, so that chain prefetches the block after the one being recomputed instead of the one before,
  and every recomputed block falls back to a synchronous copy (`GroupOffloadingHook.pre_forward`).
  `BlockOffloader` follows the direction blocks actually run in and prefetches the next one either way.
- It moves every parameter and buffer of a group (`ModuleGroup` walks `module.parameters()`), trainable ones
  included: the peft LoRA weights inside a block would leave the device after each call while autograd and
  the optimizer hold them. `BlockOffloader` moves only frozen tensors; LoRA weights, their gradients and the
  optimizer state stay on the device.
- It offloads every block of the list (grouped `num_blocks_per_group` at a time); the planner offloads a
  chosen subset, spread out (`offload_indices`), so each copy overlaps the compute of resident blocks.

When a block's device copies leave: a forward post-hook is not enough. Non-reentrant checkpointing stops the
recompute of a block in the backward pass as soon as the last tensor it saves is recomputed (torch raises an
internal error to end it), so the post-hook never runs for a recompute, and every offloaded block would end the
step with its weights on the device. Neither are the block's backward hooks (`register_full_backward_hook`, the
block swapper of musubi-tuner): they fire when the gradients of the block's inputs are ready, and for a block
whose inputs need no gradient (the first block's come from the frozen input projections) they fire at the start
of its backward, before its weights are last used. So the offloader does not try to detect the last use; it
only drops its own references:
- the device copies are new Parameter objects (never `.data` swapped into the old ones) over one of two fixed
  device buffers, so a tensor autograd saved during a recompute stays valid after the module lets go of it: its
  buffer is next overwritten when the offloaded block after the next one is copied in, which the backward reaches
  only once this block's backward ran;
- a block's references are dropped after its forward call (post-hook), when another block starts (pre-hook:
  blocks run one at a time, so the previous one is done, its recompute included), and at the end of every
  backward pass (a callback queued on the autograd engine, `Variable._execution_engine.queue_callback`, as
  FSDP2 queues its post-backward work in torch/distributed/fsdp/_fully_shard/_fsdp_state.py), which ends the
  last recompute of the step. After a step no offloaded weight is on the device (tests/speed/test_offload.py).

Why fixed buffers rather than a new device copy per call: a freed copy returns to the caching allocator but may be
reused only once the compute stream passed its last use (`record_stream`); with compiled blocks the host runs many
blocks ahead, so the copies still reserved were bounded by that run-ahead, not by the two blocks the planner counts
(`planner.OFFLOAD_IN_FLIGHT`). Here every offloaded block is copied into one of that many buffers made once, with
an event each way: the copy waits for the compute that last read its buffer, the compute for its copy, and the
host waits before reusing a buffer (as FSDP2 rate-limits its all-gathers in flight), so the device never holds
more, compiled or not.
"""

from __future__ import annotations

from contextlib import contextmanager, nullcontext
from typing import Sequence

import torch
from torch import nn

from qwen_edit_core.speed.host_memory import ALIGN, HostRegion
from qwen_edit_core.speed.planner import OFFLOAD_IN_FLIGHT


class BlockOffloader:
    """Keeps the frozen tensors of some blocks in pinned CPU memory and copies each block to the device just
    before it runs, prefetching the next offloaded block on a side stream so copies overlap compute.

    Works with forward hooks, so it serves training (forward, and the recompute of checkpointed blocks in the
    backward pass, which runs blocks in reverse order) and no-grad sampling alike. Offloaded blocks must be
    checkpointed in training: a block's weights then live on the device only while it runs or is recomputed.
    """

    def __init__(self, blocks: Sequence[nn.Module], indices: Sequence[int], device: torch.device, *,
                 loan=None, pin: bool | None = None, copies=None):
        self.device = torch.device(device)
        self.indices = sorted(set(indices))
        self.cuda = self.device.type == "cuda"
        #: host copies are page-locked (asynchronous copies): on CUDA unless told otherwise
        self.pin = self.cuda if pin is None else pin
        #: how copies and compute wait for each other (`StreamCopies` on CUDA, `SyncCopies` elsewhere)
        self.copies = copies if copies is not None else StreamCopies(self.device) if self.cuda else SyncCopies()
        self.slots: dict[int, list[tuple[nn.Module, str, bool, torch.Tensor]]] = {}
        #: prefetched blocks: block -> the device buffer its copy is in
        self.ready: dict[int, DeviceBuffer] = {}
        self.last, self.forward_dir = None, True
        self.live: set[int] = set()  # blocks whose device copies are set on their modules now
        self.queued_for = None  # the backward pass (graph task) whose end releases every block
        #: block calls whose copy was not prefetched (copied when the block started): the first offloaded block of
        #: a forward pass and the first recompute of a backward pass; any more means a wrong prefetch guess
        self.unprefetched = 0
        #: the host region the copies made here live in (None when every tensor was in host memory already)
        self.region: HostRegion | None = None
        self.blocks = {i: blocks[i] for i in self.indices}
        self.handles = []
        self._take_all(blocks, loan)
        self.layout = {i: _layout(self.slots[i]) for i in self.indices}
        size = max((needed for _, needed in self.layout.values()), default=0)
        #: the fixed device memory every offloaded block is copied into, one buffer per block in flight
        self.buffers = [DeviceBuffer(torch.empty(size, dtype=torch.uint8, device=self.device))
                        for _ in range(OFFLOAD_IN_FLIGHT if self.indices else 0)]
        for i in self.indices:
            self.handles.append(blocks[i].register_forward_pre_hook(self._make_pre(i)))
            self.handles.append(blocks[i].register_forward_hook(self._make_post(i)))

    def _frozen(self, block: nn.Module):
        """(module, name, is_param, tensor) of every frozen parameter and buffer of a block."""
        for module in block.modules():
            for is_param, table in ((True, module._parameters), (False, module._buffers)):
                for name, tensor in table.items():
                    if tensor is not None and not (is_param and tensor.requires_grad):
                        yield module, name, is_param, tensor

    def _in_host_memory(self, tensor: torch.Tensor) -> bool:
        """A tensor already in host memory (pinned where copies must be asynchronous), as the planned loader
        leaves an offloaded block's weights: taken as it is, never copied again."""
        return tensor.device.type == "cpu" and (not self.pin or tensor.is_pinned())

    def _take_all(self, blocks: Sequence[nn.Module], loan) -> None:
        """Move every offloaded block's frozen tensors to host memory: one region for all the copies made (pinned
        on CUDA, exactly their bytes: speed.host_memory), the modules pointed at empty placeholders. A tensor
        of a lent model (`loan`: speed.lending) is the lender's too: the loan parks it on that same host copy
        (its device memory is freed, and `give_back` restores it from there)."""
        found = {i: list(self._frozen(blocks[i])) for i in self.indices}
        to_copy = [t for entries in found.values() for *_, t in entries if not self._in_host_memory(t)]
        self.region = HostRegion([(t.shape, t.dtype) for t in to_copy], self.pin) if to_copy else None
        copied = 0
        with torch.no_grad():
            for i, entries in found.items():
                self.slots[i] = []
                for module, name, is_param, tensor in entries:
                    if self._in_host_memory(tensor):
                        host = tensor.detach()  # a new tensor object over the same memory
                    else:
                        host = self.region.put(copied, tensor)
                        copied += 1
                    if loan is not None and loan.owns(tensor):
                        loan.park(tensor, host)
                    self.slots[i].append((module, name, is_param, host))
                    placeholder = torch.empty(0, dtype=tensor.dtype, device=self.device)
                    if is_param and tensor.device != self.device:  # a host Parameter: a device one in its place
                        module._parameters[name] = nn.Parameter(placeholder, requires_grad=False)
                    else:
                        self._set(module, name, is_param, placeholder)

    @contextmanager
    def base_in_host_memory(self):
        """Point the offloaded blocks' modules at their host copies while the body runs (no device byte), then at
        empty placeholders again. Adapters made meanwhile see the real base (LoHa reads its shape, DoRA each row's
        norm) and are made beside it in host memory: their tensors move to the device afterwards, where the
        offloader keeps every trainable tensor."""
        with torch.no_grad():
            for slots in self.slots.values():
                for owner, name, is_param, host in slots:
                    self._set(owner, name, is_param, host)
        try:
            yield
        finally:
            with torch.no_grad():
                for slots in self.slots.values():
                    for owner, name, is_param, host in slots:
                        self._set(owner, name, is_param, torch.empty(0, dtype=host.dtype, device=self.device))
                for block in self.blocks.values():
                    for module in block.modules():
                        for name, t in module._parameters.items():
                            if t is not None and t.device != self.device:
                                module._parameters[name] = nn.Parameter(t.to(self.device), t.requires_grad)
                        for name, t in module._buffers.items():
                            if t is not None and t.device != self.device:
                                module._buffers[name] = t.to(self.device)

    @contextmanager
    def layer_on_device(self, module: nn.Module):
        """Point `module` (one layer of an offloaded block) at temporary device copies of its own host tensors
        while the body runs, then at empty placeholders again (the copies are freed); yields whether an offloaded
        block holds it (else nothing changes). One layer's bytes, far below the blocks in flight: for work that
        must read the real base on the device, as it would on a resident layer."""
        slots = [slot for entries in self.slots.values() for slot in entries if slot[0] is module]
        with torch.no_grad():
            for owner, name, is_param, host in slots:
                self._set(owner, name, is_param, host.to(self.device))
        try:
            yield bool(slots)
        finally:
            with torch.no_grad():
                for owner, name, is_param, host in slots:
                    self._set(owner, name, is_param, torch.empty(0, dtype=host.dtype, device=self.device))

    @property
    def host_bytes(self) -> int:
        """Bytes of the offloaded blocks' host copies."""
        return sum(host.nbytes for slots in self.slots.values() for *_, host in slots)

    @staticmethod
    def _set(module, name, is_param, value):
        """Point the module at `value`: a new Parameter, never the old one's data swapped (autograd may still
        hold the old one as a saved tensor)."""
        if is_param:
            module._parameters[name] = nn.Parameter(value, requires_grad=False)
        else:
            module._buffers[name] = value

    def _release(self, i: int) -> None:
        """Drop the module's references to block i's device copies; its buffer is free for another block once
        the compute queued so far has run (an event the next copy into it waits for)."""
        for owner, name, is_param, host in self.slots[i]:
            self._set(owner, name, is_param, torch.empty(0, dtype=host.dtype, device=self.device))
        self.live.discard(i)
        for buffer in self.buffers:
            if buffer.holder == i:
                buffer.freed, buffer.holder = self.copies.compute_done(), None

    def _release_all(self) -> None:
        """End of a backward pass: no block runs any more, so no device copy stays (nor any prefetch)."""
        for i in list(self.live):
            self._release(i)
        for i in list(self.ready):
            self._drop_prefetch(i)
        self.queued_for = None

    def _release_after_backward(self) -> None:
        """Inside a backward pass (a checkpointed block's recompute), release every block when it ends."""
        task = torch._C._current_graph_task_id()
        if task != -1 and self.queued_for != task:
            torch.autograd.Variable._execution_engine.queue_callback(self._release_all)
            self.queued_for = task

    def _drop_prefetch(self, i: int) -> None:
        """Forget a prefetched block no one used (a wrong guess): its buffer is free (no compute read it)."""
        self.ready.pop(i).holder = None

    def _free_buffer(self, keep: int | None) -> DeviceBuffer:
        """A buffer no running block holds: a free one, else one holding a prefetch other than `keep`'s."""
        free = [b for b in self.buffers if b.holder is None]
        if free:
            return free[0]
        stale = next((j for j in self.ready if j != keep), None)
        if stale is None:
            raise RuntimeError(f"BlockOffloader: every device buffer is held by a running block ({sorted(self.live)}); "
                               "blocks must run one at a time")
        buffer = self.ready[stale]
        self._drop_prefetch(stale)
        return buffer

    def _fetch(self, i: int, keep: int | None = None) -> None:
        """Copy block i into a free device buffer (prefetch), unless it is there already. The host first waits
        until the compute that last read that buffer has run (as FSDP2 limits its all-gathers in flight), so
        however far ahead the host runs (compiled blocks), no more than the buffers' blocks are ever on the
        device, and a copy never overwrites weights a queued kernel still reads."""
        if i in self.ready or i not in self.slots:
            return
        buffer = self._free_buffer(keep)
        self.copies.host_waits(buffer.freed)
        views = _views(buffer.memory, self.layout[i])
        buffer.copied = self.copies.copy([(view, host) for view, (*_, host) in zip(views, self.slots[i])],
                                         after=buffer.freed)
        buffer.holder, buffer.freed = i, None
        self.ready[i] = buffer

    def _next(self, i: int) -> int | None:
        """The offloaded block expected after block i: further in the current direction, else the turn."""
        ahead = [j for j in self.indices if (j > i if self.forward_dir else j < i)]
        if ahead:
            return ahead[0] if self.forward_dir else ahead[-1]
        return self.indices[-1] if self.forward_dir else self.indices[0]

    def _make_pre(self, i: int):
        def pre(module, args):
            if self.last is not None:
                # Forward runs blocks upwards, the backward's recompute downwards; the same block twice in a row
                # (last block's forward then its recompute, or block 0's recompute then the next forward) turns.
                self.forward_dir = i > self.last if i != self.last else not self.forward_dir
            if not torch.is_grad_enabled():
                self.forward_dir = True
            self.last = i
            for j in self.live - {i}:  # blocks run one at a time: the previous one is done
                self._release(j)
            self._release_after_backward()
            self.unprefetched += i not in self.ready
            self._fetch(i)
            buffer = self.ready.pop(i)
            self.copies.compute_waits(buffer.copied)
            for (owner, name, is_param, _), t in zip(self.slots[i], _views(buffer.memory, self.layout[i])):
                self._set(owner, name, is_param, t)
            self.live.add(i)
            nxt = self._next(i)
            if nxt is not None and nxt != i:
                self._fetch(nxt, keep=i)
        return pre

    def _make_post(self, i: int):
        def post(module, args, output):
            self._release(i)  # runs after a forward call, never after a recompute (see the module doc)
            return output
        return post

    def remove(self, restore: bool = True) -> None:
        """Remove the hooks and put every offloaded tensor back on the device (`restore`), or leave the modules
        with empty placeholders (not `restore`: a lent copy being given up, whose lent tensors its loan restores;
        the host copies are let go)."""
        for handle in self.handles:
            handle.remove()
        for i, slots in self.slots.items():
            for owner, name, is_param, host in slots:
                value = host.to(self.device) if restore else torch.empty(0, dtype=host.dtype, device=self.device)
                self._set(owner, name, is_param, value)
        self.slots, self.ready, self.live, self.region, self.buffers, self.blocks = {}, {}, set(), None, [], {}


class DeviceBuffer:
    """Device memory one offloaded block at a time is copied into: which block holds it (None: free), the
    event its copy completes with, and the event after which the compute that last read it has run."""

    def __init__(self, memory: torch.Tensor) -> None:
        self.memory = memory
        self.holder: int | None = None
        self.copied = None
        self.freed = None


class SyncCopies:
    """Copies where the device runs in step with the host (the CPU, the simulator's stand-in device): each copy
    is done when it returns, so there is nothing to wait for."""

    def copy(self, pairs, after=None):
        """Copy each (device view, host tensor) pair; returns the event the copy completes with."""
        for view, host in pairs:
            view.copy_(host)
        return None

    def compute_done(self):
        """An event after which the compute queued so far has run."""
        return None

    def compute_waits(self, event) -> None:
        """Later compute waits for `event` (a copy)."""

    def host_waits(self, event) -> None:
        """The host waits for `event` (compute that read a buffer)."""


class StreamCopies(SyncCopies):
    """Copies on a side stream of a CUDA device, overlapping compute: events order them both ways."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.stream = torch.cuda.Stream(device)

    def copy(self, pairs, after=None):
        with torch.cuda.stream(self.stream):
            if after is not None:
                self.stream.wait_event(after)
            for view, host in pairs:
                view.copy_(host, non_blocking=True)
            event = torch.cuda.Event()
            event.record(self.stream)
        return event

    def compute_done(self):
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        return event

    def compute_waits(self, event) -> None:
        if event is not None:
            torch.cuda.current_stream(self.device).wait_event(event)

    def host_waits(self, event) -> None:
        if event is not None:
            event.synchronize()


def _layout(entries) -> tuple[list[tuple[int, torch.Size, torch.dtype]], int]:
    """Where each of a block's tensors lies in a device buffer, (byte offset, shape, dtype), each offset aligned;
    and the bytes the block needs."""
    spans, offset = [], 0
    for *_, host in entries:
        spans.append((offset, host.shape, host.dtype))
        offset += -(-host.nbytes // ALIGN) * ALIGN
    return spans, offset


def _views(memory: torch.Tensor, layout) -> list[torch.Tensor]:
    """A block's tensors as views of a device buffer (`_layout`)."""
    spans, _ = layout
    return [memory[offset: offset + shape.numel() * dtype.itemsize].view(dtype).view(shape)
            for offset, shape, dtype in spans]


def base_in_host_memory(transformer):
    """`BlockOffloader.base_in_host_memory` of the transformer's offloader (a planned load made one before any
    adapter was added), or a context that does nothing."""
    offloader = getattr(transformer, "_qwen_edit_offloader", None)
    return offloader.base_in_host_memory() if offloader is not None else nullcontext()


def layer_on_device(transformer, module: nn.Module):
    """`BlockOffloader.layer_on_device` of the transformer's offloader, or a context yielding False (nothing
    offloaded: every layer is on its device already)."""
    offloader = getattr(transformer, "_qwen_edit_offloader", None)
    return offloader.layer_on_device(module) if offloader is not None else nullcontext(False)


def offload_indices(n_blocks: int, n_offloaded: int) -> list[int]:
    """Offloaded blocks spread evenly, so each copy overlaps the compute of the resident blocks around it."""
    n = max(0, min(n_offloaded, n_blocks))
    return sorted({int((k + 0.5) * n_blocks / n) for k in range(n)}) if n else []
