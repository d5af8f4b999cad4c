"""A transformer lent to a training run and given back exactly as it was.

A run that trains on a model its caller keeps using (a ComfyUI graph's loaded transformer) works on
`lend(transformer)`: a new module tree over the same weight tensors (`shared_copy`). Every lever the run applies
changes only that tree: peft's LoRA layers, fp8 module replacement, compiled blocks, checkpointing flags, the
multi-resolution RoPE module and attention processors, train/eval mode. `give_back(copy)` then restores the two
things that act on the shared tensors themselves:

- block offload: the copy's offloaded blocks get new Parameters, and the lender's tensors of those blocks would
  stay on the device beside them (offloading would free nothing). The offloader hands each lent tensor it copies
  to the loan, which parks the lender's tensor on that same pinned host copy (one copy serves both); `give_back`
  removes the offloader and copies each back, bit for bit;
- fp8: a layer the copy quantizes no longer uses the original bf16 weight, which would stay on the device beside
  the fp8 one and defeat the memory plan. `quantize_fp8` parks each such weight in pageable host memory as it
  replaces the layer (`park`: one synchronous copy each way needs no pinning), and `give_back` moves it back.
  Cost: host memory for those weights while the run lasts (the block linears' bf16 size: docs/MODEL.md, "The
  real model's sizes") and one copy each way at the start and the end of a run (seconds at PCIe speed).

`give_back` ends by handing the pinned host blocks torch's allocator keeps cached back to the system
(speed.host_memory.release_cache).

Nothing else of the caller's model changes, so it samples bit-identically after the run, whether the run finished,
was stopped or failed. `requires_grad` is a flag of the shared Parameter objects: it is recorded and restored.
"""

from __future__ import annotations

import copy
import logging
import weakref

import torch
from torch import nn

from qwen_edit_core.speed import host_memory

log = logging.getLogger(__name__)

LENT = "_qwen_edit_lent"

#: how many times a loan moved lent tensors (parked or restored them): a ledger that counts the lender's storages
#: walks them again only when this changed (`moves`)
_moves = 0


def moves() -> int:
    """A count that changes whenever a loan parks or restores lent tensors (their storages on the device change)."""
    return _moves


def _moved() -> None:
    global _moves
    _moves += 1


def shared_copy(transformer: nn.Module) -> nn.Module:
    """A deep copy of the module tree whose parameters and buffers are the original's tensors (no weight is
    copied); compiled calls are dropped (a compiled call is bound to its own module)."""
    shared = {id(t): t for t in (*transformer.parameters(), *transformer.buffers())}
    fresh = copy.deepcopy(transformer, memo=shared)
    for module in fresh.modules():
        if getattr(module, "_compiled_call_impl", None) is not None:
            module._compiled_call_impl = None
    fresh._qwen_edit_compiled = False
    return fresh


class _Loan:
    """What `give_back` restores on the lent tensors: their requires_grad flags and the parked weights."""

    def __init__(self, original: nn.Module) -> None:
        self.flags = [(p, p.requires_grad) for p in original.parameters()]
        self.lent = {id(t): t for t in (*original.parameters(), *original.buffers())}
        self.parked: list[tuple[torch.Tensor, torch.Tensor, torch.device]] = []
        self.parked_bytes = 0  # the pageable host bytes of the copies the loan made itself
        #: the tensors parked with a copy of their own (`repark` parks them again after a `restore`)
        self.replaced: list[torch.Tensor] = []
        self.sampling = False  # a sampling copy's loan (`lend_for_sampling`): never given back

    def owns(self, tensor: torch.Tensor) -> bool:
        """Whether `tensor` is one of the lender's own (a Parameter or buffer object of the lent model)."""
        return self.lent.get(id(tensor)) is tensor

    def park(self, tensor: torch.Tensor, host: torch.Tensor | None = None) -> None:
        """Free one lent tensor's device memory until `give_back` (the tensor object stays, emptied). `host`: a
        host copy someone else made of it already (the block offloader's), which then serves both; otherwise
        a pageable copy is made (one copy each way needs no pinning)."""
        data = tensor.data
        if data.numel() == 0 or (host is None and on_host(data)):
            return
        if host is None:
            host = host_copy(data)
            self.replaced.append(tensor)
            self.parked_bytes += host.nbytes  # a shared copy is its maker's memory (the offloader's pinned region)
        self.parked.append((tensor, host, data.device))
        tensor.data = torch.empty(0, dtype=data.dtype, device=data.device)
        _moved()

    def repark(self) -> int:
        """Park again what `restore` put back (the copy is in use again); returns the bytes parked."""
        if self.parked:
            return 0
        replaced, self.replaced = self.replaced, []
        for tensor in replaced:
            if tensor.data.numel() == 0:  # another sampling copy of the same input holds it parked: kept for later
                self.replaced.append(tensor)
            else:
                self.park(tensor)
        return self.parked_bytes

    def restore(self) -> None:
        with torch.no_grad():
            for tensor, host, device in self.parked:
                tensor.data = host.to(device)
        if self.parked:
            _moved()
        self.parked, self.parked_bytes = [], 0
        for param, flag in self.flags:
            param.requires_grad_(flag)


def host_copy(data: torch.Tensor) -> torch.Tensor:
    """The pageable host copy a parked tensor waits in (of a meta tensor, the memory simulator's stand-in for the
    device, which holds no values: an uninitialised one)."""
    if data.is_meta:
        return torch.empty_like(data, device="cpu")
    return data.detach().to("cpu", copy=True)


def on_host(tensor: torch.Tensor) -> bool:
    """Whether a tensor already lives in host memory (nothing to park: it takes no device memory)."""
    return tensor.device.type == "cpu"


def lend(transformer: nn.Module) -> nn.Module:
    """The copy a run trains on (`shared_copy`), remembering how to give the original back."""
    fresh = shared_copy(transformer)
    setattr(fresh, LENT, _Loan(transformer))
    return fresh


#: models whose weights sampling copies park (`lend_for_sampling`), with each copy (weakly) and its loan: a loan
#: holds the host copies, so it lives as long as the model does while it holds any, whatever becomes of the copy;
#: one input may have several copies (each parks what it replaced, or waits for another copy to give it back)
_PARKED: "weakref.WeakKeyDictionary[nn.Module, list[tuple[weakref.ref, _Loan]]]" = weakref.WeakKeyDictionary()


def lend_for_sampling(transformer: nn.Module) -> nn.Module:
    """A copy for sampling levers (`speed.inference_copy`) that parks the lender's weights it replaces (fp8),
    layer by layer as it replaces them, so the device never holds both forms of the model. The lender's
    weights come back when it is used again (`unpark`); the copy parks them again when it is (`repark`)."""
    fresh = lend(transformer)
    loan = loan_of(fresh)
    loan.sampling = True
    _PARKED.setdefault(transformer, []).append((weakref.ref(fresh), loan))
    return fresh


def unpark(model: nn.Module) -> int:
    """Put back on their device the weights of `model` that a sampling copy parked (before `model` runs);
    returns the bytes moved (0 when nothing was parked)."""
    loans = _PARKED.get(model, [])
    moved = sum(loan.parked_bytes for _, loan in loans)
    if moved:
        log.info("%.2f GiB of weights sampling copies parked go back to their device", moved / 2**30)
    for _, loan in loans:
        loan.restore()
    loans[:] = [(copy, loan) for copy, loan in loans if copy() is not None]  # a dropped copy parks nothing again
    return moved


def repark(copy: nn.Module) -> int:
    """Before a sampling copy runs: park again the lender's weights it replaced, if `unpark` put them back;
    returns the bytes parked (0 for any other model: a training loan is given back, never parked again)."""
    loan = loan_of(copy)
    if loan is None or not loan.sampling:
        return 0
    parked = loan.repark()
    if parked:
        log.info("%.2f GiB of the input model's weights parked again for its sampling copy", parked / 2**30)
    return parked


def loan_of(transformer: nn.Module):
    """The loan of a lent copy (what `give_back` restores), or None for a model that is not lent."""
    return getattr(transformer, LENT, None)


def park(transformer: nn.Module, linear: nn.Linear) -> None:
    """`linear` (a layer of a lent copy, just replaced by an fp8 one) no longer needs its weights: when they
    belong to the lender, park them in host memory; a transformer that is not lent keeps them (they are its
    own and go with the replaced layer)."""
    loan = getattr(transformer, LENT, None)
    if loan is None:
        return
    for param in linear.parameters(recurse=False):
        loan.park(param)


def give_back(transformer: nn.Module) -> None:
    """End a loan: the offloader removed (offloaded weights back on their device), parked weights back, the
    requires_grad flags as lent. The copy itself is dropped by the caller."""
    loan = getattr(transformer, LENT, None)
    offloader = getattr(transformer, "_qwen_edit_offloader", None)
    if offloader is not None:
        # A lent copy is given up: its offloaded tensors are not copied back to the device for it (the lender's
        # come back below, from the same host copies).
        offloader.remove(restore=loan is None)
        transformer._qwen_edit_offloader = None
    if loan is None:
        return
    if loan.parked:
        log.info("giving back the lent transformer: %.2f GiB of parked weights back on their device",
                 loan.parked_bytes / 2**30)
    loan.restore()
    delattr(transformer, LENT)
    host_memory.release_cache()
