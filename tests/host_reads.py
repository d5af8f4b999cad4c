"""A TorchFunctionMode that counts host reads of tensor values (each one a device sync on a GPU), and a helper
that counts them over a whole training run, step by step."""

from __future__ import annotations

import functools
import threading
import weakref

import torch
from torch.overrides import TorchFunctionMode

#: every way a value reaches the host: scalars, lists, numpy (`np.asarray` calls `__array__`), formatting and printing
READS = {torch.Tensor.item, torch.Tensor.__bool__, torch.Tensor.tolist, torch.Tensor.cpu, torch.Tensor.numpy,
         torch.Tensor.__float__, torch.Tensor.__int__, torch.Tensor.__index__, torch.Tensor.__complex__,
         torch.Tensor.__array__, torch.Tensor.__format__, torch.Tensor.__repr__}
#: copies that name the host as their target (`.to("cpu")`, `.copy_` into a pinned buffer): reads too. A move to
#: the run's device (`.to(device)`) is no read on a GPU, so a copy counts only where the code names the host.
COPIES = {torch.Tensor.to, torch.Tensor.copy_}


#: random draws that take a generator: with a CPU generator, what they return is on the host on a GPU too
DRAWS = {torch.rand, torch.randn, torch.randint, torch.randperm, torch.normal, torch.Tensor.normal_,
         torch.Tensor.uniform_, torch.multinomial, torch.bernoulli}


def _names_host(func, args, kwargs) -> bool:
    if func is torch.Tensor.copy_:
        return args[0].is_pinned()
    return "cpu" in args[1:] or kwargs.get("device") == "cpu"


def _tensors(value) -> list:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors(v)]
    return []


class HostReads(TorchFunctionMode):
    """Counts reads while `counting` is true; `where` keeps a short trace of each read for failure messages and
    `at` the value of `tag` when it happened. `host_side(tensor)` marks tensors that live on the host on a GPU
    too (reading them syncs nothing)."""

    def __init__(self, host_side=None):
        super().__init__()
        self.host_side = host_side or (lambda tensor: False)
        self.counting = True
        self.count = 0
        self.where: list[str] = []
        self.tag = None
        self.at: list = []
        #: tensors drawn from CPU generators and what was computed from them alone: host tensors on a GPU too
        self.drawn_on_host: dict[int, weakref.ref] = {}

    def _drawn(self, tensor) -> bool:
        ref = self.drawn_on_host.get(id(tensor))
        return ref is not None and ref() is tensor

    def _on_host(self, tensor) -> bool:
        return self._drawn(tensor) or self.host_side(tensor)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        read = func in READS or (func in COPIES and _names_host(func, args, kwargs))
        if self.counting and read and not self._on_host(args[0]):
            import traceback
            self.count += 1
            frames = [f for f in traceback.extract_stack()[:-1] if "torch/" not in f.filename][-2:]
            self.where.append(f"{getattr(func, '__name__', func)} at " + " <- ".join(
                f"{f.filename.rsplit('/', 1)[-1]}:{f.lineno}" for f in reversed(frames)))
            self.at.append(self.tag)
        out = func(*args, **kwargs)
        inputs = _tensors(list(args)) + _tensors(list(kwargs.values()))
        generator = kwargs.get("generator")
        host = (func in DRAWS and generator is not None and generator.device.type == "cpu") or (
            bool(inputs) and all(self._drawn(t) for t in inputs))
        if host:
            for t in _tensors(out):
                self.drawn_on_host[id(t)] = weakref.ref(t)
        return out


def _tagged(mode: HostReads, tag, fn, count: bool = True):
    """`fn` run with reads tagged `tag` (a callable of fn's arguments, or a constant); `count=False`: not counted
    (host-side data preparation, on the host on a GPU too)."""
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        before = mode.counting, mode.tag
        mode.counting = count and before[0]
        mode.tag = tag(*args, **kwargs) if callable(tag) else tag
        try:
            return fn(*args, **kwargs)
        finally:
            mode.counting, mode.tag = before
    return wrapper


def count_training_reads(config, monkeypatch) -> dict:
    """Train `config` once under a HostReads mode that counts every read of the whole run; returns the run's
    result and the reads by where they happened: `setup` (before the first step), `checkpoint` (writing one,
    and the final files), and `step N` (everything else during optimizer step N: micro-steps, optimizer, logging).
    Host-side data preparation (cache reads, collate's dropout draws from CPU generators) is not counted."""
    from qwen_edit_core import QwenImageEditTrainer
    from qwen_edit_core.train import loop

    mode = HostReads()
    mode.counting = False
    steps = {"n": 0}
    real_setup, real_micro = loop.setup, loop.micro_step

    def micro_step(run, micro):
        steps["n"] = run.step + 1
        return _tagged(mode, f"step {run.step + 1}", real_micro)(run, micro)

    monkeypatch.setattr(loop, "setup", _tagged(mode, "setup", real_setup))
    monkeypatch.setattr(loop, "micro_step", micro_step)
    for name in ("optimizer_step", "after_step"):
        monkeypatch.setattr(loop, name, _tagged(mode, lambda run, *a, **k: f"step {steps['n']}", getattr(loop, name)))
    for name in ("save_checkpoint", "finish"):
        monkeypatch.setattr(loop, name, _tagged(mode, "checkpoint", getattr(loop, name)))
    monkeypatch.setattr(loop, "collate", _tagged(mode, None, loop.collate, count=False))
    real_train = loop.train

    def train(config, transformer, load_item, *args, **kwargs):
        mode.counting, mode.tag = True, "loop"
        uncounted, loop_thread = _tagged(mode, None, load_item, count=False), threading.current_thread()

        def load(i):  # a read-ahead thread has no mode (a thread-local stack): it must not switch the loop's
            return uncounted(i) if threading.current_thread() is loop_thread else load_item(i)
        try:
            return real_train(config, transformer, load, *args, **kwargs)
        finally:
            mode.counting = False

    monkeypatch.setattr(loop, "train", train)
    with mode:
        result = QwenImageEditTrainer(config).fit()
    reads: dict = {}
    for tag, where in zip(mode.at, mode.where):
        reads.setdefault(tag, []).append(where)
    return {"result": result, "reads": reads}
