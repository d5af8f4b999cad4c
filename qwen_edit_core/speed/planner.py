"""The memory planner: a step's device memory estimated per setting, and the fastest setting for a budget."""

from __future__ import annotations

from dataclasses import dataclass

import torch

#: the share of a device's memory the planner plans for when it sizes itself to the free memory: its
#: estimate is rough (a fixed 1 GiB for the CUDA context and the allocator's slack)
FREE_MEMORY_HEADROOM = 0.9

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
                    activation_factor: float = 17.0, shards: int = 1) -> MemoryEstimate:
    """A step's device memory: resident weights, saved activations and a fixed working set.

    A non-checkpointed block saves about `activation_factor` x tokens x dim bf16 values: 17.1 measured by
    summing the tensors autograd saves (`torch.autograd.graph.saved_tensors_hooks`) in one real-width block
    under bf16 autocast with a LoRA on the image attention, at 512 and 1,024 tokens, bf16 or fp8 base alike
    (fused attention saves its output and log-sum-exp, not the scores). A checkpointed block saves its two
    input streams; the block being recomputed needs one block's activations plus its gradients; two
    offloaded blocks are in flight at a time. Sharded over `shards` processes (FSDP2), each holds 1/shards of
    the frozen weights, plus the whole of the two blocks in flight (the running one, the next one prefetched)
    and of the root's own weights (gathered for the whole forward). The fixed 1 GiB (CUDA context, allocator slack) is a guess
    until the real-size bench runs on a GPU.
    """
    bytes_per_weight = 1 if fp8 else 2
    resident_blocks = n_blocks - n_offloaded + (min(2, n_offloaded))
    gathered = (min(2, n_blocks) * block_params + other_params) * (1 - 1 / shards)
    weights = int(((resident_blocks * block_params + other_params) / shards + gathered) * bytes_per_weight)
    full = int(activation_factor * tokens * dim * 2)
    boundary = tokens * dim * 2
    checkpointed = n_blocks if n_checkpointed < 0 else min(n_checkpointed, n_blocks)
    activations = checkpointed * boundary + (n_blocks - checkpointed) * full
    fixed = 2 * full + trainable_params * 16 + (1 << 30)  # working block, LoRA+grads+AdamW fp32, CUDA context
    return MemoryEstimate(weights=weights, activations=activations, fixed=fixed)


def plan_for_budget(budget_gb: float, prefer_fp8: bool = False, shards: int = 1, **model) -> SpeedPlan:
    """The fastest settings whose estimate fits `budget_gb`, trying in order of cost: the fewest checkpointed
    blocks with a bf16 base (skipped when `prefer_fp8`), then with an fp8 base, then fp8 with every block
    checkpointed and the fewest offloaded blocks. An fp8 base is faster but changes the numbers slightly, so
    it is taken only when asked for (`train.fp8_base`) or when bf16 does not fit.

    `shards` > 1 (FSDP2 over that many processes): each process's share of the frozen weights; only
    checkpointing is planned (an fp8 base and offloading are refused under FSDP2: train.sharding).

    `model`: the keyword arguments of `estimate_memory` other than fp8, n_checkpointed and n_offloaded.
    """
    budget = budget_gb * 2**30
    n = model["n_blocks"]
    if shards > 1:
        for n_ckpt in (*range(0, n), -1):
            est = estimate_memory(fp8=False, n_checkpointed=n_ckpt, n_offloaded=0, shards=shards, **model)
            if est.total <= budget:
                return SpeedPlan(False, n_ckpt, 0, est)
        raise ValueError(f"train.memory_budget_gb {budget_gb} is too small for FSDP over {shards} processes: "
                         f"with every block checkpointed each needs about {est.total / 2**30:.1f} GiB (an fp8 base "
                         "and offloading are not available under FSDP); add processes or raise the budget")
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


def resident_bytes(module: torch.nn.Module, device: torch.device) -> int:
    """Bytes of `module`'s parameters and buffers that live on `device` ("cuda" is "cuda:0")."""
    device = torch.device(device)
    if device.type != "cpu" and device.index is None:
        device = torch.device(device.type, 0)
    seen, total = set(), 0
    for t in (*module.parameters(), *module.buffers()):
        if t.device == device and id(t) not in seen:
            seen.add(id(t))
            total += t.numel() * t.element_size()
    return total


def free_memory_budget_gb(free_bytes: int, resident: int, headroom: float = FREE_MEMORY_HEADROOM) -> float:
    """The budget (GiB) for `plan_for_budget` on a device with `free_bytes` free whose transformer already
    holds `resident` bytes there (the estimate counts the weights too): `headroom` of their sum."""
    return headroom * (free_bytes + resident) / 2**30
