"""fp8 (e4m3) base linears: per-output-channel weight scales, per-token activation scales.

Why our own layer rather than torchao's float8 (torchao is not a dependency):
- torchao's float8 training (`torchao.float8.convert_to_float8_training`, `Float8Linear`) keeps the weight in
  high precision and casts weight and input to float8 inside every forward: it trains that weight faster
  but stores it in bf16. Our base is frozen, so `Fp8Linear` stores it in e4m3 once (half the memory of bf16:
  docs/MODEL.md, "The real model's sizes") and only the activations are quantized per call.
- torchao's inference path (`quantize_` with a float8 config) turns weights into tensor subclasses; peft's
  torchao LoRA layer (`peft/tuners/lora/torchao.py`, peft 0.21) can merge only into int8 subclasses it can
  re-quantize. `Fp8Linear` is a plain module peft wraps like a Linear (`_register_custom_module`), so LoRAs
  are injected, trained, stacked, merged and saved on top of it as on a bf16 base.
- ComfyUI's scaled-fp8 files hold e4m3 bytes with one scale per tensor; the transformer file loader
  (model/single_file.py) puts those bytes into `Fp8Linear` unchanged (the per-tensor scale becomes every
  row's scale), where a quantizer would dequantize and quantize again.
- Row-wise scales on both sides (per output channel for the weight, per token for the input) are what
  `torch._scaled_mm` takes directly; the input gradient can run in fp8 too (`fp8_grad`, the row-wise recipe).
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

from qwen_edit_core.speed import lending

log = logging.getLogger(__name__)

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # largest finite e4m3fn value

def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """e4m3 values and fp32 scales (rows, 1) so that x ~= values * scales, one scale per row."""
    scale = x.abs().amax(dim=-1, keepdim=True).float().clamp(min=1e-12) / FP8_MAX
    # one fp32 temporary, scaled and clamped in place: converting a bf16 weight holds 2.5x its bytes at most
    scaled = x.to(torch.float32, copy=True).div_(scale).clamp_(-FP8_MAX, FP8_MAX)
    return scaled.to(FP8), scale


#: The fp8 kernel's output dtype, whatever the activations' dtype: row-wise scaled `torch._scaled_mm` writes
#: bf16 on every torch/GPU combination (fp16 output is rejected there, fp32 on several); the result is cast.
KERNEL_OUT = torch.bfloat16
#: Output rows computed per chunk where the fp8 kernel cannot run (dims not multiples of 16): the weight is
#: dequantized a chunk at a time, never whole.
_CHUNK_ROWS = 256


def _fp8_shapes_ok(k: int, n: int) -> bool:
    """The fp8 kernel wants the inner and output dims 16-aligned (rows are padded to 16 when fewer)."""
    return k % 16 == 0 and n % 16 == 0


def _fp8_mm(rows: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """rows @ (weight * scale)^T in `KERNEL_OUT`, through the fp8 kernel: activations quantized per row; fewer
    than 16 rows (the timestep modulation's one row per sample) padded with zeros rather than dequantizing
    the weight (a third of a block's weights are modulation layers)."""
    n_rows = rows.shape[0]
    if n_rows < 16:
        rows = torch.cat([rows, rows.new_zeros(16 - n_rows, rows.shape[1])])
    x8, x_scale = quantize_rows(rows)
    # fast accumulation in the forward only (torchao's row-wise recipe: Float8LinearConfig "rowwise" keeps it for
    # the output, not the gradients); the benchmarks' fixed-batch loss guards the prediction
    y = torch._scaled_mm(x8, weight.t(), scale_a=x_scale, scale_b=scale.t().contiguous(), out_dtype=KERNEL_OUT,
                         use_fast_accum=True)
    return y[:n_rows]


def _chunked_mm(rows: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The same product in `dtype` without the fp8 kernel, dequantizing `_CHUNK_ROWS` weight rows at a time."""
    x = rows.to(dtype)
    return torch.cat([F.linear(x, weight[i: i + _CHUNK_ROWS].to(dtype)) * scale[i: i + _CHUNK_ROWS, 0].to(dtype)
                      for i in range(0, weight.shape[0], _CHUNK_ROWS)], dim=-1)


def output_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype an fp8 layer returns: autocast's dtype when autocast is on for x's device (as `nn.Linear`
    under autocast: activations stay bf16 even after an fp32 LayerNorm), else x's dtype."""
    kind = x.device.type
    return torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else x.dtype


class _Fp8Matmul(torch.autograd.Function):
    """y = x @ W^T with W in e4m3 (per-output-channel scales) and x quantized per token on the fly.

    Backward returns only the input's gradient (the base is frozen). By default it is computed in x's dtype
    against the dequantized weight (gradients keep bf16 precision; no fp8 copy of W^T is stored). With
    `fp8_grad` it runs as an fp8 matmul too: dx = (g * s) @ W8, the output-channel scales s folded into the
    gradient before it is quantized per row (the torchao "rowwise" recipe's e4m3 gradients), against a
    transient column-major copy of W8 (1 byte per weight, freed after the call).
    """

    @staticmethod
    def forward(ctx, x, weight, scale, fp8_grad: bool, out_dtype: torch.dtype):
        rows = x.reshape(-1, x.shape[-1])
        if _fp8_shapes_ok(rows.shape[1], weight.shape[0]):
            y = _fp8_mm(rows, weight, scale)
        else:  # dims the fp8 kernel does not take
            y = _chunked_mm(rows, weight, scale, out_dtype)
        ctx.save_for_backward(weight, scale)
        ctx.fp8_grad, ctx.x_dtype = fp8_grad, x.dtype
        return y.to(out_dtype).reshape(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, grad):
        weight, scale = ctx.saved_tensors
        g = grad.reshape(-1, grad.shape[-1])
        if ctx.fp8_grad and g.shape[0] >= 16 and _fp8_shapes_ok(weight.shape[0], weight.shape[1]):
            g8, g_scale = quantize_rows(g.float() * scale.t())
            ones = torch.ones(1, weight.shape[1], device=g.device, dtype=torch.float32)
            grad_x = torch._scaled_mm(g8, weight.t().contiguous().t(), scale_a=g_scale, scale_b=ones,
                                      out_dtype=KERNEL_OUT).to(g.dtype)
        else:
            grad_x = (g * scale.t().to(g.dtype)) @ weight.to(g.dtype)
        return grad_x.reshape(*grad.shape[:-1], weight.shape[1]).to(ctx.x_dtype), None, None, None, None


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
        y = _Fp8Matmul.apply(x, self.weight_fp8, self.weight_scale, self.fp8_backward, output_dtype(x))
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
                    lending.park(transformer, child)  # a lent model's bf16 weight waits in host memory
                    count += 1
    if count == 0 and not has_fp8(transformer):
        raise ValueError("quantize_fp8: no frozen nn.Linear found in transformer.transformer_blocks")
    _set_fp8_backward(transformer, fp8_backward)
    return count


def _set_fp8_backward(transformer: nn.Module, enabled: bool) -> None:
    for module in transformer.modules():
        if isinstance(module, Fp8Linear):
            module.fp8_backward = enabled


def dequantize_fp8(transformer: nn.Module, dtype: torch.dtype) -> int:
    """Replace every `Fp8Linear` by an `nn.Linear` holding its dequantized weight in `dtype` (the fallback
    when the fp8 kernel fails on this machine). Returns the count."""
    count = 0
    for parent in list(transformer.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, Fp8Linear):
                linear = nn.Linear(child.in_features, child.out_features, bias=child.bias is not None,
                                   device=child.weight_fp8.device, dtype=dtype).requires_grad_(False)
                with torch.no_grad():
                    linear.weight.copy_(child.dequantized(dtype))
                    if child.bias is not None:
                        linear.bias.copy_(child.bias)
                setattr(parent, name, linear)
                count += 1
    return count


def probe_fp8(device: torch.device) -> str | None:
    """Run the fp8 kernel once on `device` exactly as `Fp8Linear` calls it (row-wise scales, bf16 output);
    None when it works, else the error's text (some torch builds and GPUs lack the kernel or a layout)."""
    device = torch.device(device)
    try:
        weight, scale = quantize_rows(torch.randn(32, 32, device=device))
        _fp8_mm(torch.randn(4, 32, device=device), weight, scale)
    except (RuntimeError, NotImplementedError, TypeError) as err:
        return f"{type(err).__name__}: {err}".splitlines()[0]
    return None


def has_fp8(module: nn.Module) -> bool:
    return any(isinstance(m, Fp8Linear) for m in module.modules())


def fp8_matmul_supported(device: torch.device) -> bool:
    """fp8 tensor cores: CUDA compute capability 8.9 (Ada) or 9.0+ (Hopper). The CPU runs the same numerics
    through PyTorch's reference kernel (slow; for tests); the meta device (shapes only) stands for a GPU that
    has them in memory simulations and counts."""
    device = torch.device(device)
    if device.type != "cuda":
        return device.type in ("cpu", "meta")
    return torch.cuda.get_device_capability(device) >= (8, 9)
