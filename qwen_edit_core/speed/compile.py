"""Regional compile: each transformer block compiled on its own, with few graphs and an eager fallback.

What compiles, and when a block compiles again (each graph costs tens of seconds at real size, once per process:
BENCHMARKS.md, "Reference timings"):

- Sequence lengths are dynamic (`dynamic=True`): one graph serves every image size and text length, so prompts
  keep their exact length, compiled or not: a batch of one prompt (or of equal lengths) has no padding and no
  mask, and attention stays on the fused kernels (a padded prompt's key mask takes it off them).
- A new graph is compiled for what changes the graph itself: batch size 1 against larger ones (a size of 1
  is always specialised), a text or image padding mask present or not, gradients on or off (training against sampling),
  which LoRA adapters are active (and their ranks), dtype, device or autocast, and on Qwen-Image-2.1 the number of
  references (its blocks take the prompt's text and picture runs as a Python list, `segments`, whose length the graph is
  guarded on: diffusers 0.42.1 transformer_qwenimage21.py, `_qwenimage21_prefix_segments`). In training the first block
  has a graph of its own: its inputs need no gradient (they come from the frozen input projections), the later blocks'
  do. These are few per run; every new graph is logged and counted (`compile_stats`), and at most `RECOMPILE_LIMIT` are
  kept.
- LoRA strengths are not compiled in: `adapters.lora.use_adapters` keeps peft's per-adapter scales as 0-d
  tensors (graph inputs, not constants), so changing a strength reuses the graph.

Fallback: if compiling a block raises (a graph break under `fullgraph`, dynamo's recompile limit, a missing
compiler or Triton, a backend error) and the same call succeeds eagerly, every block of that transformer
runs eagerly from then on and one warning names the reason; the run goes on. If the eager call fails too,
the error is the input's, and it is raised.

Under FSDP2 (`hooks_outside=True`) only the block's own forward is compiled, set as the block's `forward`:
FSDP2 puts its all-gather and reshard in forward hooks on each block, and marks them `torch._dynamo.disable`
(torch/distributed/fsdp/_fully_shard/_fsdp_common.py `_dynamo_disable`), so a compiled call with the hooks
inside fails under `fullgraph` (measured: every block fell back to eager). With the forward alone compiled,
the hooks run eagerly around the same graph.

diffusers' `compile_repeated_blocks` (regional compile by class name) is not used: it compiles every block
of the class, so it cannot leave offloaded blocks eager (their forward hooks move weights in and out of the
device on each call, which a compiled graph must not capture), and it offers no place for the eager
fallback or the graph count. Otherwise it is the same per-block compile.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Sequence

import torch

log = logging.getLogger(__name__)

#: graphs the compiled blocks may hold together, on a torch whose torch.compile takes `recompile_limit` (2.14);
#: otherwise dynamo's global recompile_limit (8) applies
RECOMPILE_LIMIT = 32


@dataclass
class CompileStats:
    """One transformer's compiled blocks: `graphs` compiled so far (each new input signature of a block is
    one), and why it went back to eager (`fallback`, None while compiled)."""

    blocks: int = 0
    graphs: int = 0
    fallback: str | None = None
    _modules: list = field(default_factory=list, repr=False)

    @property
    def active(self) -> bool:
        """Whether the blocks are compiled now (not fallen back; a deep copy of the transformer drops compiled
        calls, as `nn.Module` pickling does)."""
        return self.fallback is None and any(m._compiled_call_impl is not None or "forward" in vars(m)
                                             for m in self._modules)

    def summary(self) -> str:
        if self.fallback is not None:
            return f"compile: fell back to eager ({self.fallback}) after {self.graphs} block graph(s)"
        return f"compile: {self.blocks} block(s) compiled, {self.graphs} block graph(s) compiled so far"


def _compile_parameters() -> set[str]:
    import inspect
    return set(inspect.signature(torch.compile).parameters)


def _call_block(block, *args, **kwargs):
    """What is compiled: one call of a block (module hooks and forward); the block is an input, so one graph
    serves every block of the same structure."""
    return block._call_impl(*args, **kwargs)


def _forward_of(block):
    """What is compiled when other wrappers' hooks must stay outside: the block's own forward, the class's plain
    function (called with the block as its first argument). Taken outside the compiled code: diffusers marks its
    block classes `allow_in_graph`, so dynamo cannot trace `type(block).forward` from inside a graph ("Dynamo does
    not know how to trace method `forward` of class `type`"; FSDP2's wrapper subclass hid this)."""
    return type(block).forward


def _graph_count() -> int:
    from torch._dynamo.utils import counters
    return counters["stats"]["unique_graphs"]


def _own(value):
    """A view as a tensor of its own. The first block's inputs are views (the input projections reshape a 2-D
    matmul), the later blocks' are not; a graph compiled with dynamic shapes for a view guards on the view's
    base, so without this copy (one activation per forward) the second block would compile a second graph."""
    return value.clone() if isinstance(value, torch.Tensor) and value._base is not None else value


def _describe(args, kwargs) -> str:
    """The shapes of a block call's tensor arguments (what a new graph was compiled for)."""
    shapes = ["x".join(map(str, t.shape)) for t in (*args, *kwargs.values()) if isinstance(t, torch.Tensor)]
    return f"inputs {', '.join(shapes)}; gradients {'on' if torch.is_grad_enabled() else 'off'}"


class _CompiledBlock:
    """A block's compiled call (set as the block's `_compiled_call_impl`, as `nn.Module.compile` does): counts
    the graphs it compiles and falls back to eager when compiling fails (see the module doc)."""

    def __init__(self, compiled, block, stats: CompileStats, eager):
        self.compiled, self.block, self.stats, self.eager = compiled, block, stats, eager

    def __call__(self, *args, **kwargs):
        before = _graph_count()
        args, kwargs = tuple(_own(a) for a in args), {k: _own(v) for k, v in kwargs.items()}
        try:
            out = self.compiled(self.block, *args, **kwargs)
        except _compile_errors() as err:  # not others: checkpointing stops its recompute with an exception
            out = self.eager(self.block, *args, **kwargs)  # raises the input's own error if eager fails too
            _fall_back(self.stats, err)
            return out
        new = _graph_count() - before
        if new > 0:
            self.stats.graphs += new
            log.info("compiled transformer block graph %d (%s)", self.stats.graphs, _describe(args, kwargs))
        return out


def _compile_errors() -> tuple[type, ...]:
    """What dynamo and inductor raise when a block cannot be compiled: dynamo's errors (a backend or compiler
    error arrives as BackendCompilerFailed, inductor's InductorError is one) and, under fullgraph, the
    recompile limit's own kind."""
    from torch._dynamo import exc
    return exc.TorchDynamoException, exc.FailOnRecompileLimitHit


def _reason(err: Exception) -> str:
    """The error's type and message on one line, without torch's debugging hints."""
    if "RecompileLimit" in type(err).__name__:
        per_call = "recompile_limit" in _compile_parameters()
        limit = RECOMPILE_LIMIT if per_call else torch._dynamo.config.recompile_limit
        return f"{type(err).__name__}: the blocks needed more graphs than the recompile limit ({limit})"
    lines = []
    for line in str(err).splitlines():
        if line.strip().startswith(("Set TORCH", "For more information", "You can suppress")):
            break
        lines.append(line.strip())
    return f"{type(err).__name__}: {' '.join(line for line in lines if line)}"[:300]


def _fall_back(stats: CompileStats, err: Exception) -> None:
    """Every compiled block of the transformer runs eagerly from now on; one warning says why."""
    stats.fallback = _reason(err)
    for block in stats._modules:
        block._compiled_call_impl = None
        vars(block).pop("forward", None)
    log.warning("torch.compile failed on a transformer block (%s); the transformer's %d compiled blocks run "
                "eagerly from now on (same numbers, slower)", stats.fallback, stats.blocks)


#: torch.compile modes that record CUDA graphs. A block's graph is shared by the 60 blocks of a forward, so its
#: CUDA-graph replays follow each other inside one forward and each overwrites the previous block's outputs while
#: the next block still reads them ("accessing tensor output of CUDAGraphs that has been overwritten by a
#: subsequent run", the real-size sampler bench on an H100, BENCHMARKS.md); a CUDA graph has to cover a whole
#: forward instead.
CUDA_GRAPH_MODES = ("reduce-overhead", "max-autotune")


def compile_blocks(transformer, skip: Sequence[int] = (), mode: str | None = None,
                   backend="inductor", hooks_outside: bool = False, forward_only: Sequence[int] = ()) -> int:
    """Compile each transformer block (not the whole model: 60 identical blocks share one graph per input
    signature, ~30 s each), `fullgraph` with dynamic sequence lengths, falling back to eager on failure.

    `skip`: block indices left eager. `mode`: torch.compile's mode, except the CUDA-graph ones (refused, see
    `CUDA_GRAPH_MODES`). `backend`: torch.compile's backend.
    `hooks_outside`: compile only each block's forward, so module hooks added later (FSDP2's) run eagerly around
    it; `forward_only`: block indices compiled that way whatever `hooks_outside` says (offloaded blocks: the
    offloader's hooks copy weights in and out on a side stream, which is no graph, around a compiled forward that
    takes whatever weights the block holds). Returns the count compiled; `compile_stats(transformer)` counts the
    graphs.
    """
    if mode in CUDA_GRAPH_MODES:
        raise ValueError(f"compile mode {mode!r} is not supported for block compilation: one block graph is "
                         "replayed by every block of a forward, and each CUDA-graph replay overwrites the outputs "
                         "of the one before (measured on an H100 at real size); use the default mode")
    skipped, outside = set(skip), set(forward_only)
    limit = {"recompile_limit": RECOMPILE_LIMIT} if "recompile_limit" in _compile_parameters() else {}
    compiled = {}  # one compiled function per eager one: every block of a class shares its graphs
    stats = CompileStats()
    for i, block in enumerate(transformer.transformer_blocks):
        if i in skipped:
            continue
        forward_alone = hooks_outside or i in outside
        eager = _forward_of(block) if forward_alone else _call_block
        if eager not in compiled:
            compiled[eager] = torch.compile(eager, fullgraph=True, dynamic=True, mode=mode, backend=backend, **limit)
        call = _CompiledBlock(compiled[eager], block, stats, eager)
        if forward_alone:
            block.forward = call  # an instance attribute: nn.Module's call runs the hooks
        else:
            block._compiled_call_impl = call
        stats._modules.append(block)
    stats.blocks = len(stats._modules)
    transformer._qwen_edit_compile = stats
    return stats.blocks


def compile_stats(transformer) -> CompileStats | None:
    """The transformer's compile statistics, or None when its blocks were never compiled."""
    return getattr(transformer, "_qwen_edit_compile", None)


def scales_as_inputs(model) -> int:
    """Turn peft's LoRA scales (`layer.scaling[adapter]`: alpha / r * strength, a Python float) into 0-d
    float32 tensors; returns how many changed. A compiled block bakes a float in as a constant and guards on
    its value, so each new strength would compile the block again (and reach dynamo's recompile limit after
    8); a tensor is a graph input, so one graph serves every strength. Same numbers in eager (a 0-d tensor
    multiplies like the scalar). The tensors stay on the CPU: a CPU scalar multiplies tensors on any device,
    so moving or replicating the transformer needs nothing. LoHa layers keep their floats (peft builds a tensor from the
    scale on each call)."""
    from peft.tuners.lokr import LoKrLayer
    from peft.tuners.lora import LoraLayer
    changed = 0
    with torch.inference_mode(False):  # an inference tensor could not be saved for a training backward
        for module in model.modules():
            # LoRA (and DoRA) and LoKr multiply by the scale; LoHa rebuilds a tensor from it on every call
            if not isinstance(module, (LoraLayer, LoKrLayer)):
                continue
            scaling = module.scaling
            for name, value in scaling.items():
                if isinstance(value, (int, float)):
                    scaling[name] = torch.tensor(float(value), dtype=torch.float32)
                    changed += 1
    return changed
