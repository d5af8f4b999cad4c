"""`qwen-edit bench attention`: what "auto" attention should pick, and what dynamic shapes cost, measured.

- Each attention kernel this torch and GPU offer (`speed.offered_kernels`), alone (no fallback: a kernel that
  cannot run the call is reported as failing), timed forward and backward on one real-width joint attention call
  (24 heads x 128, 1024^2 Edit at a real prompt's length: 8,192 image + 1,409 text tokens, bf16). It prints a
  JSON line with the timings and the `speed.attention.FASTEST_FIRST` row they give (`fastest_first`).
- One real-width transformer block compiled with `dynamic=True` (every dimension symbolic) against `dynamic=None`
  with only the sequence dimensions marked dynamic (`torch._dynamo.mark_dynamic`), over several text lengths:
  the graphs each compiles and its median forward + backward time.
"""

from __future__ import annotations

import json
import logging
import time

import torch

from qwen_edit_core import speed
from qwen_edit_core.bench.common import median_time, print_table

log = logging.getLogger(__name__)

#: 1024^2 Edit: target and control image tokens, and a real prompt's text tokens (model/prompt_length.py)
IMAGE_TOKENS, TEXT_TOKENS = 8192, 1409
HEADS, HEAD_DIM = 24, 128


def fastest_first(timings: dict[str, float | None]) -> tuple[str, ...]:
    """The SDPA kernels of `timings` (name -> seconds, None where the kernel failed) fastest first: the order a
    `FASTEST_FIRST` row takes ("auto" never picks a kernel outside SDPA: flash3 cannot fall back)."""
    ran = [(seconds, name) for name, seconds in timings.items() if seconds is not None and name in speed.SDPA_KERNELS
           and name not in ("auto", "math")]
    return tuple(name for _, name in sorted(ran))


def _one_kernel(name: str):
    """A context running attention on kernel `name` alone (SDPA's backend without fallbacks; flash3 through
    diffusers' dispatch)."""
    if name in speed.attention.DIFFUSERS_KERNELS:
        return speed.attention_kernel(name)
    from torch.nn.attention import sdpa_kernel
    return sdpa_kernel([speed.attention._sdpa_backends()[name]])


def time_kernels(device: torch.device, repeats: int, tokens: int = IMAGE_TOKENS + TEXT_TOKENS
                 ) -> dict[str, float | None]:
    """Median seconds of one attention forward + backward per offered kernel (None: the kernel failed)."""
    from diffusers.models.attention_dispatch import dispatch_attention_fn
    gen = torch.Generator(device=device).manual_seed(0)
    q, k, v = (torch.randn(1, tokens, HEADS, HEAD_DIM, device=device, dtype=torch.bfloat16, generator=gen)
               .requires_grad_(True) for _ in range(3))

    def step():
        dispatch_attention_fn(q, k, v, dropout_p=0.0, is_causal=False).sum().backward()

    timings: dict[str, float | None] = {}
    for name in speed.offered_kernels(device):
        try:
            with _one_kernel(name):
                timings[name] = median_time(step, device, repeats)
        except (RuntimeError, ValueError) as err:  # no kernel for these inputs on this device
            log.info("attention kernel %s fails here: %s", name, str(err).splitlines()[0][:200])
            timings[name] = None
    return timings


def _block_inputs(block, device, text: int, image: int):
    dim = HEADS * HEAD_DIM
    gen = torch.Generator(device=device).manual_seed(text)
    rand = lambda *shape: torch.randn(*shape, device=device, dtype=torch.bfloat16, generator=gen)  # noqa: E731
    freqs = (torch.polar(torch.ones(image, HEAD_DIM // 2, device=device), rand(image, HEAD_DIM // 2).float()),
             torch.polar(torch.ones(text, HEAD_DIM // 2, device=device), rand(text, HEAD_DIM // 2).float()))
    return dict(hidden_states=rand(1, image, dim).requires_grad_(True),
                encoder_hidden_states=rand(1, text, dim).requires_grad_(True), encoder_hidden_states_mask=None,
                temb=rand(1, dim), image_rotary_emb=freqs)


def _mark_sequences(inputs: dict) -> dict:
    """Only the sequence dimensions dynamic: dim 1 of the two streams, dim 0 of the RoPE tables."""
    torch._dynamo.mark_dynamic(inputs["hidden_states"], 1)
    torch._dynamo.mark_dynamic(inputs["encoder_hidden_states"], 1)
    for table in inputs["image_rotary_emb"]:
        torch._dynamo.mark_dynamic(table, 0)
    return inputs


def time_dynamic(device: torch.device, repeats: int, texts=(1409, 1371, 1452, 1500),
                 image_tokens: int = IMAGE_TOKENS) -> list[list]:
    """Rows (setting, graphs compiled, compile seconds, median s per forward + backward at the first length) of
    one real-width block compiled with dynamic=True and with dynamic=None plus the sequence dims marked."""
    from qwen_edit_core.bench.common import real_transformer
    rows = []
    for label, dynamic, mark in (("dynamic=True", True, False), ("dynamic=None, sequence marked", None, True)):
        torch._dynamo.reset()
        block = real_transformer(device, torch.bfloat16, num_layers=1).transformer_blocks[0]
        counters = torch._dynamo.utils.counters
        compiled = torch.compile(block, fullgraph=True, dynamic=dynamic)

        def call(text: int):
            inputs = _block_inputs(block, device, text, image_tokens)
            out = compiled(**(_mark_sequences(inputs) if mark else inputs))
            (out[1].float().sum() + out[0].float().sum()).backward()

        started = time.perf_counter()
        before = counters["stats"]["unique_graphs"]
        for text in texts:
            call(text)
        graphs = counters["stats"]["unique_graphs"] - before
        rows.append([label, graphs, f"{time.perf_counter() - started:.1f}",
                     f"{median_time(lambda: call(texts[0]), device, repeats):.4f}"])
    return rows


def run(device: str = "cuda:0", repeats: int = 5, *, image_tokens: int = IMAGE_TOKENS,
        texts: tuple[int, ...] = (TEXT_TOKENS, 1371, 1452, 1500)) -> dict:
    """Print both tables and one JSON line (timings, the FASTEST_FIRST row they give); returns that record.
    `image_tokens` / `texts` (the text lengths the block compiles over, the first one timed) shrink a smoke run."""
    device = torch.device(device)
    timings = time_kernels(device, repeats, tokens=image_tokens + texts[0])
    print_table(f"attention, one call forward + backward ({image_tokens} + {texts[0]} tokens, {HEADS} x "
                f"{HEAD_DIM}, bf16)", ["kernel", "s"],
                [[name, "fails" if s is None else f"{s:.5f}"] for name, s in timings.items()])
    capability = list(torch.cuda.get_device_capability(device)) if device.type == "cuda" else None
    record = {"capability": capability, "torch": torch.__version__, "seconds": timings,
              "fastest_first": list(fastest_first(timings)),
              "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"}
    print(json.dumps(record))  # noqa: T201 (the runbook keeps this line as attention.json)
    print_table(f"one block compiled, text lengths {', '.join(map(str, texts))}",
                ["setting", "graphs", "compile s", "s fwd+bwd"], time_dynamic(device, repeats, texts, image_tokens))
    return record
