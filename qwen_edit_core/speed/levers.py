"""The entry points the trainer and the sampler call: every lever applied to one transformer instance."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from qwen_edit_core.speed.checkpointing import checkpoint_blocks
from qwen_edit_core.speed.compile import compile_blocks
from qwen_edit_core.speed.fp8 import _set_fp8_backward, dequantize_fp8, has_fp8, probe_fp8, quantize_fp8
from qwen_edit_core.speed.lending import lend_for_sampling, loan_of, shared_copy
from qwen_edit_core.speed.offload import BlockOffloader
from qwen_edit_core.speed.planner import free_memory_budget_gb, model_sizes, resident_bytes
from qwen_edit_core.speed.weight_plan import WeightPlan, base_bytes_of, base_limits, checked_plan, plan_training

log = logging.getLogger(__name__)

@dataclass(frozen=True)
class Levers:
    """The levers in effect for a run (logged, and returned to benchmarks)."""

    fp8: bool
    checkpointed: tuple[int, ...]
    offloaded: tuple[int, ...]
    compiled: int


def configure_training(transformer, train, device: torch.device, tokens: int, shards: int = 1) -> Levers:
    """Apply `train.{memory_budget_gb, fp8_base, fp8_backward, gradient_checkpointing, checkpoint_blocks,
    offload_blocks, compile}` to a transformer whose LoRA is already injected. `tokens`: the longest sequence
    of a step. `shards` > 1: the frozen base will be sharded over that many processes (FSDP2): the planner
    counts each process's share, blocks compile without the hooks FSDP2 adds, and an fp8 base or offloaded
    blocks are refused (train.sharding says why).

    A transformer loaded by the planned loader (model/planned_load.py) carries the plan it was loaded with
    (`loaded_plan`): its fp8 layers and offloaded blocks are already in place and that plan is applied as it is,
    not made again; any other transformer is planned here, from the weights it holds and the adapter it carries
    (a DoRA, LoKr or LoHa adapter, or bitsandbytes layers: no fp8, `weight_plan.base_limits`)."""
    device = torch.device(device)
    plan = loaded_plan(transformer)
    if plan is None:
        available = None
        if device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(device)
            available = free + resident_bytes(transformer, device)
        no_fp8, no_offload = base_limits(transformer)
        sizes = model_sizes(transformer)
        if no_offload is not None:  # a bitsandbytes base: its int8/nf4 bytes, not bf16's
            sizes = {**sizes, "base_bytes": base_bytes_of(transformer)}
        plan = plan_training(train, device, transformer.img_in.weight.dtype, sizes, tokens,
                             available=available, already_fp8=has_fp8(transformer), shards=shards, no_fp8=no_fp8,
                             no_offload=no_offload)
    if shards > 1 and (plan.fp8 or plan.offloaded or has_fp8(transformer)):
        raise ValueError(f"FSDP cannot shard {'offloaded blocks' if plan.offloaded else 'an fp8 base'}: turn "
                         f"{'train.offload_blocks' if plan.offloaded else 'train.fp8_base'} off")
    return _apply(transformer, plan, compile=train.compile, hooks_outside=shards > 1)


def loaded_plan(transformer) -> WeightPlan | None:
    """The training plan a transformer was loaded with (model/planned_load.py), or None (loaded otherwise, or
    with a sampling plan)."""
    plan = getattr(transformer, "_qwen_edit_plan", None)
    return plan if plan is not None and plan.training else None


def auto_budget_gb(transformer, device: torch.device) -> float:
    """`train.memory_budget_auto`: the planner's budget on a CUDA device, its free memory now plus the
    transformer's weights already there (planner.free_memory_budget_gb); 0 (no planner) elsewhere."""
    device = torch.device(device)
    if device.type != "cuda":
        return 0.0
    free, _ = torch.cuda.mem_get_info(device)
    return free_memory_budget_gb(free, resident_bytes(transformer, device))


def release_training(transformer) -> None:
    """Take checkpointing and offload off a transformer trained in place (offloaded blocks back on their
    device). fp8 base layers stay fp8 and compiled blocks stay compiled: a model someone else keeps using is
    trained as a copy instead (`speed.lend` / `give_back`), which leaves it exactly as it was."""
    offloader = getattr(transformer, "_qwen_edit_offloader", None)
    if offloader is not None:
        offloader.remove()
        transformer._qwen_edit_offloader = None
    if getattr(transformer, "is_gradient_checkpointing", False):
        transformer.disable_gradient_checkpointing()


def configure_inference(transformer, device: torch.device, *, fp8: bool, compile: bool,
                        compile_mode: str | None = None) -> Levers:
    """fp8 base weights and compiled blocks for sampling, in place (LoRAs stay in their own dtype and can
    still be loaded, switched and scaled afterwards). `compile_mode`: torch.compile's mode for the blocks (not a
    CUDA-graph mode: `compile.CUDA_GRAPH_MODES`).
    Idempotent: a transformer already in fp8 or compiled stays so."""
    already = getattr(transformer, "_qwen_edit_compiled", False)
    device = torch.device(device)
    plan = checked_plan(device, transformer.img_in.weight.dtype, len(transformer.transformer_blocks), fp8=fp8,
                        n_checkpointed=None, n_offloaded=0, already_fp8=has_fp8(transformer))
    levers = _apply(transformer, plan, compile=compile and not already, compile_mode=compile_mode)
    transformer._qwen_edit_compiled = already or compile
    return levers


def inference_copy(transformer, device: torch.device, *, fp8: bool, compile: bool,
                   compile_mode: str | None = None):
    """`configure_inference` on a new transformer object that shares every weight the levers leave alone:
    `transformer`'s modules are not changed (graphs that use it without the levers sample as before); blocks the
    original had compiled are compiled again in the copy (a compiled call is bound to its own module).

    With fp8, each block linear's bf16 weight is parked in host memory as soon as its fp8 layer exists
    (`lending.lend_for_sampling`), so the device never holds both forms: the peak is the input's weights plus
    one layer's conversion, and then about half the block weights. The input gets its weights back when it is
    used again (`speed.unpark`), and the copy parks them again when it runs (`speed.repark`)."""
    was_compiled = getattr(transformer, "_qwen_edit_compiled", False)
    fresh = lend_for_sampling(transformer) if fp8 and not has_fp8(transformer) else shared_copy(transformer)
    configure_inference(fresh, device, fp8=fp8, compile=compile or was_compiled, compile_mode=compile_mode)
    return fresh


def _apply(transformer, plan: WeightPlan, *, compile: bool, compile_mode: str | None = None,
           hooks_outside: bool = False) -> Levers:
    """Put `plan` into effect on `transformer`: fp8 block linears (already there after a planned load), the
    fp8 backward mode, checkpointing, the block offloader (kept when a planned load made it for these blocks),
    compiled blocks."""
    device, n_blocks = plan.device, len(transformer.transformer_blocks)
    if has_fp8(transformer) and not plan.fp8 and probe_fp8(device) is not None:
        dequantize_fp8(transformer, plan.dtype)  # the kernel fails here (checked_plan said so): back to plan.dtype
    if plan.fp8:
        quantize_fp8(transformer, fp8_backward=plan.fp8_backward)  # idempotent
    else:  # layers already in fp8 (a scaled-fp8 file kept in fp8) still take the backward mode
        _set_fp8_backward(transformer, plan.fp8_backward)
    checkpointed = checkpoint_blocks(transformer, plan.checkpoint_blocks) if plan.checkpoint_blocks is not None \
        else []
    previous = getattr(transformer, "_qwen_edit_offloader", None)
    if previous is not None and (tuple(previous.indices) != plan.offloaded or previous.device != device):
        previous.remove()
        transformer._qwen_edit_offloader = previous = None
    if plan.offloaded and previous is None:
        transformer._qwen_edit_offloader = BlockOffloader(transformer.transformer_blocks, plan.offloaded, device,
                                                          loan=loan_of(transformer))
    # Offloaded blocks compile their forward alone: the offloader's hooks run eagerly around it. (Left eager, a
    # plan that offloads most blocks would run most of the model uncompiled: BENCHMARKS.md has the step times.)
    compiled = compile_blocks(transformer, forward_only=list(plan.offloaded), mode=compile_mode,
                              hooks_outside=hooks_outside) if compile else 0
    levers = Levers(fp8=has_fp8(transformer), checkpointed=tuple(checkpointed), offloaded=plan.offloaded,
                    compiled=compiled)
    log.info("transformer levers: fp8 base %s, %d/%d blocks checkpointed, %d offloaded, %d compiled",
             levers.fp8, len(checkpointed), n_blocks, len(plan.offloaded), compiled)
    return levers
