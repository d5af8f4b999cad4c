"""A TorchFunctionMode that counts host reads of tensor values (each one a device sync on a GPU)."""

from __future__ import annotations

import torch
from torch.overrides import TorchFunctionMode

READS = {torch.Tensor.item, torch.Tensor.__bool__, torch.Tensor.tolist, torch.Tensor.cpu, torch.Tensor.numpy,
         torch.Tensor.__float__, torch.Tensor.__int__, torch.Tensor.__index__}


class HostReads(TorchFunctionMode):
    """Counts reads while `counting` is true; `where` keeps a short trace of each read for failure messages.
    `host_side(tensor)` marks tensors that live on the host on a GPU too (reading them syncs nothing)."""

    def __init__(self, host_side=None):
        super().__init__()
        self.host_side = host_side or (lambda tensor: False)
        self.counting = True
        self.count = 0
        self.where: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if self.counting and func in READS and not self.host_side(args[0]):
            import traceback
            self.count += 1
            frames = [f for f in traceback.extract_stack()[:-1] if "torch/" not in f.filename][-2:]
            self.where.append(f"{getattr(func, '__name__', func)} at " + " <- ".join(
                f"{f.filename.rsplit('/', 1)[-1]}:{f.lineno}" for f in reversed(frames)))
        return func(*args, **(kwargs or {}))
