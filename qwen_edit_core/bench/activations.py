"""`qwen-edit bench activations`: what one transformer block saves for the backward pass, eager against compiled.

The memory planner's activation constant (`speed.planner.ACTIVATION_FACTOR`) comes from the simulator, which runs
the blocks eagerly. A compiled block saves less: the compiler's partitioner recomputes cheap elementwise work in
the backward instead of saving its results. This bench counts the bytes a block hands to autograd (every storage
packed through `torch.autograd.graph.saved_tensors_hooks`, weights left out) for a model of 2 and of 3 real-width
blocks, eagerly and with the product's compiled blocks (`speed.compile_blocks`); the difference is one block, in
units of tokens x dim bf16 values, the planner's unit. The first block's graph differs from the others' (its inputs
need no gradient), which the difference of two depths leaves out. On CUDA it also reports the allocated memory the
forward pass left behind, the same quantity seen by the allocator.
"""

from __future__ import annotations

import logging

import torch
from diffusers.training_utils import cast_training_params

from qwen_edit_core.bench.common import print_table, real_transformer, sync
from qwen_edit_core.model.devices import resolve_device

log = logging.getLogger(__name__)


def _model(device: torch.device, layers: int, compiled: bool):
    from qwen_edit_core import speed
    from qwen_edit_core.adapters import lora
    torch.manual_seed(0)
    model = real_transformer(device, torch.bfloat16, num_layers=layers)
    lora.inject_lora(model, lora.LoraSpec(rank=16, alpha=16, targets=lora.TARGET_PRESETS["attn-img"]))
    cast_training_params(model, dtype=torch.float32)  # the trainer's fp32 LoRA (train.loop.setup)
    if compiled:
        speed.compile_blocks(model)
    return model


def saved_bytes(model, side: int, text_tokens: int, device: torch.device) -> tuple[int, int]:
    """(bytes saved for the backward, allocated bytes the forward left on a CUDA device, else 0) of one training
    forward of `model` at a `side`^2 Edit (target and one control) with `text_tokens` prompt tokens."""
    weights = {t.untyped_storage().data_ptr() for t in (*model.parameters(), *model.buffers())}
    seen: dict[int, int] = {}

    def pack(tensor):
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in weights:
            seen[storage.data_ptr()] = storage.nbytes()
        return tensor

    h = w = side // 16
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(1, 2 * h * w, 64, generator=g).to(device, torch.bfloat16)
    text = torch.randn(1, text_tokens, 3584, generator=g).to(device, torch.bfloat16)
    sync(device)
    before = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), \
            torch.autocast(device.type, dtype=torch.bfloat16):
        out = model(hidden_states=hidden, timestep=torch.tensor([0.5], device=device), encoder_hidden_states=text,
                    img_shapes=[[(1, h, w), (1, h, w)]], return_dict=False)[0]
    sync(device)
    left = (torch.cuda.memory_allocated(device) - before) if device.type == "cuda" else 0
    out.float().pow(2).mean().backward()
    return sum(seen.values()), left


def run(device: str = "cpu", side: int | None = None, text_tokens: int = 1408) -> str:
    """Per-block saved activations, eager and compiled, in the planner's unit; returns the printed table. `side`:
    1024 on CUDA, 256 elsewhere (a CPU runs a real-width block slowly)."""
    dev = resolve_device(device, component="bench device")
    side = side or (1024 if dev.type == "cuda" else 256)
    tokens = 2 * (side // 16) ** 2 + text_tokens
    unit = tokens * 3072 * 2
    rows = []
    for compiled in (False, True):
        measured = {}
        for layers in (2, 3):
            model = _model(dev, layers, compiled)
            saved_bytes(model, side, text_tokens, dev)  # warm-up: compiles, and autotunes nothing twice
            measured[layers] = saved_bytes(model, side, text_tokens, dev)
            del model
            torch._dynamo.reset()
        block = measured[3][0] - measured[2][0]
        left = measured[3][1] - measured[2][1]
        rows.append(["compiled" if compiled else "eager", f"{block / 2**20:.1f}", f"{block / unit:.2f}",
                     f"{left / unit:.2f}" if dev.type == "cuda" else "-"])
        log.info("%s: %s", rows[-1][0], rows[-1])
    return print_table(f"activations saved by one real-width block: {side}^2 Edit ({tokens} tokens), LoRA r16 on the "
                       f"image attention, bf16 autocast, {dev}",
                       ["blocks", "saved MiB", "saved (tokens x dim bf16 units)", "allocated after forward (units)"],
                       rows)
