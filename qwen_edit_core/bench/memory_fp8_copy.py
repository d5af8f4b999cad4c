"""`qwen-edit bench memory --fp8-copy`: the device bytes the Sampling Speed node's fp8 copy takes while it turns
a real-size bf16 transformer's block linears to fp8 (`speed.inference_copy`), against the copy that keeps the
input's bf16 linears beside the new fp8 ones (`shared_copy` + `configure_inference`, what the node did before).

The model is built on "meta", which stands in for the GPU: its weights hold no values, and `DeviceBytes` counts
every byte an op places there from data (the model's weights, a conversion's temporaries and results) until it is
freed. The parked bf16 linears go to the host, as uninitialised copies (a meta tensor has no values to copy).
"""

from __future__ import annotations

import json
import logging
import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from qwen_edit_core.bench import fake_model as fm
from qwen_edit_core.families import variants

log = logging.getLogger(__name__)

GIB = 2**30


class DeviceBytes(TorchDispatchMode):
    """Live and peak bytes of the tensors ops create on `device` from data: "meta" stands in for the GPU.

    Meta tensors also serve as mere shapes (a model skeleton, a file's header), which hold no memory on any real
    device; so an output on `device` counts only when it holds data: a copy of a host tensor to the device, the
    result of an op on a tensor already counted (a conversion on the device), or a tensor given to `count`. It
    counts from the op that makes it until its storage is freed."""

    def __init__(self, device: str):
        super().__init__()
        self.device, self.live, self.peak = torch.device(device), 0, 0
        self._counted = weakref.WeakKeyDictionary()

    def count(self, tensors) -> None:
        """Count `tensors` (on `device`) as holding data, as if copied there."""
        for t in tensors:
            self._add(t.untyped_storage())

    def _add(self, storage) -> None:
        if storage in self._counted:
            return
        self._counted[storage] = storage.nbytes()
        self.live += storage.nbytes()
        self.peak = max(self.peak, self.live)
        weakref.finalize(storage, self._free, storage.nbytes())

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
            if isinstance(t, torch.Tensor) and t.device == self.device:
                self._add(t.untyped_storage())
        return out

    def _free(self, nbytes: int) -> None:
        self.live -= nbytes



def fp8_copy(model: torch.nn.Module, device: torch.device, *, park: bool) -> torch.nn.Module:
    """The Sampling Speed node's fp8 copy of `model` on `device`: `park` as the node makes it (each bf16 block
    linear parked once its fp8 layer exists: `speed.inference_copy`), else the copy before, which kept the input's
    linears beside the fp8 ones (`shared_copy` + `configure_inference`)."""
    from qwen_edit_core import speed
    if park:
        return speed.inference_copy(model, device, fp8=True, compile=False)
    fast = speed.shared_copy(model)
    speed.configure_inference(fast, device, fp8=True, compile=False)
    return fast

def measure(variant: str = variants.DEFAULT, *, park: bool, num_layers: int | None = None) -> dict:
    """The bf16 transformer of `variant` on meta, then its fp8 sampling copy: {"weights_gib", "peak_gib",
    "after_gib", "peak_ratio"} of the device bytes (`park`: the node's copy; else the input's linears stay)."""
    cls = variants.get(variant).family.class_of("transformer")
    meta = torch.device("meta")
    with meta:
        model = cls(**fm.transformer_config(variant, num_layers)).to(torch.bfloat16)
    model.requires_grad_(False)
    with DeviceBytes("meta") as placed:
        placed.count((*model.parameters(), *model.buffers()))
        weights = placed.live
        fast = fp8_copy(model, meta, park=park)
    after = placed.live
    del fast
    return {"variant": variant, "park": park, "layers": len(model.transformer_blocks),
            "weights_gib": weights / GIB, "peak_gib": placed.peak / GIB, "after_gib": after / GIB,
            "peak_ratio": placed.peak / weights}


def report(variant: str = variants.DEFAULT, *, as_json: bool = False) -> str:
    """Both copies of the real-size transformer, as JSON lines or two sentences."""
    rows = [measure(variant, park=park) for park in (True, False)]
    if as_json:
        return "\n".join(json.dumps(r) for r in rows)
    return "\n".join(f"{r['variant']} ({r['layers']} blocks), {'parking' if r['park'] else 'keeping'} the input's "
                     f"bf16 linears: peak {r['peak_gib']:.2f} GiB for {r['weights_gib']:.2f} GiB of weights "
                     f"(x{r['peak_ratio']:.3f}), {r['after_gib']:.2f} GiB after" for r in rows)
