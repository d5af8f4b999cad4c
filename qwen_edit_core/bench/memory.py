"""Numbers the memory planner and the fp8 file loader rely on, measured on the CPU:

- the weight memory of the real transformer in bf16 and with its block linears in fp8 (counted on a
  meta-device model: no weights are built);
- `speed.estimate_memory`'s activation factor: the bf16 values autograd saves per token per model dim in one
  real-width block (summed with `torch.autograd.graph.saved_tensors_hooks`; tensors sharing a weight's storage not counted) under bf16
  autocast with a LoRA on the image attention, bf16 and fp8 base.

Run: `python -m qwen_edit_core.bench.memory` (a few minutes on 2 cores: bf16 matmuls are slow on a CPU).
"""

from __future__ import annotations

import logging

import torch

log = logging.getLogger(__name__)


def weight_gib() -> dict[str, float]:
    from accelerate import init_empty_weights
    from diffusers import QwenImageTransformer2DModel

    from qwen_edit_core import speed
    from qwen_edit_core.model.tiny import transformer_config
    with init_empty_weights():
        model = QwenImageTransformer2DModel(**transformer_config("real")).to(torch.bfloat16).requires_grad_(False)

    def size() -> float:
        return sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers())) / 2**30
    out = {"bf16": size()}
    speed.quantize_fp8(model)
    out["block linears fp8"] = size()
    return out


def activation_factor(fp8: bool, img_tokens: int = 384, txt_tokens: int = 128) -> float:
    from qwen_edit_core.adapters import multires
    from qwen_edit_core.adapters import lora
    from qwen_edit_core import speed

    from qwen_edit_core.bench.common import real_transformer
    torch.manual_seed(0)
    dtype = torch.bfloat16
    model = real_transformer(torch.device("cpu"), dtype, num_layers=1)
    lora.inject_lora(model, lora.LoraSpec(rank=16, alpha=16, targets=lora.TARGET_PRESETS["attn-img"]))
    multires.install(model)
    if fp8:
        speed.quantize_fp8(model)
    # By storage, not by tensor: autograd saves views of weights too (the transposed weight of a linear).
    weights = {t.untyped_storage().data_ptr() for t in (*model.parameters(), *model.buffers())}
    saved: dict[int, int] = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in weights:
            saved[storage.data_ptr()] = storage.nbytes()
        return t

    dim = 3072
    hidden = torch.randn(1, img_tokens, dim, dtype=dtype, requires_grad=True)
    text = torch.randn(1, txt_tokens, dim, dtype=dtype, requires_grad=True)
    freqs = tuple(torch.polar(torch.ones(n, 64), torch.randn(n, 64)) for n in (img_tokens, txt_tokens))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), torch.autocast("cpu", dtype=dtype):
        model.transformer_blocks[0](hidden_states=hidden, encoder_hidden_states=text, encoder_hidden_states_mask=None,
                                    temb=torch.randn(1, dim, dtype=dtype), image_rotary_emb=freqs)
    return sum(saved.values()) / ((img_tokens + txt_tokens) * dim * 2)


def run() -> str:
    lines = [f"real transformer weights: {name} {gib:.2f} GiB" for name, gib in weight_gib().items()]
    for fp8, img, txt in ((False, 384, 128), (False, 768, 256), (True, 384, 128)):
        lines.append(f"activation factor, {'fp8' if fp8 else 'bf16'} base, {img + txt} tokens: "
                     f"{activation_factor(fp8, img, txt):.2f}")
    text = "\n".join(lines)
    log.info("\n%s", text)
    return text


if __name__ == "__main__":
    print(run())  # noqa: T201 - a command's output
