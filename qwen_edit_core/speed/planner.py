"""The memory planner: a step's device memory estimated per setting, and the fastest setting for a budget."""

from __future__ import annotations

from dataclasses import dataclass

import torch

#: the share of a device's memory the planner plans for when it sizes itself to the free memory (room for
#: other processes and for what the estimate misses)
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
    """Settings chosen by `plan_for_budget`: fp8 base, how many blocks recompute, how many are offloaded, and the
    seconds the time model says recompute and offloading add to a step (`plan_seconds`)."""

    fp8: bool
    checkpoint_blocks: int
    offload_blocks: int
    estimate: MemoryEstimate
    seconds: float = 0.0


#: Activation constants in units of tokens x dim bf16 values, all measured by the real-size simulator
#: (`qwen-edit bench memory`, bench/memory.py: the product's step under FakeTensorMode with MemTracker, LoRA r16
#: on every attention projection, bf16 autocast) as the per-block slope and the intercept of 2- and 4-block
#: models at 1024^2 and 512^2 Edit (9,601 and 2,412 tokens; the same within 2% at both sizes):
#: what one block without checkpointing saves (fused attention saves its output and log-sum-exp, not scores)
ACTIVATION_FACTOR = 20.2
#: what one block without checkpointing saves when the blocks are compiled: the compiler's partitioner recomputes
#: cheap elementwise work in the backward instead of saving it. The simulator runs blocks eagerly, so this one is
#: the GPU's: the bytes a real-width block hands to autograd, `qwen-edit bench activations --device cuda:0`
#: (BENCHMARKS.md, "Real size", with the plan it corrects). The 2025 family only: Qwen-Image-2.1's compiled blocks
#: are not measured, so its plans keep the eager constant.
ACTIVATION_FACTOR_COMPILED = 13.8
#: what one checkpointed block saves: its two input streams (measured 0.73-1.1)
BOUNDARY_FACTOR = 1.0
#: the working set on top of the saved activations, by (fp8 base, any block checkpointed): the block being
#: recomputed and its backward, the loss in fp32; the fp8 base adds the fp32 copies `quantize_rows` makes of
#: each linear's input
WORKING_FACTOR = {(False, True): 29.4, (True, True): 40.8, (False, False): 7.7, (True, False): 20.5}
#: offloaded blocks on the device at once: the one running and the one prefetched
OFFLOAD_IN_FLIGHT = 2
#: bytes per trainable parameter: the fp32 LoRA, its gradient and AdamW's two moments
TRAINABLE_BYTES = 16
#: what no tensor shows: the CUDA context (an empty PyTorch process shows 781 MB in nvidia-smi,
#: github.com/pytorch/pytorch/issues/34323) and cuBLASLt workspaces (32 MiB per handle and stream on Hopper,
#: github.com/pytorch/pytorch/pull/120925; two streams)
MARGIN_FIXED = 800 * 2**20 + 2 * 32 * 2**20
#: the share of a budget the planner leaves for its own error: above its largest shortfall against the simulated
#: peak (BENCHMARKS.md, "Memory, simulated"), which Edit-2511 (its per-token timestep modulation, which the
#: constants fitted on Edit do not hold) and 2.1 with three references show
ESTIMATE_HEADROOM = 0.04
#: The time model (`plan_seconds`), from the H100 runs of BENCHMARKS.md ("Real size"): pinned host-to-device
#: copies ran at 54.4 GB/s (`bench.common.h2d_gbps`), the fastest training row at 60% of the 989 TFLOP/s dense
#: bf16 peak
H2D_BYTES_PER_S = 54.4e9
BLOCK_FLOPS_PER_S = 0.60 * 989e12
#: a block's recompute plus backward in forwards: the recomputed forward, the input gradients through the frozen
#: base (one forward's matmuls) and attention's backward (about twice its forward)
BACKWARD_FORWARDS = 3.0
#: the share of a copy's time the compute it overlaps can hide: half, an assumption until a GPU run measures
#: it (copies share the device's memory bandwidth with the step; the offloader copies on a side stream)
COPY_OVERLAP = 0.5
#: allocator fragmentation: an allowance of this share of the non-weight memory (the caching allocator keeps
#: and splits freed blocks, so it reserves more than tensors hold) until a GPU run measures it
MARGIN_FRAGMENTATION = 0.10


def estimate_memory(*, n_blocks: int, block_params: int, other_params: int, tokens: int, dim: int, fp8: bool,
                    n_checkpointed: int, n_offloaded: int, trainable_params: int,
                    activation_factor: float = ACTIVATION_FACTOR, working_factor: dict | None = None,
                    shards: int = 1, base_bytes: float = 2.0) -> MemoryEstimate:
    """A step's device memory: resident weights, saved activations, and a fixed part (the working set, the
    LoRA with its gradient and optimizer state, and the margin for the CUDA context, cuBLAS workspaces and
    fragmentation).

    Every constant comes from the real-size simulator (`qwen-edit bench memory`, see the constants above); its table is
    in BENCHMARKS.md. A non-checkpointed block saves `activation_factor` x tokens x dim bf16 values (the working set:
    `working_factor`, by fp8 base and checkpointing; both are the model family's), a checkpointed one its two input
    streams (`BOUNDARY_FACTOR`); offloaded blocks are on the device only while they run, `OFFLOAD_IN_FLIGHT` at a time.
    Sharded over `shards` processes (FSDP2), each holds 1/shards of the frozen weights, plus the whole of the two blocks
    in flight (the running one, the next one prefetched) and of the root's own weights (gathered for the whole forward).
    `base_bytes`: bytes a frozen parameter element holds outside fp8 (bf16: 2; a bitsandbytes base: `base_bytes_of`).
    """
    bytes_per_weight = 1 if fp8 else base_bytes
    in_flight = min(OFFLOAD_IN_FLIGHT, n_offloaded) * block_params * bytes_per_weight
    gathered = (min(2, n_blocks) * block_params + other_params) * (1 - 1 / shards)
    resident = (n_blocks - n_offloaded) * block_params + other_params
    weights = int((resident / shards + gathered) * bytes_per_weight) + in_flight
    unit = tokens * dim * 2
    checkpointed = n_blocks if n_checkpointed < 0 else min(n_checkpointed, n_blocks)
    activations = int(checkpointed * BOUNDARY_FACTOR * unit + (n_blocks - checkpointed) * activation_factor * unit)
    working = int(_working_units(working_factor or WORKING_FACTOR, activation_factor, fp8, n_blocks - checkpointed,
                                 checkpointed > 0) * unit) + trainable_params * TRAINABLE_BYTES
    # The offloaded blocks' copies come and go every step: they fragment like activations.
    margin = MARGIN_FIXED + int(MARGIN_FRAGMENTATION * (activations + working + in_flight))
    return MemoryEstimate(weights=weights, activations=activations, fixed=working + margin)


def _working_units(working_factor: dict, activation_factor: float, fp8: bool, n_plain: int,
                   any_checkpointed: bool) -> float:
    """The working set in tokens x dim units. With every block or none checkpointed it is the measured intercept.
    In a mixed plan the plain blocks are the last ones (`checkpointed_indices`), so their backward runs first and
    frees their activations before any block recomputes: the step peaks either at the end of the forward (the
    plain blocks' activations plus the plain working set) or while a block recomputes (the checkpointed working
    set alone), never both at once. Summing the two overestimated a 2.1 plan with 31 of 32 blocks checkpointed
    by 3.7 GiB (22.8 against a simulated 19.1)."""
    plain = working_factor[(fp8, False)]
    if not any_checkpointed:
        return plain
    return max(plain, working_factor[(fp8, True)] - n_plain * activation_factor)


def block_forward_seconds(*, block_params: int, tokens: int, dim: int) -> float:
    """One block's forward at `tokens` by the time model: its linears (2 FLOPs a weight and token) and attention
    (4 x tokens^2 x dim: scores and the weighted sum) at `BLOCK_FLOPS_PER_S`."""
    return (2 * block_params * tokens + 4 * tokens ** 2 * dim) / BLOCK_FLOPS_PER_S


def plan_seconds(*, n_blocks: int, block_params: int, tokens: int, dim: int, fp8: bool, n_checkpointed: int,
                 n_offloaded: int, **_) -> float:
    """What recompute and offloading add to a step, in seconds: what `plan_for_budget` ranks the plans that fit
    by. Each checkpointed block recomputes its forward. Each offloaded block's weights cross the host link twice
    a step (for its forward, and for its recompute and backward); the offloaded blocks are spread over the
    checkpointed ones (`checked_plan`), and each copy runs while the blocks since the previous offloaded one
    compute, which hides up to `COPY_OVERLAP` of it; the rest shows.

    The trade it settles: a block that does not recompute keeps its activations, which more offloaded fp8 blocks
    must make room for. At 1024^2 Edit with a real prompt (9,601 tokens) a compiled block saves 13.8 x 9,601 x
    3,072 bf16 values (`ACTIVATION_FACTOR_COMPILED`: 814 MB), the fp8 weights of about 2.4 blocks (339,831,296
    frozen parameters a block, one byte each); one recompute (13 ms at 9,601 tokens) then weighs against 2.4
    blocks' copies (6.2 ms each way), of which `COPY_OVERLAP` shows."""
    if n_offloaded <= 0 and n_checkpointed == 0:
        return 0.0
    forward = block_forward_seconds(block_params=block_params, tokens=tokens, dim=dim)
    checkpointed = n_blocks if n_checkpointed < 0 else min(n_checkpointed, n_blocks)
    seconds = checkpointed * forward
    if n_offloaded > 0:
        copy = block_params * (1 if fp8 else 2) / H2D_BYTES_PER_S
        between = max(checkpointed, n_offloaded) / n_offloaded  # blocks computing while one copy runs
        shown = sum(max(copy * (1 - COPY_OVERLAP), copy - between * window * forward)
                    for window in (1.0, BACKWARD_FORWARDS))
        seconds += n_offloaded * shown
    return seconds


def _fewest_offloaded(budget: float, fp8: bool, n_ckpt: int, max_offloaded: int, model: dict) -> SpeedPlan | None:
    """The plan with `n_ckpt` blocks checkpointed and the fewest offloaded blocks (at most `max_offloaded`)
    whose estimate fits `budget` bytes; None when none does."""
    for n_off in range(0, max_offloaded + 1):
        est = estimate_memory(fp8=fp8, n_checkpointed=n_ckpt, n_offloaded=n_off, **model)
        if est.total <= budget:
            return SpeedPlan(fp8, n_ckpt, n_off, est, plan_seconds(fp8=fp8, n_checkpointed=n_ckpt,
                                                                   n_offloaded=n_off, **model))
    return None


def plan_for_budget(budget_gb: float, prefer_fp8: bool = False, shards: int = 1, *, already_fp8: bool = False,
                    no_fp8: str | None = None, no_offload: str | None = None, **model) -> SpeedPlan:
    """The fastest settings by the time model (`plan_seconds`) whose estimate fits `budget_gb` less
    `ESTIMATE_HEADROOM`: with a bf16 base (skipped when `prefer_fp8`) the fewest checkpointed blocks; then with an
    fp8 base, every split of recompute and offloading (offloaded blocks are checkpointed ones: an offloaded block's
    weights must not stay on the device until its backward), ties going to fewer offloaded blocks (less pinned host
    memory). An fp8 base is faster but changes the numbers slightly, so it is taken only when asked for
    (`train.fp8_base`) or when bf16 does not fit.

    `already_fp8`: the base's block linears are fp8 already (a scaled-fp8 file kept in fp8): they take one byte a
    weight and the fp8 working set whatever the plan says, so only fp8 settings are estimated.

    `no_fp8`: why the base cannot take fp8 (an adapter that reads the base weight: `weight_plan.adapter_no_fp8`),
    None where it can: then only bf16 settings are estimated, and with them offloaded blocks (fp8 otherwise
    comes first, as it halves every block's weights and copies); `no_offload`: why no block can be offloaded.

    `shards` > 1 (FSDP2 over that many processes): each process's share of the frozen weights; only
    checkpointing is planned (an fp8 base and offloading are refused under FSDP2: train.sharding).

    `model`: the keyword arguments of `estimate_memory` other than fp8, n_checkpointed and n_offloaded.
    """
    budget = budget_gb * 2**30 * (1 - ESTIMATE_HEADROOM)
    n = model["n_blocks"]
    if shards > 1:
        for n_ckpt in (*range(0, n), -1):
            est = estimate_memory(fp8=False, n_checkpointed=n_ckpt, n_offloaded=0, shards=shards, **model)
            if est.total <= budget:
                return SpeedPlan(False, n_ckpt, 0, est)
        raise ValueError(f"train.memory_budget_gb {budget_gb} is too small for FSDP over {shards} processes: "
                         f"with every block checkpointed each needs about {est.total / 2**30:.1f} GiB (an fp8 base "
                         "and offloading are not available under FSDP); add processes or raise the budget")
    if no_fp8 is not None and (prefer_fp8 or already_fp8):
        raise ValueError(f"an fp8 base was asked for ({'train.fp8_base' if prefer_fp8 else 'a base already in fp8'})"
                         f" but {no_fp8}")
    forms = ((False,) if no_fp8 is not None else (True,) if prefer_fp8 or already_fp8 else (False, True))
    for fp8 in forms:
        offloads = no_offload is None and (fp8 or no_fp8 is not None)  # bf16 offloads only where fp8 cannot be
        fits = [plan for n_ckpt in range(0, n + 1)
                if (plan := _fewest_offloaded(budget, fp8, -1 if n_ckpt == n else n_ckpt, n_ckpt if offloads else 0,
                                              model)) is not None]
        if fits:
            return min(fits, key=lambda p: (p.seconds, p.offload_blocks))
    fp8 = forms[-1]
    est = estimate_memory(fp8=fp8, n_checkpointed=-1, n_offloaded=0 if no_offload else n, **model)
    base = "an fp8 base" if fp8 else f"a bf16 base (no fp8: {no_fp8})"
    blocks = f" (no offload: {no_offload})" if no_offload else " and offloaded"
    raise ValueError(f"train.memory_budget_gb {budget_gb} is too small: even {base} with every block checkpointed"
                     f"{blocks} needs about {est.total / 2**30:.1f} GiB; raise the budget or train at a smaller "
                     "data.vae_area")


def model_sizes(transformer) -> dict:
    """Parameter counts `estimate_memory` needs, read off the model, and its family's own activation constants
    where it has them (`SIZES` of families/<family>/planner.py)."""
    blocks = transformer.transformer_blocks
    frozen = lambda m: sum(p.numel() for p in m.parameters() if not p.requires_grad) + sum(  # noqa: E731
        b.numel() for b in m.buffers())
    block_params = max(frozen(b) for b in blocks)
    total = frozen(transformer)
    trainable = sum(p.numel() for p in transformer.parameters() if p.requires_grad)
    sizes = {"n_blocks": len(blocks), "block_params": block_params,
             "other_params": total - sum(frozen(b) for b in blocks), "trainable_params": trainable,
             "dim": transformer.config.num_attention_heads * transformer.config.attention_head_dim}
    from qwen_edit_core.families import family_of
    sizes.update(family_of(transformer).stage("planner").SIZES)
    return sizes


def compiled_sizes(sizes: dict, compiled: bool) -> dict:
    """`model_sizes` for a run whose blocks are `compiled`: the 2025 family's compiled activation constant
    (`ACTIVATION_FACTOR_COMPILED`); a family with constants of its own keeps them, as do eager runs."""
    if not compiled or "activation_factor" in sizes:
        return sizes
    return {**sizes, "activation_factor": ACTIVATION_FACTOR_COMPILED}


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
