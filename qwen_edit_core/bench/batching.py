"""`qwen-edit bench batching`: one padded batch of 4 mixed sizes against the same 4 samples one by one.

A LoRA training step (forward + backward) of the transformer with the batching adapter; prints samples/s of
both, their ratio and the padding fraction; the batch runs with a key mask over the padding and with
variable-length attention over the valid tokens (the product's path), with the attention kernels each ran and
the largest difference of their outputs (they must agree: the GPU check of `multires.packed_attention`). Tiny
model on the CPU by default (128^2 to 256^2); `--real-size` runs the real transformer config with random bf16
weights on a GPU at 512^2 to 1024^2.
"""

from __future__ import annotations

import torch

from qwen_edit_core.adapters import multires
from qwen_edit_core.model import encode
from qwen_edit_core.adapters import lora
from qwen_edit_core.model.devices import resolve_device

from qwen_edit_core.bench.common import median_time, print_table


def _inputs(sides, text_dim, device, dtype, text_tokens):
    g = torch.Generator().manual_seed(0)
    out = []
    for i, (w, h) in enumerate(sides):
        rows, cols = h // 16, w // 16
        n = rows * cols
        text = torch.randn(text_tokens + 17 * i, text_dim, generator=g)
        target, control = (torch.randn(n, 64, generator=g).to(device, dtype) for _ in range(2))
        out.append((target, control, text.to(device, dtype), [(1, rows, cols), (1, rows, cols)]))
    return out


def _forward(model, samples, device, dtype, varlen: bool):
    """(per-sample target predictions, the packed batch): the key-mask path or, `varlen`, the packed one."""
    packed = multires.pack_samples([s[0] for s in samples], [s[1] for s in samples], [s[3] for s in samples])
    text = encode.pad_embeddings([s[2] for s in samples])
    kwargs = packed.packed_kwargs(text.lengths, text.embeds.shape[1]) if varlen else packed.attention_kwargs
    with torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32):
        out = model(hidden_states=packed.hidden, encoder_hidden_states=text.embeds,
                    encoder_hidden_states_mask=text.mask_or_none(), timestep=torch.full((len(samples),), 0.5,
                                                                                        device=device),
                    img_shapes=packed.img_shapes, attention_kwargs=kwargs, return_dict=False)[0]
    return [out[b, :n] for b, n in enumerate(packed.n_target)], packed


def _step(model, samples, device, dtype, varlen: bool = True):
    out, packed = _forward(model, samples, device, dtype, varlen)
    loss = sum(o.float().square().mean() for o in out) / len(samples)
    loss.backward()
    return packed.padding_fraction()


def _agreement(model, samples, device, dtype) -> float:
    """The largest |packed - masked| of the batch's predictions, relative to the largest |masked|."""
    with torch.no_grad():
        packed, _ = _forward(model, samples, device, dtype, varlen=True)
        masked, _ = _forward(model, samples, device, dtype, varlen=False)
    diff = max(float((a.float() - b.float()).abs().max()) for a, b in zip(packed, masked))
    return diff / max(float(b.float().abs().max()) for b in masked)


def run(real_size: bool = False, device: str = "cpu", repeats: int = 5) -> str:
    from qwen_edit_core.families import DEFAULT
    transformer_config = DEFAULT.stage("tiny").transformer_config

    from qwen_edit_core.bench.common import real_transformer
    dev = resolve_device(device, component="bench device")
    if real_size:
        dtype = torch.bfloat16
        model = real_transformer(dev, dtype)
        sides, text_dim, text_tokens = [(512, 512), (768, 768), (1024, 768), (1024, 1024)], 3584, 300
    else:
        dtype = torch.float32
        torch.manual_seed(0)
        model = DEFAULT.class_of("transformer")(**transformer_config("tiny")).to(dev).requires_grad_(False)
        sides, text_dim, text_tokens = [(128, 128), (192, 192), (256, 192), (256, 256)], 32, 40
    lora.inject_lora(model, lora.LoraSpec(rank=16, alpha=16.0))
    if real_size:
        model.enable_gradient_checkpointing()
    multires.install(model)
    samples = _inputs(sides, text_dim, dev, dtype, text_tokens)

    def timed(fn):
        return median_time(lambda: (fn(), model.zero_grad(set_to_none=True)), dev, repeats)

    from qwen_edit_core import speed
    padding = _step(model, samples, dev, dtype)
    t_single = timed(lambda: [_step(model, [s], dev, dtype) for s in samples])
    rows = [["one by one", f"{len(samples) / t_single:.2f}", "0.0%", "1.00",
             speed.kernels_text(speed.kernels_ran(lambda: _step(model, samples[:1], dev, dtype), dev))]]
    for label, varlen in (("batch of 4, key mask", False), ("batch of 4, variable-length", True)):
        t_batch = timed(lambda v=varlen: _step(model, samples, dev, dtype, v))
        kernels = speed.kernels_ran(lambda v=varlen: _step(model, samples, dev, dtype, v), dev)
        rows.append([label, f"{len(samples) / t_batch:.2f}", f"{100 * padding:.1f}%", f"{t_single / t_batch:.2f}",
                     speed.kernels_text(kernels)])
    model.zero_grad(set_to_none=True)
    sizes = ", ".join(f"{w}x{h}" for w, h in sides)
    return print_table(f"batching: LoRA step, {'real-size' if real_size else 'tiny'} transformer, sizes {sizes}, "
                       f"{dev}, {dtype}; variable-length vs key mask: largest difference "
                       f"{_agreement(model, samples, dev, dtype):.1e} of the largest output",
                       ["mode", "samples/s", "padding", "throughput vs one-by-one", "attention kernels"], rows)
