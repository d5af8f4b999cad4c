"""The entry points the trainer and the sampler call: every lever applied to one transformer instance."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from qwen_edit_core.speed.checkpointing import checkpoint_blocks, checkpointed_indices
from qwen_edit_core.speed.compile import compile_blocks
from qwen_edit_core.speed.lending import shared_copy
from qwen_edit_core.speed.fp8 import (_set_fp8_backward, dequantize_fp8, fp8_matmul_supported, has_fp8, probe_fp8,
                                      quantize_fp8)
from qwen_edit_core.speed.offload import BlockOffloader, offload_indices
from qwen_edit_core.speed.planner import free_memory_budget_gb, model_sizes, plan_for_budget, resident_bytes

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
    blocks are refused (train.sharding says why)."""
    device = torch.device(device)
    fp8, ckpt, n_off = train.fp8_base, (train.checkpoint_blocks if train.gradient_checkpointing else None), \
        train.offload_blocks
    budget = train.memory_budget_gb or (auto_budget_gb(transformer, device) if train.memory_budget_auto else 0.0)
    if budget > 0:
        plan = plan_for_budget(budget, prefer_fp8=train.fp8_base, tokens=tokens, shards=shards,
                               **model_sizes(transformer))
        fp8, ckpt, n_off = plan.fp8, plan.checkpoint_blocks, plan.offload_blocks
        log.info("memory budget %.1f GiB%s: fp8 base %s, checkpointed blocks %s, offloaded blocks %d (estimate "
                 "%.1f GiB)", budget, "" if train.memory_budget_gb else f" (the free memory of {device})", fp8,
                 "all" if ckpt < 0 else ckpt, n_off, plan.estimate.total / 2**30)
    if shards > 1 and (fp8 or n_off or has_fp8(transformer)):
        raise ValueError(f"FSDP cannot shard {'offloaded blocks' if n_off else 'an fp8 base'}: turn "
                         f"{'train.offload_blocks' if n_off else 'train.fp8_base'} off")
    return _apply(transformer, device, fp8=fp8, n_checkpointed=ckpt, n_offloaded=n_off, compile=train.compile,
                  fp8_backward=train.fp8_backward, hooks_outside=shards > 1)


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
    still be loaded, switched and scaled afterwards). `compile_mode="reduce-overhead"` adds CUDA graphs.
    Idempotent: a transformer already in fp8 or compiled stays so."""
    already = getattr(transformer, "_qwen_edit_compiled", False)
    levers = _apply(transformer, torch.device(device), fp8=fp8, n_checkpointed=None, n_offloaded=0,
                    compile=compile and not already, compile_mode=compile_mode)
    transformer._qwen_edit_compiled = already or compile
    return levers


def inference_copy(transformer, device: torch.device, *, fp8: bool, compile: bool,
                   compile_mode: str | None = None):
    """`configure_inference` on a new transformer object that shares every weight the levers leave alone:
    `transformer` itself is not changed (graphs that use it without the levers sample as before). fp8 layers
    are new tensors beside the shared bf16 ones; blocks the original had compiled are compiled again in the
    copy (a compiled call is bound to its own module)."""
    was_compiled = getattr(transformer, "_qwen_edit_compiled", False)
    fresh = shared_copy(transformer)
    configure_inference(fresh, device, fp8=fp8, compile=compile or was_compiled, compile_mode=compile_mode)
    return fresh


def _fp8_works(transformer, device) -> bool:
    """Probe the fp8 kernel once on `device`; when it raises, keep (or put back) a bf16 base and say so."""
    error = probe_fp8(device)
    if error is None:
        return True
    dtype = transformer.img_in.weight.dtype
    dtype = dtype if dtype.is_floating_point and dtype.itemsize >= 2 else torch.bfloat16
    log.warning("the fp8 kernel fails on %s (%s): the base stays in %s (fp8 turned off)", device, error,
                str(dtype).removeprefix("torch."))
    dequantize_fp8(transformer, dtype)
    return False


def _apply(transformer, device, *, fp8: bool, n_checkpointed: int | None, n_offloaded: int,
           compile: bool, compile_mode: str | None = None, fp8_backward: bool = False,
           hooks_outside: bool = False) -> Levers:
    n_blocks = len(transformer.transformer_blocks)
    if fp8 and not has_fp8(transformer) and not fp8_matmul_supported(device):
        raise ValueError(f"fp8 base weights need fp8 matmuls (CUDA compute capability >= 8.9); {device} has "
                         "none: turn fp8 off")
    if (fp8 or has_fp8(transformer)) and not _fp8_works(transformer, device):
        fp8 = False
    if fp8:
        quantize_fp8(transformer, fp8_backward=fp8_backward)  # idempotent
    else:  # layers already in fp8 (a scaled-fp8 file kept in fp8) still take the backward mode
        _set_fp8_backward(transformer, fp8_backward)
    offloaded = offload_indices(n_blocks, n_offloaded)
    if offloaded and n_checkpointed is not None and checkpointed_indices(n_blocks, n_checkpointed) != list(
            range(n_blocks)):
        log.info("offloaded blocks are always checkpointed: checkpointing every block")
        n_checkpointed = -1
    if offloaded and n_checkpointed is None:
        raise ValueError("train.offload_blocks needs train.gradient_checkpointing: an offloaded block's weights "
                         "must not stay on the device until the backward pass")
    checkpointed = checkpoint_blocks(transformer, n_checkpointed) if n_checkpointed is not None else []
    previous = getattr(transformer, "_qwen_edit_offloader", None)
    if previous is not None:
        previous.remove()
        transformer._qwen_edit_offloader = None
    if offloaded:
        transformer._qwen_edit_offloader = BlockOffloader(transformer.transformer_blocks, offloaded, device)
    compiled = compile_blocks(transformer, skip=offloaded, mode=compile_mode, hooks_outside=hooks_outside) \
        if compile else 0
    levers = Levers(fp8=has_fp8(transformer), checkpointed=tuple(checkpointed), offloaded=tuple(offloaded),
                    compiled=compiled)
    log.info("transformer levers: fp8 base %s, %d/%d blocks checkpointed, %d offloaded, %d compiled",
             levers.fp8, len(checkpointed), n_blocks, len(offloaded), compiled)
    return levers
