"""Speed and memory levers for the transformer: fp8 base weights, selective checkpointing, regional compile,
block offloading, and the planner that picks them for a memory budget.

Each lever is a small function over a diffusers `QwenImageTransformer2DModel` (with or without peft LoRA
layers) that changes only this model instance, through public APIs: module replacement, diffusers'
`enable_gradient_checkpointing(gradient_checkpointing_func=...)`, `nn.Module.compile`, forward hooks.

Why these (from FACTS.md §5's H100 measurements at 1024^2 Edit; our own real-size numbers are pending a GPU,
BENCHMARKS.md): the frozen base's linear layers hold ~65% of the FLOPs and fp8 matmuls ran ~1.6x faster
than bf16 at their shapes; recomputing every block costs a full extra
forward per step when memory would hold many blocks' activations; the blocks' elementwise work (modulation,
RMSNorm, RoPE, GELU, fp8 quantization) is launch- and bandwidth-bound until compiled into few kernels.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

log = logging.getLogger(__name__)

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # largest finite e4m3fn value


# --- fp8 base weights --------------------------------------------------------------------------------------

def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """e4m3 values and fp32 scales (rows, 1) so that x ~= values * scales, one scale per row."""
    scale = x.abs().amax(dim=-1, keepdim=True).float().clamp(min=1e-12) / FP8_MAX
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


def _fp8_out_dtype(t: torch.Tensor) -> torch.dtype:
    """The fp8 kernel's output dtype: the input's half-precision dtype; bf16 for fp32 inputs on CUDA (its fp8
    kernel does not write fp32 there; the CPU reference kernel does)."""
    return t.dtype if t.dtype in (torch.bfloat16, torch.float16) or not t.is_cuda else torch.bfloat16


def _fp8_shapes_ok(rows: int, k: int, n: int) -> bool:
    """The fp8 kernel wants 16-aligned dims and enough rows to pay for quantizing them."""
    return rows >= 16 and k % 16 == 0 and n % 16 == 0


class _Fp8Matmul(torch.autograd.Function):
    """y = x @ W^T with W in e4m3 (per-output-channel scales) and x quantized per token on the fly.

    Backward returns only the input's gradient (the base is frozen). By default it is computed in x's dtype
    against the dequantized weight (gradients keep bf16 precision; no fp8 copy of W^T is stored). With
    `fp8_grad` it runs as an fp8 matmul too: dx = (g * s) @ W8, the output-channel scales s folded into the
    gradient before it is quantized per row (the torchao "rowwise" recipe's e4m3 gradients), against a
    transient column-major copy of W8 (1 byte per weight, freed after the call).
    """

    @staticmethod
    def forward(ctx, x, weight, scale, fp8_grad: bool):
        rows = x.reshape(-1, x.shape[-1])
        out_dtype = _fp8_out_dtype(x)
        if _fp8_shapes_ok(rows.shape[0], rows.shape[1], weight.shape[0]):
            x8, x_scale = quantize_rows(rows)
            y = torch._scaled_mm(x8, weight.t(), scale_a=x_scale, scale_b=scale.t().contiguous(),
                                 out_dtype=out_dtype)
        else:  # too small or oddly shaped for the fp8 kernel (e.g. the timestep modulation's one row)
            y = F.linear(rows.to(out_dtype), (weight.to(out_dtype) * scale.to(out_dtype)))
        ctx.save_for_backward(weight, scale)
        ctx.fp8_grad = fp8_grad
        return y.to(x.dtype).reshape(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, grad):
        weight, scale = ctx.saved_tensors
        g = grad.reshape(-1, grad.shape[-1])
        if ctx.fp8_grad and _fp8_shapes_ok(g.shape[0], weight.shape[0], weight.shape[1]):
            g8, g_scale = quantize_rows(g.float() * scale.t())
            ones = torch.ones(1, weight.shape[1], device=g.device, dtype=torch.float32)
            grad_x = torch._scaled_mm(g8, weight.t().contiguous().t(), scale_a=g_scale, scale_b=ones,
                                      out_dtype=_fp8_out_dtype(g)).to(g.dtype)
        else:
            grad_x = (g * scale.t().to(g.dtype)) @ weight.to(g.dtype)
        return grad_x.reshape(*grad.shape[:-1], weight.shape[1]), None, None, None


class Fp8Linear(nn.Module):
    """A frozen linear layer kept in e4m3 with one fp32 scale per output channel (half the bytes of bf16).

    Its tensors are named `weight_fp8` and `weight_scale` (not `weight`), so peft layers wrapping it do not
    mistake the fp8 dtype for the compute dtype of their adapters. The scale is a frozen Parameter, not a
    buffer: peft places a new adapter on the device of its base layer's first parameter
    (peft/tuners/lora/model.py `_replace_module`), so LoRAs can be added after quantization
    (`lora.inject_lora`, `lora.load_lora_into`).
    """

    #: compute the input gradient with an fp8 matmul too (`quantize_fp8(..., fp8_backward=True)`)
    fp8_backward: bool = False

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        weight, scale = quantize_rows(linear.weight.detach())
        self.register_buffer("weight_fp8", weight)
        self.weight_scale = nn.Parameter(scale, requires_grad=False)
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach().clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = _Fp8Matmul.apply(x, self.weight_fp8, self.weight_scale, self.fp8_backward)
        return y if self.bias is None else y + self.bias.to(y.dtype)

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        return (self.weight_fp8.float() * self.weight_scale).to(dtype)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, e4m3 per-channel"


def quantize_fp8(transformer: nn.Module, fp8_backward: bool = False) -> int:
    """Replace every frozen `nn.Linear` inside the transformer blocks (peft's base layers included) by an
    `Fp8Linear`; adapters stay in their own dtype. Returns the count. `fp8_backward` sets every fp8 layer's
    input-gradient matmul to fp8 too (layers already in fp8 included).

    The embedders and the output projection stay as they are: they are a few MB and the first and last
    layers are the most precision-sensitive.
    """
    count = 0
    for block in transformer.transformer_blocks:
        for parent in list(block.modules()):
            for name, child in list(parent.named_children()):
                if type(child) is nn.Linear and not child.weight.requires_grad:
                    setattr(parent, name, Fp8Linear(child))
                    count += 1
    if count == 0 and not has_fp8(transformer):
        raise ValueError("quantize_fp8: no frozen nn.Linear found in transformer.transformer_blocks")
    _set_fp8_backward(transformer, fp8_backward)
    return count


def _set_fp8_backward(transformer: nn.Module, enabled: bool) -> None:
    for module in transformer.modules():
        if isinstance(module, Fp8Linear):
            module.fp8_backward = enabled


def has_fp8(module: nn.Module) -> bool:
    return any(isinstance(m, Fp8Linear) for m in module.modules())


def fp8_matmul_supported(device: torch.device) -> bool:
    """fp8 tensor cores: CUDA compute capability 8.9 (Ada) or 9.0+ (Hopper). The CPU runs the same numerics
    through PyTorch's reference kernel (slow; for tests)."""
    device = torch.device(device)
    if device.type != "cuda":
        return device.type == "cpu"
    return torch.cuda.get_device_capability(device) >= (8, 9)


# --- selective gradient checkpointing ------------------------------------------------------------------------

def checkpointed_indices(n_blocks: int, n_checkpointed: int) -> list[int]:
    """Which blocks recompute their activations: the first `n_checkpointed` (their saved activations would
    live longest), or all when n_checkpointed < 0."""
    if n_checkpointed < 0 or n_checkpointed >= n_blocks:
        return list(range(n_blocks))
    return list(range(n_checkpointed))


def checkpoint_blocks(transformer, n_checkpointed: int) -> list[int]:
    """Recompute only `n_checkpointed` blocks (-1: all; 0: none) in the backward pass.

    Uses diffusers' own hook (`enable_gradient_checkpointing(gradient_checkpointing_func=...)`): the
    function is called for every block and runs it either under `torch.utils.checkpoint` or directly.
    """
    blocks = list(transformer.transformer_blocks)
    chosen = {id(blocks[i]) for i in checkpointed_indices(len(blocks), n_checkpointed)}

    def run_block(block, *args):
        if id(block) in chosen:
            return checkpoint(block.__call__, *args, use_reentrant=False)
        return block(*args)

    transformer.enable_gradient_checkpointing(gradient_checkpointing_func=run_block)
    return sorted(i for i, b in enumerate(blocks) if id(b) in chosen)


# --- regional compile -----------------------------------------------------------------------------------------

def compile_blocks(transformer, skip: Sequence[int] = (), mode: str | None = None) -> int:
    """Compile each transformer block (not the whole model: 60 identical blocks compile once, ~30 s).

    `skip`: block indices left eager (offloaded blocks, whose forward hooks move weights). Returns the count.
    """
    skipped = set(skip)
    count = 0
    for i, block in enumerate(transformer.transformer_blocks):
        if i not in skipped:
            block.compile(fullgraph=True, dynamic=False, mode=mode)
            count += 1
    return count


# --- attention kernel -----------------------------------------------------------------------------------------

#: `train.attention` / `predict.attention` values: which fused SDPA kernel runs first. "auto" is torch's own
#: order (flash, then memory-efficient, then cuDNN on most builds); "cudnn" puts cuDNN's kernel first, which
#: on Hopper is the fastest for Qwen's 24 heads x 128 dims (FACTS.md §5: attention is ~1/3 of a 1 MP step).
ATTENTION_KERNELS = ("auto", "cudnn", "flash", "efficient", "math")


def check_attention_kernel(name: str) -> None:
    if name not in ATTENTION_KERNELS:
        raise ValueError(f"attention kernel {name!r} is not accepted; accepted: {', '.join(ATTENTION_KERNELS)}")


def attention_kernel(name: str):
    """A context manager under which `F.scaled_dot_product_attention` prefers kernel `name`, falling back to
    the others when it cannot run the call (CPU, a mask the kernel rejects). torch's SDPA backend flags are
    set for the duration of the block and restored on exit (`torch.nn.attention.sdpa_kernel`).

    Wrap the forward and the backward pass of a step: a checkpointed block's recompute runs in the backward.
    """
    import contextlib

    from torch.nn.attention import SDPBackend, sdpa_kernel
    check_attention_kernel(name)
    if name == "auto":
        return contextlib.nullcontext()
    order = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION,
             "efficient": SDPBackend.EFFICIENT_ATTENTION, "math": SDPBackend.MATH}
    first = order.pop(name)
    return sdpa_kernel([first, *order.values()], set_priority=True)


# --- block offloading -----------------------------------------------------------------------------------------

class BlockOffloader:
    """Keeps the frozen tensors of some blocks in pinned CPU memory and copies each block to the device just
    before it runs, prefetching the next offloaded block on a side stream so copies overlap compute.

    Works with forward hooks, so it serves training (forward, and the recompute of checkpointed blocks in the
    backward pass, which runs blocks in reverse order) and no-grad sampling alike. Offloaded blocks must be
    checkpointed in training: a block's weights then live on the device only while it runs or is recomputed.
    """

    def __init__(self, blocks: Sequence[nn.Module], indices: Sequence[int], device: torch.device):
        self.device = torch.device(device)
        self.indices = sorted(set(indices))
        self.cuda = self.device.type == "cuda"
        self.stream = torch.cuda.Stream(self.device) if self.cuda else None
        self.slots: dict[int, list[tuple[nn.Module, str, bool, torch.Tensor]]] = {}
        self.ready: dict[int, tuple[list[torch.Tensor], object]] = {}
        self.last, self.forward_dir = None, True
        self.handles = []
        for i in self.indices:
            self.slots[i] = self._take(blocks[i])
            self.handles.append(blocks[i].register_forward_pre_hook(self._make_pre(i)))
            self.handles.append(blocks[i].register_forward_hook(self._make_post(i)))

    def _take(self, block: nn.Module):
        slots = []
        with torch.no_grad():
            for module in block.modules():
                for is_param, table in ((True, module._parameters), (False, module._buffers)):
                    for name, tensor in table.items():
                        if tensor is None or (is_param and tensor.requires_grad):
                            continue
                        host = tensor.detach().to("cpu", copy=True)
                        slots.append((module, name, is_param, host.pin_memory() if self.cuda else host))
                        self._set(module, name, is_param, torch.empty(0, dtype=tensor.dtype, device=self.device))
        return slots

    @staticmethod
    def _set(module, name, is_param, value):
        if is_param:
            module._parameters[name].data = value
        else:
            module._buffers[name] = value

    def _fetch(self, i: int) -> None:
        if i in self.ready or i not in self.slots:
            return
        while len(self.ready) >= 2:  # a wrong guess never holds more than two blocks
            self.ready.pop(next(iter(self.ready)))
        if self.cuda:
            with torch.cuda.stream(self.stream):
                tensors = [host.to(self.device, non_blocking=True) for _, _, _, host in self.slots[i]]
                event = torch.cuda.Event()
                event.record(self.stream)
        else:
            tensors, event = [host.to(self.device, copy=True) for _, _, _, host in self.slots[i]], None
        self.ready[i] = (tensors, event)

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
            self._fetch(i)
            tensors, event = self.ready.pop(i)
            if self.cuda:
                current = torch.cuda.current_stream(self.device)
                current.wait_event(event)
                for t in tensors:
                    t.record_stream(current)  # freed copies must not be reused before compute is done
            for (owner, name, is_param, _), t in zip(self.slots[i], tensors):
                self._set(owner, name, is_param, t)
            nxt = self._next(i)
            if nxt is not None and nxt != i:
                self._fetch(nxt)
        return pre

    def _make_post(self, i: int):
        def post(module, args, output):
            # Drop the references: autograd keeps what the backward pass still needs.
            for owner, name, is_param, host in self.slots[i]:
                self._set(owner, name, is_param, torch.empty(0, dtype=host.dtype, device=self.device))
            return output
        return post

    def remove(self) -> None:
        """Put every offloaded tensor back on the device and remove the hooks."""
        for handle in self.handles:
            handle.remove()
        for i, slots in self.slots.items():
            for owner, name, is_param, host in slots:
                self._set(owner, name, is_param, host.to(self.device))
        self.slots, self.ready = {}, {}


def offload_indices(n_blocks: int, n_offloaded: int) -> list[int]:
    """Offloaded blocks spread evenly, so each copy overlaps the compute of the resident blocks around it."""
    n = max(0, min(n_offloaded, n_blocks))
    return sorted({int((k + 0.5) * n_blocks / n) for k in range(n)}) if n else []


# --- memory planning ------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class MemoryEstimate:
    """What a training step holds on the device, in bytes, for one configuration."""

    weights: int
    activations: int
    fixed: int

    @property
    def total(self) -> int:
        return self.weights + self.activations + self.fixed


@dataclass(frozen=True)
class SpeedPlan:
    """Settings chosen by `plan_for_budget`: fp8 base, how many blocks recompute, how many are offloaded."""

    fp8: bool
    checkpoint_blocks: int
    offload_blocks: int
    estimate: MemoryEstimate


def estimate_memory(*, n_blocks: int, block_params: int, other_params: int, tokens: int, dim: int, fp8: bool,
                    n_checkpointed: int, n_offloaded: int, trainable_params: int,
                    activation_factor: float = 17.0) -> MemoryEstimate:
    """A step's device memory: resident weights, saved activations and a fixed working set.

    A non-checkpointed block saves about `activation_factor` x tokens x dim bf16 values: 17.1 measured by
    summing the tensors autograd saves (`torch.autograd.graph.saved_tensors_hooks`) in one real-width block
    under bf16 autocast with a LoRA on the image attention, at 512 and 1,024 tokens, bf16 or fp8 base alike
    (fused attention saves its output and log-sum-exp, not the scores). A checkpointed block saves its two
    input streams; the block being recomputed needs one block's activations plus its gradients; two
    offloaded blocks are in flight at a time. The fixed 1 GiB (CUDA context, allocator slack) is a guess
    until the real-size bench runs on a GPU.
    """
    bytes_per_weight = 1 if fp8 else 2
    resident_blocks = n_blocks - n_offloaded + (min(2, n_offloaded))
    weights = (resident_blocks * block_params + other_params) * bytes_per_weight
    full = int(activation_factor * tokens * dim * 2)
    boundary = tokens * dim * 2
    checkpointed = n_blocks if n_checkpointed < 0 else min(n_checkpointed, n_blocks)
    activations = checkpointed * boundary + (n_blocks - checkpointed) * full
    fixed = 2 * full + trainable_params * 16 + (1 << 30)  # working block, LoRA+grads+AdamW fp32, CUDA context
    return MemoryEstimate(weights=weights, activations=activations, fixed=fixed)


def plan_for_budget(budget_gb: float, prefer_fp8: bool = False, **model) -> SpeedPlan:
    """The fastest settings whose estimate fits `budget_gb`, trying in order of cost: the fewest checkpointed
    blocks with a bf16 base (skipped when `prefer_fp8`), then with an fp8 base, then fp8 with every block
    checkpointed and the fewest offloaded blocks. An fp8 base is faster but changes the numbers slightly, so
    it is taken only when asked for (`train.fp8_base`) or when bf16 does not fit.

    `model`: the keyword arguments of `estimate_memory` other than fp8, n_checkpointed and n_offloaded.
    """
    budget = budget_gb * 2**30
    n = model["n_blocks"]
    for fp8 in ((True,) if prefer_fp8 else (False, True)):
        for n_ckpt in range(0, n + 1):
            est = estimate_memory(fp8=fp8, n_checkpointed=n_ckpt, n_offloaded=0, **model)
            if est.total <= budget:
                return SpeedPlan(fp8, n_ckpt, 0, est)
    for n_off in range(1, n + 1):
        est = estimate_memory(fp8=True, n_checkpointed=-1, n_offloaded=n_off, **model)
        if est.total <= budget:
            return SpeedPlan(True, -1, n_off, est)
    est = estimate_memory(fp8=True, n_checkpointed=-1, n_offloaded=n, **model)
    raise ValueError(f"train.memory_budget_gb {budget_gb} is too small: even an fp8 base with every block "
                     f"checkpointed and offloaded needs about {est.total / 2**30:.1f} GiB; raise the budget or "
                     "train at a smaller data.vae_area")


def model_sizes(transformer) -> dict:
    """Parameter counts `estimate_memory` needs, read off the model."""
    blocks = transformer.transformer_blocks
    frozen = lambda m: sum(p.numel() for p in m.parameters() if not p.requires_grad) + sum(  # noqa: E731
        b.numel() for b in m.buffers())
    block_params = max(frozen(b) for b in blocks)
    total = frozen(transformer)
    trainable = sum(p.numel() for p in transformer.parameters() if p.requires_grad)
    return {"n_blocks": len(blocks), "block_params": block_params,
            "other_params": total - sum(frozen(b) for b in blocks), "trainable_params": trainable,
            "dim": transformer.config.num_attention_heads * transformer.config.attention_head_dim}


# --- entry points the trainer and the sampler call ------------------------------------------------------------

@dataclass(frozen=True)
class Levers:
    """The levers in effect for a run (logged, and returned to benchmarks)."""

    fp8: bool
    checkpointed: tuple[int, ...]
    offloaded: tuple[int, ...]
    compiled: int


def configure_training(transformer, train, device: torch.device, tokens: int) -> Levers:
    """Apply `train.{memory_budget_gb, fp8_base, fp8_backward, gradient_checkpointing, checkpoint_blocks,
    offload_blocks, compile}` to a transformer whose LoRA is already injected. `tokens`: the longest sequence
    of a step."""
    device = torch.device(device)
    fp8, ckpt, n_off = train.fp8_base, (train.checkpoint_blocks if train.gradient_checkpointing else None), \
        train.offload_blocks
    if train.memory_budget_gb > 0:
        plan = plan_for_budget(train.memory_budget_gb, prefer_fp8=train.fp8_base, tokens=tokens,
                               **model_sizes(transformer))
        fp8, ckpt, n_off = plan.fp8, plan.checkpoint_blocks, plan.offload_blocks
        log.info("memory_budget_gb %.1f: fp8 base %s, checkpointed blocks %s, offloaded blocks %d (estimate "
                 "%.1f GiB)", train.memory_budget_gb, fp8, "all" if ckpt < 0 else ckpt, n_off,
                 plan.estimate.total / 2**30)
    return _apply(transformer, device, fp8=fp8, n_checkpointed=ckpt, n_offloaded=n_off, compile=train.compile,
                  fp8_backward=train.fp8_backward)


def configure_inference(transformer, device: torch.device, *, fp8: bool, compile: bool,
                        compile_mode: str | None = None) -> Levers:
    """fp8 base weights and compiled blocks for sampling, in place (LoRAs stay in their own dtype and can
    still be loaded, switched and scaled afterwards). `compile_mode="reduce-overhead"` adds CUDA graphs.
    Idempotent: a transformer already in fp8 or compiled stays so."""
    already = getattr(transformer, "_qwen_edit_compiled", False)
    levers = _apply(transformer, torch.device(device), fp8=fp8, n_checkpointed=None, n_offloaded=0,
                    compile=compile and not already, compile_mode=compile_mode)
    transformer._qwen_edit_compiled = already or compile
    return levers


def _apply(transformer, device, *, fp8: bool, n_checkpointed: int | None, n_offloaded: int,
           compile: bool, compile_mode: str | None = None, fp8_backward: bool = False) -> Levers:
    n_blocks = len(transformer.transformer_blocks)
    if fp8 and not has_fp8(transformer) and not fp8_matmul_supported(device):
        raise ValueError(f"fp8 base weights need fp8 matmuls (CUDA compute capability >= 8.9); {device} has "
                         "none: turn fp8 off")
    if fp8:
        quantize_fp8(transformer, fp8_backward=fp8_backward)  # idempotent
    else:  # layers already in fp8 (a scaled-fp8 file kept in fp8) still take the backward mode
        _set_fp8_backward(transformer, fp8_backward)
    offloaded = offload_indices(n_blocks, n_offloaded)
    if offloaded and n_checkpointed is not None and checkpointed_indices(n_blocks, n_checkpointed) != list(
            range(n_blocks)):
        log.info("offloaded blocks are always checkpointed: checkpointing every block")
        n_checkpointed = -1
    if offloaded and n_checkpointed is None:
        raise ValueError("train.offload_blocks needs train.gradient_checkpointing: an offloaded block's weights "
                         "must not stay on the device until the backward pass")
    checkpointed = checkpoint_blocks(transformer, n_checkpointed) if n_checkpointed is not None else []
    previous = getattr(transformer, "_qwen_edit_offloader", None)
    if previous is not None:
        previous.remove()
        transformer._qwen_edit_offloader = None
    if offloaded:
        transformer._qwen_edit_offloader = BlockOffloader(transformer.transformer_blocks, offloaded, device)
    compiled = compile_blocks(transformer, skip=offloaded, mode=compile_mode) if compile else 0
    levers = Levers(fp8=has_fp8(transformer), checkpointed=tuple(checkpointed), offloaded=tuple(offloaded),
                    compiled=compiled)
    log.info("transformer levers: fp8 base %s, %d/%d blocks checkpointed, %d offloaded, %d compiled",
             levers.fp8, len(checkpointed), n_blocks, len(offloaded), compiled)
    return levers
