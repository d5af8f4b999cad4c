"""Sharded training (FSDP2 through accelerate): the frozen base split across processes, the LoRA whole on each.

Why the LoRA is kept out of FSDP (accelerate's `ignored_modules`): its parameters are a few MB, so sharding them
saves nothing, while keeping them whole means the optimizer state, the checkpoint and the saved LoRA are plain
tensors, exactly those of one process; resume works across process counts. Their gradients are averaged with one
all-reduce per optimizer step (what DDP would do), so N processes equal one process with the same global batch.

The speed levers under FSDP2 (`check_levers`, called before any weight loads):
- gradient checkpointing: supported (a recomputed block's weights are gathered again by FSDP2's hooks);
- compile: supported; each block's own forward is compiled and FSDP2's gather/reshard hooks run around it
  (`speed.compile_blocks(hooks_outside=True)`);
- the memory planner (`train.memory_budget_gb`): supported, it plans each process's share of the frozen weights
  and chooses only the checkpointed blocks;
- fp8 base (`train.fp8_base`, `model.transformer_fp8: keep`): refused. Its weights are buffers, which FSDP2 does
  not shard, so every process would hold all of them; under FSDP a scaled-fp8 file is upcast (`auto`);
- block offload (`train.offload_blocks`): refused. FSDP2 owns each block's frozen weights (a sharded copy, the
  whole gathered just before the block runs and freed after), so the offloader would move tensors FSDP2 replaces
  on every call; sharding already divides the resident weights by the number of processes.

Loading: each process reads the transformer into host memory (`host_plan`, the planned loader), never whole
onto its device. `fully_shard` moves a unit's frozen tensors to the device and keeps this process's shard
(torch/distributed/fsdp/_fully_shard/_fsdp_init.py `_move_states_to_device`, then the unit's parameters are
sharded), one block after the other, so the device holds the shards made so far plus one whole block; the
LoRA, which FSDP2 leaves alone, is moved to the device afterwards.
"""

from __future__ import annotations

import logging
import os

import torch

from qwen_edit_core.families import DEFAULT, FAMILIES

log = logging.getLogger(__name__)

#: the FSDP unit: one transformer block (`Family.block_class`); the accelerate config may name any family's block
#: class: the unit is always the trained model's own block
BLOCK_CLASS = DEFAULT.block_class


def block_classes() -> tuple[str, ...]:
    """Every family's transformer block class name (what FSDP_TRANSFORMER_CLS_TO_WRAP may name)."""
    return tuple(f.block_class for f in FAMILIES.values())


def is_fsdp() -> bool:
    """True when `accelerate launch` was given an FSDP config (it exports ACCELERATE_USE_FSDP to each process)."""
    return os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true"


def is_sharded() -> bool:
    """True in a process of a multi-process FSDP run (`accelerate launch` with an FSDP config)."""
    return is_fsdp() and int(os.environ.get("WORLD_SIZE", "1")) > 1


def check_levers(config) -> None:
    """Refuse, before any weight loads, the speed levers FSDP2 cannot take (module doc), naming the setting."""
    if not is_sharded():
        return
    t, why = config.train, "; train with data parallel (an accelerate config without FSDP) to use it"
    if t.offload_blocks:
        raise ValueError(f"train.offload_blocks {t.offload_blocks} is not available under FSDP: FSDP2 owns each "
                         "block's frozen weights (sharded, gathered just before the block runs), so they cannot "
                         f"be offloaded; set it to 0 (each process already holds 1/N of the weights){why}")
    if t.fp8_base or config.model.transformer_fp8 == "keep":
        setting = "train.fp8_base" if t.fp8_base else "model.transformer_fp8: keep"
        raise ValueError(f"{setting} is not available under FSDP: an fp8 base keeps its weights as buffers, which "
                         f"FSDP2 does not shard, so every process would hold all of them; turn it off{why}")


def host_plan(dtype: torch.dtype):
    """The transformer's plan in a process of an FSDP2 run: every weight read into host memory in `dtype` (no
    fp8, no offload: both refused under FSDP2), so the device receives only what `shard_frozen_base` keeps. Not
    a training plan: the levers are planned afterwards for this process's share (`speed.configure_training`
    with `shards`)."""
    from qwen_edit_core import speed
    return speed.WeightPlan(device=torch.device("cpu"), dtype=dtype)


def shard_frozen_base(model: torch.nn.Module, device: torch.device, world: int) -> torch.nn.Module:
    """Shard `model`'s frozen weights with FSDP2 (`fully_shard`, in place): one unit per transformer block plus
    the root for the rest; the trainable (LoRA) parameters are `ignored_params`, whole on every process.

    We call torch's `fully_shard` ourselves instead of `Accelerator.prepare_model`: accelerate turns FSDP on only
    for GPU-family process groups (accelerate 1.15 `state.py`: FSDP is set for MULTI_GPU/..., never MULTI_CPU),
    so its path could not be tested without GPUs, and the LoRA must stay outside FSDP (above). The accelerate
    config's FSDP settings are read from the environment its launcher exports.
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from qwen_edit_core import speed

    if os.environ.get("FSDP_VERSION", "1") != "2":
        raise ValueError("FSDP training needs fsdp_version: 2 in the accelerate config (FSDP1 cannot mix frozen "
                         "and trainable weights in one unit); see examples/fsdp2.yaml")
    if speed.has_fp8(model):
        raise ValueError("FSDP training cannot shard an fp8 base: its weights are buffers, which FSDP2 does not "
                         "shard, so every process would hold all of them. Turn train.fp8_base off (and load a "
                         "bf16 transformer file), or train with data parallel (plain `accelerate launch`)")
    wrap = os.environ.get("FSDP_TRANSFORMER_CLS_TO_WRAP", BLOCK_CLASS)
    if wrap not in block_classes():
        ours = type(model.transformer_blocks[0]).__name__
        raise ValueError(f"fsdp_transformer_layer_cls_to_wrap {wrap!r}: the unit must be the transformer block "
                         f"({' or '.join(block_classes())}; this model's is {ours})")
    reshard = os.environ.get("FSDP_RESHARD_AFTER_FORWARD", "true").lower() not in ("false", "no_shard")
    mesh = init_device_mesh(torch.device(device).type, (world,))
    lora = {p for p in model.parameters() if p.requires_grad}
    for block in model.transformer_blocks:  # each block moved to the device, then sharded (module doc)
        fully_shard(block, mesh=mesh, reshard_after_forward=reshard, ignored_params=lora)
    fully_shard(model, mesh=mesh, ignored_params=lora)
    with torch.no_grad():  # FSDP2 leaves ignored parameters where they are: the host after a host load
        for param in lora:
            if param.device != torch.device(device):
                param.data = param.data.to(device)
    log.info("FSDP: frozen base sharded over %d processes in %d block units; LoRA whole on each process",
             world, len(model.transformer_blocks))
    return model


def average_gradients(params: list[torch.nn.Parameter], world: int) -> None:
    """Average the LoRA gradients over processes with one all-reduce (they are outside FSDP's reduce-scatter)."""
    import torch.distributed as dist

    grads = [p.grad for p in params if p.grad is not None]
    if not grads or world == 1:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat)
    flat /= world
    offset = 0
    for g in grads:
        g.copy_(flat[offset:offset + g.numel()].view_as(g))
        offset += g.numel()
