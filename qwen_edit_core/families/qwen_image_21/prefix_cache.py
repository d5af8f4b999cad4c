"""Qwen-Image-2.1's prefix K/V cache, planned before sampling.

With the cache on (the default) the first step stores, per CFG branch, the keys and values of every prefix token
(text and references) in each block, in the transformer's dtype: layers x 2 x tokens x heads x head_dim values
(`QwenImage21KVCache`, diffusers 0.42.1 transformer_qwenimage21.py `_qwenimage21_prepare_qkv`). At real size
that is 0.5 MiB a token: ten 1024^2 references (about 41k prefix tokens) make 21 GB a branch, 43 GB with CFG.
`plan` sizes it from the prompts and references before any step runs and picks where it lives, in this order:
- "device": the transformer's dtype on its device (as diffusers keeps it);
- "host": the same numbers in host memory (one region, pinned for CUDA: speed.host_memory), each block's keys and
  values copied in as the block runs: exact, at one copy of the cache per step and branch;
- "int8": on the device in int8 with one float32 scale per token and head (about half the bytes); the first step
  checks its prediction against the exact one (`INT8_MAX_ERROR`) and turns the cache off when it is worse;
- "off": no cache, every step recomputes the prefix (slower, same image);
and refuses, naming the sizes, when even a step without the cache does not fit.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch

GIB = 2**30
PLACES = ("device", "host", "int8", "off")
#: the int8 cache's largest accepted prediction error on the first step: |v_int8 - v| / |v| against the exact
#: prediction the same step computed from its own keys and values
INT8_MAX_ERROR = 0.02
#: the share of the host's available memory the host-kept cache may take
HOST_HEADROOM = 0.8
#: what one no-grad forward holds beside the weights and the cache, in units of its tokens x dim values of the
#: transformer's dtype (the block's inputs, q/k/v, the attention output and the SwiGLU MLP's products at once),
#: measured with `qwen-edit bench memory --sample --variant image-2.1` (BENCHMARKS.md, "Memory, simulated")
FORWARD_FACTOR = 12.0
#: the fixed part: CUDA context and cuBLAS workspaces (speed.planner.MARGIN_FIXED)
FIXED_BYTES = 800 * 2**20 + 2 * 32 * 2**20
#: latent tokens per vision slot of the prompt (2x2)
TOKENS_PER_SLOT = 4

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class CacheShape:
    """The cache's geometry: blocks, attention heads, head width, and the keys' and values' dtype."""

    layers: int
    heads: int
    head_dim: int
    dtype: torch.dtype

    def layer_bytes(self, tokens: int) -> int:
        """One block's keys and values of `tokens` tokens in the cache's dtype."""
        return 2 * tokens * self.heads * self.head_dim * self.dtype.itemsize

    def bytes(self, tokens: int) -> int:
        """Every block's keys and values of `tokens` prefix tokens (one branch) in the cache's dtype."""
        return self.layers * self.layer_bytes(tokens)

    def int8_bytes(self, tokens: int) -> int:
        """The same in int8 with one float32 scale per token and head."""
        return self.layers * 2 * tokens * self.heads * (self.head_dim + 4)


def cache_shape(config, dtype: torch.dtype) -> CacheShape:
    """The cache geometry of a 2.1 transformer `config` computing in `dtype`."""
    return CacheShape(layers=config.num_layers, heads=config.num_attention_heads,
                      head_dim=config.attention_head_dim, dtype=dtype)


def prefix_tokens(slots: torch.Tensor, target_tokens: int) -> int:
    """The prefix (text and reference) tokens of a branch whose prompt's vision-slot mask `slots` ((1, S) or (S,),
    the target's slots included, as the transformer's `img_mask`) leads a target of `target_tokens` latent tokens:
    the prompt's text tokens plus 2x2 latent tokens per slot, less the target's."""
    n_slots = int(slots.sum())
    return slots.shape[-1] - n_slots + TOKENS_PER_SLOT * n_slots - target_tokens


def forward_bytes(tokens: int, dim: int, dtype: torch.dtype) -> int:
    """The working set of one no-grad forward over `tokens` tokens of width `dim` (`FORWARD_FACTOR`)."""
    return int(FORWARD_FACTOR * tokens * dim * dtype.itemsize)


@dataclass(frozen=True)
class PrefixPlan:
    """Where the cache lives (`PLACES`), its size, and the sampling peak planned on the device."""

    place: str
    #: prefix tokens of each branch (cond, then uncond)
    tokens: tuple[int, ...]
    #: the cache's bytes in its dtype, every branch
    bytes: int
    #: what it takes on the device and in host memory in this place
    device_bytes: int
    host_bytes: int
    #: the planned device peak of a step, weights included
    peak_bytes: int

    def describe(self) -> str:
        """One line with the sizes, for the log."""
        return (f"prefix K/V cache {self.place}: {len(self.tokens)} branch(es) of {', '.join(map(str, self.tokens))} "
                f"tokens, {self.bytes / GIB:.2f} GiB in the model's dtype; {self.device_bytes / GIB:.2f} GiB on the "
                f"device, {self.host_bytes / GIB:.2f} GiB in host memory; planned peak {self.peak_bytes / GIB:.2f} GiB")


def peak_bytes(place: str, *, weights: int, shape: CacheShape, tokens: tuple[int, ...], target_tokens: int,
               dim: int) -> int:
    """A sampling step's device peak with the cache in `place`: the larger of the first step (the whole joint
    sequence's forward beside the caches stored so far) and a cached step (the target's forward, every cache, and
    per block the prefix's keys and values joined to the target's; host and int8 also hold one block's keys and
    values in the dtype while it runs)."""
    longest = max(tokens)
    full = forward_bytes(longest + target_tokens, dim, shape.dtype)
    if place == "off":
        return weights + full + FIXED_BYTES
    stored = {"device": shape.bytes(sum(tokens)), "int8": shape.int8_bytes(sum(tokens)), "host": 0}[place]
    one_block = 0 if place == "device" else shape.layer_bytes(longest)
    first = full + stored + one_block
    cached = forward_bytes(target_tokens, dim, shape.dtype) + stored + one_block + \
        shape.layer_bytes(longest + target_tokens)
    return weights + max(first, cached) + FIXED_BYTES


def host_region_bytes(shape: CacheShape, tokens: tuple[int, ...], pin: bool) -> int:
    """Host bytes the host-kept cache takes: its tensors, or the pinned region's power-of-two chunks."""
    from qwen_edit_core.speed import host_memory
    sizes = [shape.layer_bytes(n) // 2 for n in tokens for _ in range(2 * shape.layers)]
    return sum(host_memory.pack(sizes)[0]) if pin else sum(sizes)


def plan(*, budget: int | None, host_budget: int | None, weights: int, shape: CacheShape,
         tokens: tuple[int, ...], target_tokens: int, dim: int, pin: bool = False) -> PrefixPlan:
    """The first place of `PLACES` whose step fits `budget` device bytes (None: no limit, "device") and, for
    "host", `host_budget` host bytes (None: no limit). ValueError with the sizes when not even "off" fits."""
    total = shape.bytes(sum(tokens))
    for place in PLACES:
        need = peak_bytes(place, weights=weights, shape=shape, tokens=tokens, target_tokens=target_tokens, dim=dim)
        host = host_region_bytes(shape, tokens, pin) if place == "host" else 0
        device = {"device": total, "int8": shape.int8_bytes(sum(tokens))}.get(place, 0)
        if (budget is None or need <= budget) and (host_budget is None or host <= host_budget):
            return PrefixPlan(place, tokens, total, device, host, need)
    raise ValueError(
        f"Qwen-Image-2.1 sampling does not fit {budget / GIB:.1f} GiB of device memory: even without the prefix "
        f"K/V cache a step needs about {need / GIB:.1f} GiB ({weights / GIB:.1f} GiB of weights and the forward "
        f"over {max(tokens) + target_tokens} tokens; the cache itself would be {total / GIB:.1f} GiB). Use fewer or "
        "smaller references (vae_area), an fp8 transformer, or a larger memory budget")


def host_available() -> int | None:
    """The host's available memory (Linux MemAvailable), or None where it cannot be read."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


# -- the cache objects the transformer writes and reads (duck-typing diffusers' QwenImage21KVCache) -------------

class _HostLayer:
    """One block's keys and values in host memory, brought to `device` each time the block reads them."""

    def __init__(self, region, index: int, device: torch.device):
        self.region, self.index, self.device = region, index, device
        self.k = self.v = None

    def store(self, k: torch.Tensor, v: torch.Tensor) -> None:
        self.k, self.v = self.region.put(self.index, k), self.region.put(self.index + 1, v)

    def get(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self.k is None:
            raise RuntimeError("KV cache has not been populated yet.")
        return self.k.to(self.device, non_blocking=True), self.v.to(self.device, non_blocking=True)


def quantize_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, N, heads, head_dim) -> int8 values and one float32 absmax scale per token and head."""
    scale = x.abs().amax(dim=-1, keepdim=True).float().clamp_min(torch.finfo(torch.float32).tiny) / 127
    return torch.round(x.float() / scale).clamp_(-127, 127).to(torch.int8), scale


def dequantize_int8(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`quantize_int8`'s inverse, in `dtype`."""
    return (q.float() * scale).to(dtype)


class _Int8Layer:
    """One block's keys and values in int8 on the device."""

    def __init__(self):
        self.k = self.v = None

    def store(self, k: torch.Tensor, v: torch.Tensor) -> None:
        self.dtype, self.k, self.v = k.dtype, quantize_int8(k), quantize_int8(v)

    def get(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self.k is None:
            raise RuntimeError("KV cache has not been populated yet.")
        return dequantize_int8(*self.k, self.dtype), dequantize_int8(*self.v, self.dtype)


class PlacedCache:
    """The prefix cache of one branch in `place` ("device", "host" or "int8"): `get_layer(i)` as diffusers'
    `QwenImage21KVCache`."""

    def __init__(self, place: str, shape: CacheShape, tokens: int, device: torch.device):
        from diffusers.models.transformers.transformer_qwenimage21 import QwenImage21KVLayerCache
        from qwen_edit_core.speed import host_memory
        self.place = place
        if place == "device":
            self.layers = [QwenImage21KVLayerCache() for _ in range(shape.layers)]
        elif place == "int8":
            self.layers = [_Int8Layer() for _ in range(shape.layers)]
        elif place == "host":
            spec = (torch.Size((1, tokens, shape.heads, shape.head_dim)), shape.dtype)
            self.region = host_memory.HostRegion([spec] * (2 * shape.layers), pin=torch.device(device).type == "cuda")
            self.layers = [_HostLayer(self.region, 2 * i, torch.device(device)) for i in range(shape.layers)]
        else:
            raise ValueError(f"prefix cache place {place!r} is not accepted; accepted: device, host, int8")

    def get_layer(self, index: int):
        return self.layers[index]

    def nbytes(self) -> int:
        """Bytes the stored keys and values take where they live (scales included)."""
        tensors = [t for layer in self.layers for kv in (layer.k, layer.v) if kv is not None
                   for t in (kv if isinstance(kv, tuple) else (kv,))]
        return sum(t.numel() * t.element_size() for t in tensors)


def prediction_error(approx: torch.Tensor, exact: torch.Tensor) -> float:
    """|approx - exact| / |exact| over the whole prediction (float32 norms)."""
    return float((approx.float() - exact.float()).norm() / exact.float().norm().clamp_min(1e-30))
