"""The transformer's memory plan, decided before any weight is read: which form and place each weight takes.

A `WeightPlan` says on which device and in which dtype the transformer computes, whether its block linears are
kept in fp8, which blocks stay in host memory (offloaded, copied in as they run) and how many blocks recompute
their activations. `plan_training` makes it from the training config, the model's parameter counts (read off a
meta-device model: no weight needed), the longest sequence and the memory the device has free; the planned
loader (model/planned_load.py) then puts every weight straight into that form and place, and `configure_training`
applies the rest (checkpointing, compile) without planning again. Loading first and planning afterwards would
put the whole bf16 transformer on the device before the plan could shrink it (docs/MODEL.md, "The real model's sizes").
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from qwen_edit_core.speed.checkpointing import checkpointed_indices
from qwen_edit_core.speed.fp8 import fp8_matmul_supported, probe_fp8
from qwen_edit_core.speed.offload import offload_indices
from qwen_edit_core.speed.planner import compiled_sizes, free_memory_budget_gb, plan_for_budget

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class WeightPlan:
    """Where and in which form the transformer's weights live.

    `device` / `dtype`: where it computes and the dtype of every weight not in fp8; `fp8`: the block linears
    are `speed.Fp8Linear` (e4m3, per-channel scales); `offloaded`: block indices whose frozen weights stay in
    host memory (pinned on CUDA) and are copied in just before each block runs; `checkpoint_blocks`: blocks that
    recompute in the backward pass (-1 all, None no checkpointing: sampling); `fp8_backward`: fp8 input
    gradients too; `training`: a training run's plan (`configure_training` applies it as it is), not a sampling
    one."""

    device: torch.device
    dtype: torch.dtype
    fp8: bool = False
    offloaded: tuple[int, ...] = ()
    checkpoint_blocks: int | None = None
    fp8_backward: bool = False
    training: bool = False

    @property
    def pin(self) -> bool:
        """Host copies of offloaded blocks are pinned (page-locked) only for a CUDA device: asynchronous copies."""
        return torch.device(self.device).type == "cuda"


#: Why an adapter kind cannot train on an fp8 base (`speed.Fp8Linear`: e4m3 weights and per-row scales, no
#: `weight`), by `model.lora.type` ("dora": a LoRA with `model.lora.dora`); peft 0.21 (`tuners/lora/dora.py`,
#: `tuners/lokr/layer.py`, `tuners/loha/layer.py`). Such a base is planned in bf16, offloading blocks instead.
NO_FP8 = {
    "dora": "DoRA reads the base weight itself at every step (each output row's norm of W + BA: peft's "
            "DoraLinearLayer)",
    "lokr": "peft's LoKr wraps only nn.Linear bases and shapes its delta like the base's `weight` (LoKrLayer)",
    "loha": "peft's LoHa wraps only nn.Linear bases and shapes its delta like the base's `weight` (LoHaLayer)",
}
#: why a bitsandbytes-quantized base (`model.quantize` int8/nf4) takes neither fp8 nor offload
NO_FP8_BNB = "its block linears are bitsandbytes int8/nf4 layers already (model.quantize)"
NO_OFFLOAD_BNB = ("bitsandbytes keeps each weight's quantization state beside it (Int8Params.SCB, "
                  "Params4bit.quant_state), which the offloader's copies into a flat device buffer do not carry")


def adapter_no_fp8(kind: str, dora: bool) -> str | None:
    """Why an adapter of `model.lora.type` `kind` (with `model.lora.dora`) cannot train on an fp8 base
    (`NO_FP8`), or None: a plain LoRA wraps `speed.Fp8Linear` (adapters/kinds.py)."""
    return NO_FP8["dora"] if dora else NO_FP8.get(kind)


def base_limits(transformer: torch.nn.Module) -> tuple[str | None, str | None]:
    """(why no fp8, why no offload) for a loaded transformer, from its layers: a DoRA, LoKr or LoHa adapter
    already injected (`NO_FP8`), bitsandbytes layers (`NO_FP8_BNB`, `NO_OFFLOAD_BNB`); None where the lever can
    apply."""
    from peft.tuners.loha import LoHaLayer
    from peft.tuners.lokr import LoKrLayer
    from peft.tuners.lora import LoraLayer
    no_fp8 = no_offload = None
    for module in transformer.modules():
        if type(module).__module__.split(".")[0] == "bitsandbytes":
            return NO_FP8_BNB, NO_OFFLOAD_BNB
        if no_fp8 is None:
            if isinstance(module, LoraLayer) and any(module.use_dora.values()):
                no_fp8 = NO_FP8["dora"]
            elif isinstance(module, (LoKrLayer, LoHaLayer)):
                no_fp8 = NO_FP8["lokr" if isinstance(module, LoKrLayer) else "loha"]
    return no_fp8, no_offload


def base_bytes_of(transformer: torch.nn.Module) -> float:
    """Bytes per frozen parameter element of the transformer's blocks as stored (a bitsandbytes base: int8 one,
    nf4's packed bytes one per element; what `planner.estimate_memory` takes as `base_bytes`)."""
    tensors = [t for block in transformer.transformer_blocks
               for t in (*block.parameters(), *block.buffers()) if not t.requires_grad]
    return sum(t.numel() * t.element_size() for t in tensors) / max(1, sum(t.numel() for t in tensors))


def plan_training(train, device: torch.device, dtype: torch.dtype, sizes: dict, tokens: int, *,
                  available: int | None = None, already_fp8: bool = False, shards: int = 1,
                  no_fp8: str | None = None, no_offload: str | None = None) -> WeightPlan:
    """The plan of a training run from `train.{memory_budget_gb, memory_budget_auto, fp8_base, fp8_backward,
    gradient_checkpointing, checkpoint_blocks, offload_blocks}`.

    `sizes`: `planner.model_sizes` of the transformer with its LoRA (a meta-device model will do); `tokens`: the
    longest sequence of a step; `available`: bytes the transformer may use on a CUDA device (its free memory, plus
    the transformer's own weights when they are already there), None elsewhere (`memory_budget_auto` then plans
    nothing); `already_fp8`: the block linears are fp8 already (a scaled-fp8 file kept in fp8); `shards`: the
    processes the frozen base is sharded over (FSDP2; the planner counts one share); `no_fp8` / `no_offload`:
    why the base cannot take fp8 / offloaded blocks (`adapter_no_fp8`, `base_limits`), refused by name when
    asked for and never planned."""
    device = torch.device(device)
    fp8, ckpt = train.fp8_base, (train.checkpoint_blocks if train.gradient_checkpointing else None)
    n_off = train.offload_blocks
    if no_fp8 is not None and (fp8 or already_fp8):
        raise ValueError(f"{'train.fp8_base' if fp8 else 'a transformer kept in fp8 (model.transformer_fp8)'} asks "
                         f"for an fp8 base, and {no_fp8}: turn it off (model.transformer_fp8: upcast for a scaled-fp8"
                         " file) or train a plain LoRA")
    if no_offload is not None and n_off:
        raise ValueError(f"train.offload_blocks {n_off}: {no_offload}; set it to 0")
    budget = train.memory_budget_gb
    if not budget and train.memory_budget_auto and device.type == "cuda" and available is not None:
        budget = free_memory_budget_gb(available, 0)
    if budget > 0:
        chosen = plan_for_budget(budget, prefer_fp8=train.fp8_base, tokens=tokens, shards=shards,
                                 already_fp8=already_fp8, no_fp8=no_fp8, no_offload=no_offload,
                                 **compiled_sizes(sizes, train.compile))
        fp8, ckpt, n_off = chosen.fp8, chosen.checkpoint_blocks, chosen.offload_blocks
        log.info("memory budget %.1f GiB%s: fp8 base %s, checkpointed blocks %s, offloaded blocks %d (estimate "
                 "%.1f GiB)", budget, "" if train.memory_budget_gb else f" (the free memory of {device})", fp8,
                 "all" if ckpt < 0 else ckpt, n_off, chosen.estimate.total / 2**30)
    return checked_plan(device, dtype, sizes["n_blocks"], fp8=fp8, n_checkpointed=ckpt, n_offloaded=n_off,
                        fp8_backward=train.fp8_backward, already_fp8=already_fp8, training=True)


def checked_plan(device: torch.device, dtype: torch.dtype, n_blocks: int, *, fp8: bool,
                 n_checkpointed: int | None, n_offloaded: int, fp8_backward: bool = False,
                 already_fp8: bool = False, training: bool = False) -> WeightPlan:
    """A consistent plan: fp8 only where the fp8 kernel runs (refused where the device has no fp8 matmuls,
    dropped with a warning where the kernel fails), offloading refused without checkpointing, and offloaded
    blocks among the checkpointed ones (an offloaded block's weights must not stay on the device until the
    backward pass): spread over them, with at least as many blocks checkpointed as are offloaded."""
    device = torch.device(device)
    if fp8 and not already_fp8 and not fp8_matmul_supported(device):
        raise ValueError(f"fp8 base weights need fp8 matmuls (CUDA compute capability >= 8.9); {device} has "
                         "none: turn fp8 off")
    if fp8 or already_fp8:
        error = probe_fp8(device)
        if error is not None:
            log.warning("the fp8 kernel fails on %s (%s): the base stays in %s (fp8 turned off)", device, error,
                        str(dtype).removeprefix("torch."))
            fp8 = False
    n_offloaded = max(0, min(n_offloaded, n_blocks))
    if n_offloaded and n_checkpointed is None:
        raise ValueError("train.offload_blocks needs train.gradient_checkpointing: an offloaded block's weights "
                         "must not stay on the device until the backward pass")
    checkpointed = len(checkpointed_indices(n_blocks, n_checkpointed)) if n_offloaded else n_blocks
    if checkpointed < n_offloaded:
        log.info("offloaded blocks are checkpointed ones: checkpointing %d blocks (not %d) for %d offloaded",
                 n_offloaded, checkpointed, n_offloaded)
        n_checkpointed = checkpointed = n_offloaded
    offloaded = tuple(offload_indices(checkpointed, n_offloaded))  # the first `checkpointed` blocks recompute
    return WeightPlan(device=device, dtype=dtype, fp8=fp8, offloaded=offloaded, checkpoint_blocks=n_checkpointed,
                      fp8_backward=fp8_backward, training=training)
