"""fp8 (e4m3) base linears: per-output-channel weight scales, per-token activation scales."""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

log = logging.getLogger(__name__)

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # largest finite e4m3fn value

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
