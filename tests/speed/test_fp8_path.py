"""The fp8 layer: bf16 kernel output, autocast's activation dtype, no weight-sized temporaries for the
one-row modulation layers, and a bf16 fallback when the kernel fails."""

from __future__ import annotations

import logging

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from qwen_edit_core import speed
from qwen_edit_core.speed import fp8 as fp8_mod


class LargestTensor(TorchDispatchMode):
    """The element count of the largest tensor any aten op allocates (views of its inputs excluded)."""

    def __init__(self):
        super().__init__()
        self.largest, self.ops = 0, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        from torch.utils._pytree import tree_leaves
        out = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in inputs \
                    and t.numel() > self.largest:
                self.largest, self.ops = t.numel(), self.ops + [str(func)]
        return out


def test_fp8_layer_returns_autocast_dtype_and_asks_the_kernel_for_bf16(monkeypatch):
    torch.manual_seed(0)
    layer = speed.Fp8Linear(torch.nn.Linear(64, 96).requires_grad_(False))
    asked = []
    real = torch._scaled_mm
    monkeypatch.setattr(torch, "_scaled_mm", lambda *a, **k: asked.append(k["out_dtype"]) or real(*a, **k))
    x = torch.randn(2, 20, 64)  # fp32, as after a LayerNorm under autocast
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = layer(x)
        ref = torch.nn.functional.linear(x, layer.dequantized(torch.float32), layer.bias)
    assert y.dtype == torch.bfloat16 == ref.dtype
    assert layer(x).dtype == torch.float32  # no autocast: the input's dtype
    for dtype in (torch.float16, torch.bfloat16):
        assert layer(x.to(dtype)).dtype == dtype
    assert set(asked) == {torch.bfloat16}
    x.requires_grad_(True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = layer(x)
    out.float().sum().backward()
    assert x.grad.dtype == torch.float32


def test_one_row_modulation_call_makes_no_weight_sized_temporary():
    """img_mod / txt_mod: Linear(dim, 6 dim) on one row per sample; a third of a block's weights."""
    torch.manual_seed(0)
    linear = torch.nn.Linear(256, 6 * 256).requires_grad_(False)
    layer = speed.Fp8Linear(linear)
    x = torch.randn(2, 256)
    with LargestTensor() as mode, torch.no_grad():
        y = layer(x)
    assert mode.largest < linear.weight.numel() // 8, mode.ops
    ref = linear(x)
    assert ((y - ref).norm() / ref.norm()).item() < 0.05
    # Dims the kernel does not take are dequantized a chunk of rows at a time, never whole.
    odd = speed.Fp8Linear(torch.nn.Linear(40, 6 * 200).requires_grad_(False))
    with LargestTensor() as mode, torch.no_grad():
        odd(torch.randn(1, 40))
    assert mode.largest < odd.weight_fp8.numel() // 2, mode.ops


def _transformer(tiny_edit_dir):
    from qwen_edit_core.model.components import load_components
    from qwen_edit_core.model.devices import DevicePlan
    return load_components(tiny_edit_dir, DevicePlan.from_mapping({}), which=("transformer",)).transformer


def _forward(transformer):
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(1, 32, transformer.config.in_channels, generator=g)
    text = torch.randn(1, 7, transformer.config.joint_attention_dim, generator=g)
    with torch.no_grad():
        return transformer(hidden_states=hidden, timestep=torch.tensor([0.5]), encoder_hidden_states=text,
                           img_shapes=[[(1, 4, 4), (1, 4, 4)]], return_dict=False)[0]


def test_fp8_falls_back_to_the_plain_base_when_the_kernel_raises(tiny_edit_dir, monkeypatch, caplog):
    plain = _transformer(tiny_edit_dir)
    reference = _forward(plain)

    def broken(*args, **kwargs):
        raise RuntimeError("Only bf16 high precision output types are supported for row-wise scaling.")

    monkeypatch.setattr(torch, "_scaled_mm", broken)
    with caplog.at_level(logging.WARNING):
        levers = speed.configure_inference(plain, torch.device("cpu"), fp8=True, compile=False)
    assert not levers.fp8 and not speed.has_fp8(plain)
    assert "fp8 kernel fails on cpu" in caplog.text and "row-wise" in caplog.text
    assert torch.equal(_forward(plain), reference)


def test_an_fp8_base_is_dequantized_when_the_kernel_raises(tiny_edit_dir, monkeypatch):
    """A transformer already in fp8 (a scaled-fp8 file kept in fp8) falls back to its dequantized weights."""
    transformer = _transformer(tiny_edit_dir)
    speed.quantize_fp8(transformer)
    expected = {n: m.dequantized(torch.float32) for n, m in transformer.named_modules()
                if isinstance(m, speed.Fp8Linear)}
    monkeypatch.setattr(torch, "_scaled_mm", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("no kernel")))
    speed.configure_inference(transformer, torch.device("cpu"), fp8=False, compile=False)
    assert not speed.has_fp8(transformer)
    modules = dict(transformer.named_modules())
    assert all(torch.equal(modules[n].weight, w) for n, w in expected.items())
    assert torch.isfinite(_forward(transformer)).all()


def test_probe_reports_a_working_kernel():
    assert fp8_mod.probe_fp8(torch.device("cpu")) is None
